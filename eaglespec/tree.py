"""Drafting: grow a tree of candidate tokens with the draft head (the proposer).

Drafting is tensor operations on the device: no per-node Python lists and no host reads inside the
depth loop. A round drafts *candidates* (every node the head proposed, with its parent, depth and
cumulative log-probability); the tree that is verified is a subset of them chosen afterwards, so its
size can be picked by a cost model once the scores are known. That choice reads the candidates to
the host once (`HostCandidates`) and builds the tree from the lists (`tree_from_host`).

In the verified tree, node 0 is the root (the last token already chosen, which the target has not
yet processed); every other node is a candidate continuation, and parents precede their children.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# EAGLE-1's static tree (mc_sim_7b_63): each node is the path of top-k ranks from the root.
EAGLE1_TREE = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
               [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
               [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]


@dataclass(frozen=True)
class TreeConfig:
    kind: str = "dynamic"      # dynamic (EAGLE-2) | static (EAGLE-1) | chain
    top_k: int = 4
    depth: int = 5             # the deepest a round may draft
    total_tokens: int = 16     # draft nodes kept, root excluded (dynamic, fixed size)
    auto: bool = False         # dynamic only: size and depth chosen each round by the cost model
    ngram: int = 4             # dynamic only: longest n-gram (prompt-lookup) chain offered per round, 0 = off

    def __post_init__(self):
        if self.kind not in ("dynamic", "static", "chain"):
            raise ValueError(f"tree kind must be dynamic, static or chain, got '{self.kind}'")
        for name, low in (("top_k", 1), ("depth", 1), ("total_tokens", 1), ("ngram", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"tree {name} must be an integer >= {low}, got {v}")

    def static_paths(self) -> list[list[int]]:
        if self.kind == "chain":
            return [[0] * d for d in range(1, self.depth + 1)]
        return EAGLE1_TREE

    @property
    def draft_top_k(self) -> int:
        """Children computed per expanded node."""
        if self.kind == "dynamic":
            return self.top_k
        return max(p[-1] for p in self.static_paths()) + 1

    @property
    def max_depth(self) -> int:
        if self.kind == "dynamic":
            return self.depth
        return max(len(p) for p in self.static_paths())

    @property
    def max_accept(self) -> int:
        """The deepest node a round may verify: the head's depth, or the n-gram chain's length."""
        return max(self.max_depth, self.ngram if self.kind == "dynamic" else 0)

    @property
    def max_nodes(self) -> int:
        """Most tokens a verification holds, root included."""
        if self.kind == "dynamic":
            return self.total_tokens + 1
        return len(self.static_paths()) + 1

    @property
    def max_candidates(self) -> int:
        k, d = self.draft_top_k, self.max_depth
        return k + (d - 1) * k * k


@dataclass
class Tree:
    tokens: torch.Tensor    # (N,) long, node 0 = root
    parents: torch.Tensor   # (N,) long, parent index, -1 for the root
    depths: torch.Tensor    # (N,) long, root = 0
    ancestors: torch.Tensor | None = None  # (N, N) bool: j is i or an ancestor of i
    host: tuple[list[int], list[int], list[int]] | None = None  # tokens, parents, depths as host lists

    def __len__(self) -> int:
        return self.tokens.numel()

    def ancestor_mask(self) -> torch.Tensor:
        if self.ancestors is None:
            self.ancestors = ancestor_mask(self.parents, int(self.depths.max()) if len(self) else 0)
        return self.ancestors

    def host_lists(self) -> tuple[list[int], list[int], list[int]]:
        """(tokens, parents, depths) as Python lists: kept from the host lists the tree was built from, or
        read once."""
        if self.host is None:
            self.host = (self.tokens.tolist(), self.parents.tolist(), self.depths.tolist())
        return self.host

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, p in enumerate(self.host_lists()[1]):
            if p >= 0:
                kids[p].append(i)
        return kids


def ancestor_mask(parents: torch.Tensor, depth: int | None = None) -> torch.Tensor:
    """(N, N) bool closure of the parent relation, in `depth` vectorised steps (no per-node loop);
    without `depth`, N - 1 steps (enough for any tree)."""
    n = parents.numel()
    depth = max(n - 1, 0) if depth is None else depth
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    up = parents.clamp(min=0)
    anc, reach = eye, eye
    for _ in range(depth):
        reach = reach[up] & (parents >= 0)[:, None]  # row i: one generation further up from i
        anc = anc | reach
    return anc


@dataclass
class Candidates:
    """Every node drafted in a round (the root excluded), in drafting order (parents first)."""
    tokens: torch.Tensor    # (C,) target token ids
    parents: torch.Tensor   # (C,) candidate index of the parent, -1 = the root
    depths: torch.Tensor    # (C,) 1 = child of the root
    scores: torch.Tensor    # (C,) cumulative draft log-probability (sampled drafts: of the node's position)
    fixed: list[int] | None = None  # static trees: the candidates to verify, whatever their scores
    # sampled drafts only: the head's log-probabilities at every expanded node, (R, draft vocab), row 0 the
    # root's; and per depth d (index d - 1), (first candidate of the depth, its first row of q_logp), the depth's
    # candidates being k children per row in order
    q_logp: torch.Tensor | None = None
    layout: list[tuple[int, int]] | None = None
    host: "HostCandidates | None" = None  # the same candidates already on the host (HostCandidates.read returns it)

    def __len__(self) -> int:
        return self.tokens.numel()

    def row_and_rank(self, c: int, depth: int, k: int) -> tuple[int, int]:
        """Sampled drafts: the q_logp row candidate c was drawn from (its parent's), and its place among
        the siblings drawn there (0 = first)."""
        first, row = self.layout[depth - 1]
        return row + (c - first) // k, (c - first) % k


@dataclass
class HostCandidates:
    """A round's candidates as Python lists, read from the device in one go once drafting is done: choosing
    and building the verified tree of a few nodes takes a few dozen list operations on the host, where tensor
    operations would cost ~5-15 us each on a CPU whose caches the verification has just flushed."""
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]

    @classmethod
    def read(cls, cands: Candidates) -> "HostCandidates":
        if cands.host is not None:
            return cands.host
        # one read: the ids (< 2**53) and depths are exact in float64, and float32 scores convert exactly
        rows = torch.stack([cands.tokens.double(), cands.parents.double(), cands.depths.double(),
                            cands.scores.double()]).tolist()
        return cls(*[list(map(int, r)) for r in rows[:3]], rows[3])

    def __len__(self) -> int:
        return len(self.tokens)


def tree_from_host(root: int, cands: HostCandidates, keep: list[int], device) -> Tree:
    """The verified tree: the root plus candidates `keep` (ascending, closed under parents), its ancestor
    mask built row by row (a node's row is its parent's plus itself)."""
    where = {c: i for i, c in enumerate(keep, 1)}
    tokens = [root] + [cands.tokens[c] for c in keep]
    parents = [-1] + [0 if cands.parents[c] < 0 else where[cands.parents[c]] for c in keep]
    depths = [0] + [cands.depths[c] for c in keep]
    n = len(tokens)
    rows: list[list[bool]] = []
    for i, par in enumerate(parents):
        row = list(rows[par]) if par >= 0 else [False] * n
        row[i] = True
        rows.append(row)
    # one tensor for the three lists (its rows are contiguous views): each tensor built costs ~10 us here
    tpd = torch.tensor([tokens, parents, depths], dtype=torch.long, device=device)
    return Tree(tpd[0], tpd[1], tpd[2], torch.tensor(rows, dtype=torch.bool, device=device),
                host=(tokens, parents, depths))


def top_by_score(scores: list[float], n_keep: int) -> list[int]:
    """Indices of the `n_keep` best candidates, ascending. A child never scores above its parent and the
    sort is stable (parents come first on ties), so the kept set is always a connected tree."""
    return sorted(sorted(range(len(scores)), key=lambda i: -scores[i])[:n_keep])


def _static_plan(paths: list[list[int]], k: int):
    """For a static tree: which candidates each depth expands, and which candidates are kept.

    Candidates are numbered as the drafter creates them: depth 1 holds the root's k children; each
    later depth holds k children per expanded row. Returns (rows expanded per depth >= 2, as lists of
    candidate indices; kept candidate indices)."""
    by_path: dict[tuple, int] = {(r,): r for r in range(k)}
    expand: list[list[int]] = []
    offset = k
    depth = max(len(p) for p in paths)
    for d in range(2, depth + 1):
        parents = sorted({tuple(p[:-1]) for p in paths if len(p) == d})
        expand.append([by_path[p] for p in parents])
        for row, p in enumerate(parents):
            for r in range(k):
                by_path[p + (r,)] = offset + row * k + r
        offset += len(parents) * k
    keep = sorted(by_path[tuple(p)] for p in paths)
    return expand, keep


_FIRST_DEPTH: dict = {}


def _first_depth(k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The root's k children's parents (-1) and depths (1), built once per (k, device): never written to."""
    key = (k, str(device))
    if key not in _FIRST_DEPTH:
        _FIRST_DEPTH[key] = (torch.full((k,), -1, dtype=torch.long, device=device),
                             torch.ones(k, dtype=torch.long, device=device))
    return _FIRST_DEPTH[key]


class Drafter:
    """Grows the candidate tree over the head's cache.

    The head cache holds one entry per committed target position (slots [0, base)); tree nodes are
    written after it, in feeding order, and are forgotten when the next round's catch-up writes
    the accepted tokens there. `expand(tokens, hidden, positions, scores, noise, mix, cache_start=, t=,
    mask=)` is the per-depth call (head layer, draft LM head, log-softmax, top-k; fixed shape per frontier
    size) returning (hidden out (F, H), cumulative scores (F, k), token ids (F, k), best (k,), the rows'
    log-probabilities (F, draft vocab)); `noise` and `mix` make its top-k a sample (engine._draw_inputs).
    """

    def __init__(self, expand, config: TreeConfig):
        self.expand, self.config = expand, config
        self._plan = None if config.kind == "dynamic" else _static_plan(config.static_paths(), config.draft_top_k)

    def draft(self, root_hidden: torch.Tensor, root_scores: torch.Tensor, root_ids: torch.Tensor,
              base: int, depth: int, inputs=None, root_q: torch.Tensor | None = None,
              root_host: "HostCandidates | None" = None) -> Candidates:
        """root_hidden (H,): the head's output for the root; root_scores/root_ids (k,): its top-k.
        base: the committed length (first tree slot in the head cache); depth: levels to draft.
        inputs(depth, rows) -> (noise, mix): the expand call's draw inputs (engine._draw_inputs).
        root_q: sampled drafts only: the root's log-probabilities, which its children were drawn from; the
        rows of every later depth are then kept too (Candidates.q_logp). root_host: the root's children as
        HostCandidates where the caller read them already (a depth-1 round then reads nothing)."""
        k = self.config.draft_top_k
        dev = root_ids.device
        first_pars, first_deps = _first_depth(k, dev)
        if depth <= 1:
            # Most rounds on a CPU draft depth 1 only (the cost model's choice): the root's children, as they came.
            # Why a path of its own: the general one below costs ~0.2-0.3 ms of small tensor operations a round
            # (cold caches after a verification) for tensors that depth 1 never feeds.
            cands = Candidates(root_ids, first_pars, first_deps, root_scores, host=root_host)
            if root_q is not None:
                cands.q_logp, cands.layout = root_q[None], [(0, 0)]
            if self._plan is not None:
                cands.fixed = [c for c in self._plan[1] if c < k]
            return cands
        toks, pars, deps, scs = [root_ids], [first_pars], [first_deps], [root_scores]
        n_cand = k
        if self._plan is None:
            front = torch.arange(k, device=dev)          # candidate indices of the rows to feed
        else:
            depth = min(depth, len(self._plan[0]) + 1)
            front = torch.tensor(self._plan[0][0], device=dev) if depth > 1 else None
        f_tok, f_score = root_ids[front] if front is not None else None, root_scores[front] if front is not None else None
        # contiguous, like every later depth's rows and the warm-up's: a stride-0 (expanded) input fails a
        # compiled graph's stride guard and recompiles the depth call on the first generation
        f_hidden = root_hidden.expand(len(front), -1).contiguous() if front is not None else None
        # ancestry of the rows being fed, over the tree slots written so far (self included)
        n_slots = 0
        f_anc = None
        q_rows, layout = ([root_q[None]], [(0, 0)]) if root_q is not None else (None, None)
        for d in range(2, depth + 1):
            f = front.numel()
            own = torch.eye(f, dtype=torch.bool, device=dev)
            f_anc = own if f_anc is None else torch.cat([f_anc, own], dim=1)
            pos = torch.full((1, f), base + d - 2, dtype=torch.long, device=dev)
            noise, mix = inputs(d, f)
            # f_anc covers the tree slots; the committed ones before them are visible to every row
            out, cum, ids, best, lq = self.expand(f_tok[None], f_hidden[None], pos, f_score, noise, mix,
                                                  cache_start=base + n_slots, t=f, mask=f_anc)
            if q_rows is not None:
                layout.append((n_cand, 1 + n_slots))  # row 0 is the root's; each earlier depth fed n_slots rows
                q_rows.append(lq)
            n_slots += f
            toks.append(ids.flatten()); scs.append(cum.flatten()); deps.append(torch.full((f * k,), d, device=dev))
            pars.append(front.repeat_interleave(k))
            first = n_cand
            n_cand += f * k
            if d == depth:
                break
            if self._plan is None:
                rows = best // k
                front = first + best
            else:
                front = torch.tensor(self._plan[0][d - 1], device=dev)
                rows = front - first
                rows = rows // k
            f_tok, f_score, f_hidden = toks[-1][front - first], scs[-1][front - first], out[rows]
            f_anc = f_anc[rows]
        cands = Candidates(torch.cat(toks), torch.cat(pars), torch.cat(deps), torch.cat(scs))
        if q_rows is not None:
            cands.q_logp, cands.layout = torch.cat(q_rows), layout
        if self._plan is not None:
            cands.fixed = [c for c in self._plan[1] if c < n_cand]
        return cands
