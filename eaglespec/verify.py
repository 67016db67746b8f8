"""Verification: which drafted nodes the target accepts, and the token it adds after them.

Greedy keeps the longest path that matches the target's argmax. Sampling walks down the tree with
recursive rejection sampling over each node's (deterministic) children: child x is accepted with
probability p(x); on rejection p(x) is zeroed and p renormalised; if all are rejected the next token
is drawn from what is left of p. For any fixed set of candidates this draws exactly from p, so the
output distribution is the target's. Drafts *sampled* from the head (T > 0, the default) have their own rule,
`verify_sampled`: child x is accepted with min(1, p(x) / q(x)) and a rejection leaves p's residual.
"""
from __future__ import annotations

import torch

from .sampling import SamplingParams, sample, target_probs
from .tree import Tree


def greedy_accept(tree: Tree, argmax: torch.Tensor | list[int]) -> tuple[list[int], int, list[int]]:
    """Greedy verification: (accepted node indices, root first; bonus token; the new tokens, i.e. the
    accepted nodes' tokens after the root, then the bonus). Also the walk of tree_draws' draws, given for
    `argmax`: the token that follows each node, whatever rule chose it.

    A node is accepted when its token equals the target's argmax at its parent, and so are all its
    ancestors'. Siblings carry distinct tokens, so the accepted nodes form one path; its deepest node
    gives the bonus token. One host read per round (the argmax); the walk is on the tree's host lists,
    parents before children, since a few dozen list steps cost less than tensor operations here."""
    tokens, parents, depths = tree.host_lists()
    best = argmax[:len(tokens)].tolist() if isinstance(argmax, torch.Tensor) else argmax
    ok, deepest = [True] * len(tokens), 0
    for i in range(1, len(tokens)):
        par = parents[i]
        ok[i] = ok[par] and tokens[i] == best[par]
        if ok[i] and depths[i] > depths[deepest]:
            deepest = i
    path, node = [], deepest
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    bonus = best[deepest]
    return path, bonus, [tokens[i] for i in path[1:]] + [bonus]


def verify(tree: Tree, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> tuple[list[int], int]:
    """logits: (N, V), the target's output at every tree node. Returns the accepted node indices
    (root first) and the next token after the last of them (the bonus token)."""
    kids = tree.children()
    tokens = tree.host_lists()[0]
    path, node = [0], 0
    if params.greedy:
        best = logits.argmax(-1).tolist()
        while True:
            nxt = next((c for c in kids[node] if tokens[c] == best[node]), None)
            if nxt is None:
                return path, best[node]
            path.append(nxt)
            node = nxt
    while True:
        p = target_probs(logits[node], params)
        for c in kids[node]:
            t = tokens[c]
            if float(torch.rand((), generator=generator, device=p.device)) < float(p[t]):
                path.append(c)
                node = c
                break
            p[t] = 0.0
            total = p.sum()
            if total <= 0:  # everything left was rejected: only reachable by rounding
                return path, sample(target_probs(logits[node], params), generator)
            p = p / total
        else:
            return path, sample(p, generator)


def verify_sampled(tree: Tree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                   q_logp: torch.Tensor, node_row: list[int], node_rank: list[int],
                   draft_ids: torch.Tensor | None) -> tuple[list[int], int, list[tuple[int, int, bool]]]:
    """Verification of *sampled* drafts (T > 0): recursive rejection sampling without replacement.

    Each node's children were drawn from the head's distribution q at that node (q_logp[node_row[child]], over
    the draft vocabulary; draft_ids maps it to the target's), without replacement, and are tried in that order
    (node_rank). Child x is accepted with probability min(1, p(x) / q(x)); on rejection p becomes
    normalise(max(0, p - q)) and x leaves q (q renormalised), and the next child is tried; if all are rejected the
    token is drawn from what is left of p. Each step emits exactly p whatever q is (the SpecInfer / recursive
    speculative decoding argument), so the output is the target's distribution, provided the tree's shape did not
    depend on the drafted tokens (RankAcceptance). Why sampled drafts: at T = 1 a draft sampled from q is
    accepted with probability sum_x min(p, q), far above the p(x) a deterministic top-1 candidate gets when the
    target's distribution is flat (0.45 against 0.28 on the target's own MT-bench answers; docs/performance.md,
    "Sampled drafts").

    Returns (accepted node indices, root first; the bonus token; (depth, rank, accepted) of every child tried)."""
    kids = tree.children()
    tokens, _, depths = tree.host_lists()
    vocab = logits.shape[-1]
    path, node, trials = [0], 0, []
    while True:
        p = target_probs(logits[node], params)
        children = kids[node]
        if not children:
            return path, sample(p, generator), trials
        q_draft = q_logp[node_row[children[0]]].float().exp()
        q = q_draft if draft_ids is None else torch.zeros(vocab, device=p.device).index_copy_(0, draft_ids, q_draft)
        q = q / q.sum()
        for c in sorted(children, key=lambda c: node_rank[c]):
            t = tokens[c]
            u = float(torch.rand((), generator=generator, device=p.device))
            qt, pt = float(q[t]), float(p[t])
            if qt <= 0.0:  # a token the head could not have drawn: only a caller's error reaches this
                raise ValueError(f"sampled draft token {t} has no draft probability")
            if u * qt < pt:  # u < min(1, p / q)
                trials.append((depths[c], node_rank[c], True))
                path.append(c)
                node = c
                break
            trials.append((depths[c], node_rank[c], False))
            residual = (p - q).clamp_(min=0.0)
            total = float(residual.sum())
            if total <= 0.0:  # p <= q everywhere means p == q, where rejection cannot happen: rounding only
                return path, sample(p, generator), trials
            p = residual / total
            q[t] = 0.0
            rest = float(q.sum())
            if rest <= 0.0:  # every token the head could draw was tried
                return path, sample(p, generator), trials
            q = q / rest
        else:
            return path, sample(p, generator), trials


def tree_draws(p: torch.Tensor, q: torch.Tensor, kids: torch.Tensor, kid_ok: torch.Tensor,
               u: torch.Tensor, det: torch.Tensor | None = None) -> torch.Tensor:
    """verify_sampled's rule at every tree node at once, as tensor operations (so that it can run inside the
    verification's compiled graph): y[j], the token that follows node j if j is accepted, drawn exactly from the
    target's distribution p_j there. Node j's children are tried in rank order: child x is taken with
    min(1, p(x) / q(x)); a rejection leaves p's residual normalise(max(0, p - q)) and removes x from q; if none is
    taken, y[j] is drawn from what is left of p (by inverting its float64 cumulative sum, as `sample`).

    A child is accepted exactly when its token is its parent's y (a rejected child's residual mass is 0, so the
    final draw never lands on it), so acceptance is greedy_accept's walk with y for the argmax, and the next token
    after the last accepted node is its y. Why every node: the head's catch-up is fed (feature, next token) for
    the accepted nodes, and inside the graph we do not know yet which they are. On CPU the engine runs the same
    rule as a kernel (cpugemm's `tree_draws`); this is its reference and the path elsewhere.

    p (n, V): the target's distribution at each node (target_probs); q (n, V): the draft distribution node j's
    children were drawn from (any row for a node without children); kids (n, K): the children's tokens in the
    order tried, kid_ok (n, K) which of them exist; u (n, K + 1) float64 uniforms, one per trial and one for the
    final draw, independent of everything else.

    det (n,), optional: a child proposed deterministically (the n-gram chain's token under the node; -1: none),
    tried before the head's children as a proposal of all its mass on one token: taken with probability p(x),
    and a rejection leaves p without x, renormalised; then the head's children are tried on that residual as
    above (one of them may be x itself: its residual mass is 0 then, so it is rejected). Each stage draws from
    the residual it is given whatever the earlier coins were, so the node's token still follows p. The chain's
    token must be tried whether or not the head drew it too: trying it only when the head did not would make the
    rule depend on the head's draws, and the output would no longer follow p. With det, u has K + 2 columns, the
    last one for this trial."""
    p = p.float()
    q = q.float()
    q = q / q.sum(-1, keepdim=True).clamp(min=1e-30)
    n, vocab = p.shape
    y = torch.zeros(n, dtype=torch.long, device=p.device)
    taken = torch.zeros(n, dtype=torch.bool, device=p.device)
    trying = torch.ones(n, dtype=torch.bool, device=p.device)
    if det is not None:
        has = det >= 0
        x = det.clamp(min=0)[:, None]
        take = has & (u[:, kids.shape[1] + 1] < p.gather(1, x)[:, 0])
        y, taken = torch.where(take, det, y), take
        without = p.scatter(1, x, 0.0)
        total = without.sum(-1, keepdim=True)
        p = torch.where((has & ~take)[:, None] & (total > 0), without / total.clamp(min=1e-30), p)
        trying = ~take
    for r in range(kids.shape[1]):
        c = kids[:, r:r + 1]
        live = kid_ok[:, r] & trying
        pt, qt = p.gather(1, c)[:, 0], q.gather(1, c)[:, 0]
        take = live & (u[:, r] * qt < pt)
        y = torch.where(take, c[:, 0], y)
        taken = taken | take
        rej = live & ~take
        residual = (p - q).clamp(min=0.0)
        total = residual.sum(-1, keepdim=True)
        # total <= 0 (p == q up to rounding) or nothing left in q: verify_sampled draws from p as it stands
        p = torch.where(rej[:, None] & (total > 0), residual / total.clamp(min=1e-30), p)
        q_left = q.scatter(1, c, 0.0)
        rest = q_left.sum(-1, keepdim=True)
        q = torch.where(rej[:, None] & (rest > 0), q_left / rest.clamp(min=1e-30), q)
        trying = trying & ~take & ~(rej & ((total[:, 0] <= 0) | (rest[:, 0] <= 0)))
    cdf = p.double().cumsum(-1)
    at = u[:, kids.shape[1]] * cdf[:, -1]
    drawn = (cdf <= at[:, None]).sum(-1)  # the first index whose cumulative mass exceeds u: searchsorted(right)
    # u rounded up to the total: the last token with any mass (as `sample`)
    last = torch.where(p > 0, torch.arange(vocab, device=p.device), -1).amax(-1)
    drawn = torch.where(drawn >= vocab, last, drawn)
    return torch.where(taken, y, drawn)


def trials_from_draws(tree: Tree, path: list[int], draws: list[int], node_rank: list[int],
                      chain: frozenset = frozenset()) -> list[tuple[int, int, bool]]:
    """The (depth, rank, accepted) of every child tree_draws tried on the accepted path (verify_sampled's
    `trials`, for RankAcceptance): at each path node its children in rank order up to the one its draw took.
    chain: the tree nodes that were tried as det (the n-gram chain's): not the head's trials; a node whose draw
    took its chain child tried none of the head's."""
    kids = tree.children()
    tokens, _, depths = tree.host_lists()
    trials = []
    for node in path:
        if any(c in chain and tokens[c] == draws[node] for c in kids[node]):
            continue
        for c in sorted((c for c in kids[node] if c not in chain), key=lambda c: node_rank[c]):
            hit = tokens[c] == draws[node]
            trials.append((depths[c], node_rank[c], hit))
            if hit:
                break
    return trials
