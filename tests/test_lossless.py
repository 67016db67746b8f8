"""Greedy EAGLE decoding emits exactly plain greedy decoding's tokens, for every tree kind, with heads
that are never right (random) and heads that usually are (multi-token acceptance, cache compaction).
A difference is tolerated only where the target itself is tied (top-2 logits within 1e-4)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import scipy.stats
import torch

from eaglespec.engine import Engine
from eaglespec.head import EagleHead, grown_head, random_head
from eaglespec.loading import load_target
from eaglespec import cpugemm
from eaglespec.sampling import SamplingParams, target_probs
from eaglespec.testing import FAMILIES, exact_continuations, random_prompts  # noqa: F401 - test_ngram, test_eagle3 import them from here
from eaglespec.tree import Drafter, HostCandidates, Tree, TreeConfig, ancestor_mask, top_by_score, tree_from_host
from eaglespec.verify import greedy_accept, tree_draws, trials_from_draws, verify, verify_sampled

KINDS = ("dynamic", "static", "chain")
NEW = 32


def run(engine: Engine, prompt: list[int], method: str = "eagle"):
    return engine.generate(input_ids=prompt, method=method, max_new_tokens=NEW, ignore_eos=True)


def check_lossless(engine: Engine, prompts, vanilla, same_or_tie) -> list:
    results = []
    for prompt, want in zip(prompts, vanilla):
        r = run(engine, prompt)
        assert r.new_tokens == NEW and r.finish_reason == "length"
        same_or_tie(engine.model, prompt, r.token_ids, want)
        results.append(r)
    return results


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    model, _ = load_target(tiny_checkpoint("llama"), device="cpu", dtype=torch.float32)
    prompts = random_prompts(30, seed=0)
    plain = Engine(model)
    return model, prompts, [run(plain, p, "vanilla").token_ids for p in prompts]


@pytest.mark.parametrize("kind", KINDS)
def test_random_head_is_lossless(kind, llama, same_or_tie):
    model, prompts, vanilla = llama
    for seed in (0, 1, 2):  # a third of the prompts each
        engine = Engine(model, head=random_head(model.args, seed=seed), tree=TreeConfig(kind=kind))
        check_lossless(engine, prompts[seed::3], vanilla[seed::3], same_or_tie)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_lossless_through_the_tree(family, tiny_checkpoint, same_or_tie):
    """qkv bias, q/k norm and MoE routing under tree masks, with a random head."""
    model, _ = load_target(tiny_checkpoint(family), device="cpu", dtype=torch.float32)
    prompts = random_prompts(5, seed=1)
    vanilla = [run(Engine(model), p, "vanilla").token_ids for p in prompts]
    check_lossless(Engine(model, head=random_head(model.args, seed=3)), prompts, vanilla, same_or_tie)


@pytest.fixture(scope="module")
def good(make_oracle_pair):
    model, head = make_oracle_pair(noise=0.3, logit_scale=3.0)
    prompts = random_prompts(30, seed=2)
    return model, head, prompts, [run(Engine(model), p, "vanilla").token_ids for p in prompts]


@pytest.fixture
def moves(monkeypatch):
    """Records every cache compaction that really moves slots (the accepted path was not contiguous), by either
    route: cpugemm's move_slots kernel or the compiled graph (KVCache.move_slots)."""
    real, seen = Engine._move_slots, []

    def move(self, src, dst, both):
        if not torch.equal(src, dst):
            seen.append((src.tolist(), bool(self._draws_kernel)))
        return real(self, src, dst, both)

    monkeypatch.setattr(Engine, "_move_slots", move)
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_good_head_accepts_several_tokens_and_is_lossless(kind, good, moves, same_or_tie):
    model, head, prompts, vanilla = good
    results = check_lossless(Engine(model, head=head, tree=TreeConfig(kind=kind)), prompts, vanilla, same_or_tie)
    tau = sum(r.tau for r in results) / len(results)
    assert tau > 1.3, f"mean tau {tau:.2f}: the head does not draft well enough to test acceptance"
    assert max(max(r.accept_lengths) for r in results) >= 4
    for r in results:  # the prefill's token, then each round's tokens (the last round may be cut short)
        assert sum(r.accept_lengths[:-1]) + 1 < r.new_tokens <= sum(r.accept_lengths) + 1
    if kind != "chain":  # a chain's accepted path is always contiguous; a tree's usually is not
        assert len(moves) > 10
        # where cpugemm is built, its move_slots kernel did the moving (the compiled graph elsewhere)
        assert {kernel for _, kernel in moves} == {cpugemm.why_unavailable() is None}


@pytest.fixture(scope="module")
def good_two_layers(good):
    """The good head grown to two layers, the second then perturbed (a random residual layer, not the identity):
    drafts still usually right, and a second head-cache layer that the tree masks and compaction must keep."""
    model, head, prompts, vanilla = good
    two = grown_head(head, 2, seed=5)
    with torch.no_grad():
        torch.manual_seed(5)
        for p in two.layers[1].parameters():
            p += 0.05 * torch.randn_like(p)
    return model, two.eval().requires_grad_(False), prompts, vanilla


def test_a_grown_head_drafts_exactly_as_the_head_it_grew_from(good):
    """grown_head's new layers start as the identity (zero output projections), bit for bit; it cannot shrink."""
    model, head, prompts, _ = good
    grown = grown_head(head, 3)
    assert len(grown.layers) == 3 and isinstance(grown.layers[1].input_layernorm, torch.nn.Module)
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 9, model.args.hidden_size, generator=g)
    feats = torch.randn(1, 9, model.args.hidden_size, generator=g)
    with torch.no_grad():
        assert torch.equal(grown(embeds, feats, torch.arange(9)[None]), head(embeds, feats, torch.arange(9)[None]))
    engine = lambda h: Engine(model, head=h, tree=TreeConfig(kind="dynamic"))  # noqa: E731
    a, b = (run(engine(h), prompts[0]) for h in (head, grown))
    assert a.token_ids == b.token_ids and a.accept_lengths == b.accept_lengths
    with pytest.raises(ValueError, match="grow, not shrink"):
        grown_head(grown, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_a_two_layer_head_is_lossless_with_deep_paths_and_compaction(kind, good_two_layers, moves, same_or_tie):
    """A head of two layers (train --head-layers 2): lossless through every tree kind, with deep accepted paths
    and (for trees) cache compactions that move both layers of the head's cache; the catch-up inside the
    verification drafts what the separate call drafts."""
    model, head, prompts, vanilla = good_two_layers
    fused, apart = (Engine(model, head=head, tree=TreeConfig(kind=kind)) for _ in range(2))
    apart.fuse_catchup = False
    a = check_lossless(fused, prompts[:15], vanilla[:15], same_or_tie)
    b = check_lossless(apart, prompts[:15], vanilla[:15], same_or_tie)
    assert [r.accept_lengths for r in a] == [r.accept_lengths for r in b]
    assert sum(r.tau for r in a) / len(a) > 1.3 and max(max(r.accept_lengths) for r in a) >= 4
    if kind != "chain":
        assert len(moves) > 5


def counting(calls: Counter, name: str, fn):
    def call(*a, **k):
        calls[name] += 1
        return fn(*a, **k)
    return call


@pytest.mark.parametrize("kind", KINDS)
def test_the_catch_up_inside_the_verification_drafts_as_the_separate_call_does(kind, good, same_or_tie):
    """Greedy rounds run the head's catch-up inside the verification call (Engine._fused_fn): lossless, and
    the next round's drafts are those of the catch-up as a call of its own, so every prompt goes through
    the same rounds (the same accepted lengths); the separate call then runs only after the prefill."""
    model, head, prompts, vanilla = good
    fused, apart = (Engine(model, head=head, tree=TreeConfig(kind=kind)) for _ in range(2))
    apart.fuse_catchup = False
    calls = Counter()
    fused._fused_call = counting(calls, "fused", fused._fused_call)
    fused._catchup_call = counting(calls, "catch-up", fused._catchup_call)
    a = check_lossless(fused, prompts[:12], vanilla[:12], same_or_tie)
    b = check_lossless(apart, prompts[:12], vanilla[:12], same_or_tie)
    assert [r.accept_lengths for r in a] == [r.accept_lengths for r in b]
    assert max(max(r.accept_lengths) for r in a) >= 4  # paths deep enough that the head's tree mask matters
    assert calls["fused"] == sum(r.target_forwards for r in a) and calls["catch-up"] == 0


def with_draft_vocab(head: EagleHead, ids: torch.Tensor) -> EagleHead:
    reduced = EagleHead(head.args, bias=head.bias, draft_vocab=ids)
    reduced.load_state_dict(head.state_dict(), strict=False)
    return reduced.eval().requires_grad_(False)


def test_head_with_a_draft_vocabulary_drafts_only_it_and_is_lossless(good, monkeypatch, same_or_tie):
    """A reduced draft vocabulary (half the tokens) changes what is drafted, never what is output."""
    model, head, prompts, vanilla = good
    ids = torch.arange(0, model.args.vocab_size, 2)
    drafted = []
    real = Drafter.draft

    def spy(self, *a, **k):
        cands = real(self, *a, **k)
        drafted.extend(cands.tokens.tolist())
        return cands

    monkeypatch.setattr(Drafter, "draft", spy)
    for kind in KINDS:
        results = check_lossless(Engine(model, head=with_draft_vocab(head, ids), tree=TreeConfig(kind=kind)),
                                 prompts[:10], vanilla[:10], same_or_tie)
        assert max(max(r.accept_lengths) for r in results) >= 3  # even ids still get accepted
    assert drafted and all(t % 2 == 0 for t in drafted)


def test_broken_cache_compaction_is_caught(good, monkeypatch, same_or_tie):
    """If the accepted path's K/V were left where the tree put them, outputs would differ: the
    lossless check above does exercise the compaction (Engine._move_slots, by either route)."""
    model, head, prompts, vanilla = good
    monkeypatch.setattr(Engine, "_move_slots", lambda self, src, dst, both: None)
    engine = Engine(model, head=head, tree=TreeConfig(kind="dynamic"))
    caught = 0
    for prompt, want in zip(prompts[:10], vanilla):
        try:
            same_or_tie(model, prompt, run(engine, prompt).token_ids, want)
        except AssertionError:
            caught += 1
    assert caught >= 3


# ---- sampling ------------------------------------------------------------------------------------

def emitted_distribution(tree: Tree, logits: torch.Tensor, params: SamplingParams) -> dict[tuple, float]:
    """Exact probability of each token sequence one verification can emit (accepted tokens, then the
    bonus): the target's own sampling, stopped at the first token that leaves the tree."""
    kids, tokens = tree.children(), tree.tokens.tolist()
    out: dict[tuple, float] = {}

    def walk(node: int, seq: tuple, prob: float):
        p = target_probs(logits[node], params).double().tolist()
        child = {tokens[c]: c for c in kids[node]}
        for x, px in enumerate(p):
            if px > 0:
                if x in child:
                    walk(child[x], seq + (x,), prob * px)
                else:
                    out[seq + (x,)] = prob * px

    walk(0, (), 1.0)
    return out


def chi_square_pvalue(counts: Counter, expected: dict[tuple, float]) -> float:
    """Pearson's test over the cells expected >= 5 times, the rare ones pooled into one cell."""
    n = sum(counts.values())
    impossible = set(counts) - set(expected)
    assert not impossible, f"emitted sequences the target can never produce: {sorted(impossible)[:5]}"
    big = [s for s in expected if expected[s] * n >= 5]
    obs = [counts[s] for s in big] + [n - sum(counts[s] for s in big)]
    exp = [expected[s] * n for s in big] + [n - sum(expected[s] * n for s in big)]
    if exp[-1] < 5:  # nothing rare to pool: fold the remainder into the last big cell
        obs, exp = obs[:-2] + [obs[-2] + obs[-1]], exp[:-2] + [exp[-2] + exp[-1]]
    return float(scipy.stats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue)


SAMPLING = {"t1": SamplingParams(1.0), "t0.7-p0.9-k5": SamplingParams(0.7, 0.9, 5)}


def test_one_draw_follows_the_distribution_and_never_picks_a_zero():
    """sampling.sample, the one draw every sampled token comes from: 20,000 draws from an unnormalised
    vector with zeros (first, inside, last) match it by a chi-square test, and no zero is ever drawn."""
    from eaglespec.sampling import sample
    w = torch.tensor([0.0, 3.0, 0.5, 0.0, 1.0, 2.5, 0.01, 0.0])
    g = torch.Generator().manual_seed(11)
    counts = Counter(sample(w, g) for _ in range(20_000))
    assert set(counts) <= {1, 2, 4, 5, 6}
    p = chi_square_pvalue(Counter({(k,): v for k, v in counts.items()}), {(i,): float(x / w.sum()) for i, x in enumerate(w) if x > 0})
    assert p > 1e-3, p


def fixed_tree(vocab: int = 8) -> tuple[Tree, torch.Tensor]:
    """A depth-4 tree over known logits; children are chosen by their rank under the parent's logits
    (likely and unlikely ones, not in probability order) so paths are accepted at every depth."""
    g = torch.Generator().manual_seed(5)
    parents = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7]
    ranks = [None, 1, 0, 6, 0, 2, 0, 0, 3, 1]  # node i's token is the ranks[i]-th best under its parent
    logits = 1.5 * torch.randn(len(parents), vocab, generator=g)
    tokens = [0] + [int(logits[p].argsort(descending=True)[r]) for p, r in zip(parents[1:], ranks[1:])]
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths)), logits


def test_host_built_trees_and_greedy_acceptance_match_their_references():
    """tree_from_host's ancestor mask equals the vectorised closure, and greedy_accept (a walk on host lists)
    equals the reference walk over logits (verify's greedy branch), on random candidate sets and targets."""
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        c = int(torch.randint(1, 40, (), generator=g))
        parents, depths = [], []
        for i in range(c):  # each candidate under the root or an earlier candidate; a few tokens, many clashes
            p = int(torch.randint(-1, i, (), generator=g)) if i else -1
            parents.append(p)
            depths.append(1 if p < 0 else depths[p] + 1)
        toks = torch.randint(0, 6, (c,), generator=g).tolist()
        # siblings must carry distinct tokens (the drafter's top-k and attach_chain guarantee it)
        seen = set()
        for i in range(c):
            while (parents[i], toks[i]) in seen:
                toks[i] += 6
            seen.add((parents[i], toks[i]))
        scores = sorted(torch.rand(c, generator=g).tolist(), reverse=True)  # parents first: non-increasing
        host = HostCandidates(toks, parents, depths, [-x for x in sorted(scores)])
        keep = top_by_score(host.scores, int(torch.randint(1, c + 1, (), generator=g)))
        tree = tree_from_host(int(torch.randint(0, 6, (), generator=g)), host, keep, "cpu")
        assert torch.equal(tree.ancestor_mask(), ancestor_mask(tree.parents))
        logits = torch.randn(len(tree), 256, generator=g)
        for i, (t, p) in enumerate(zip(tree.host_lists()[0], tree.host_lists()[1])):
            if p >= 0 and torch.rand((), generator=g) < 0.6:  # accept often: make the parent's argmax this token
                logits[p, t] = 10.0 + logits[p].max()
        path, bonus, new = greedy_accept(tree, logits.argmax(-1))
        ref_path, ref_bonus = verify(tree, logits, SamplingParams(0.0), None)
        assert (path, bonus) == (ref_path, ref_bonus), trial
        assert new == [tree.host_lists()[0][i] for i in path[1:]] + [bonus]


@pytest.mark.parametrize("name", SAMPLING)
def test_verification_emits_the_target_distribution(name):
    """20,000 verifications of one tree: the emitted sequences follow the target's distribution exactly."""
    params = SAMPLING[name]
    tree, logits = fixed_tree()
    expected = emitted_distribution(tree, logits, params)
    assert sum(expected.values()) == pytest.approx(1.0)
    gen = torch.Generator().manual_seed(0)
    counts, accepted = Counter(), 0
    for _ in range(20_000):
        path, bonus = verify(tree, logits, params, gen)
        counts[tuple(tree.tokens[path[1:]].tolist()) + (bonus,)] += 1
        accepted += len(path) > 1
    assert accepted > 5_000  # the tree is accepted into often, so the test sees acceptance, not only bonuses
    assert max(map(len, counts)) >= 4
    assert chi_square_pvalue(counts, expected) > 1e-3


@pytest.mark.parametrize("drafts", ["sampled", "sampled-kernel", "sampled-tensors", "top-k"])
@pytest.mark.parametrize("name,draws,draft_vocab", [("t1", 2000, None), ("t0.7-p0.9-k5", 1000, None),
                                                    ("t1", 1000, [0, 2, 3, 5, 7])])
def test_engine_sampling_follows_the_target(name, draws, draft_vocab, drafts, make_oracle_pair, monkeypatch):
    """End to end: EAGLE's first three sampled tokens follow the target's exact joint distribution
    (also when the head drafts from a reduced vocabulary): with drafts sampled from the head, verified on the
    host (verify_sampled, the catch-up a call of its own) or inside the verification call (tree_draws, as
    cpugemm's kernel or as tensor operations; a top-k / top-p filter keeps the host rule), and with its top-k
    (verify); each rule is the one that ran."""
    import eaglespec.engine as engine_module
    calls = Counter()
    for rule in ("verify", "verify_sampled", "tree_draws"):
        real_rule = getattr(engine_module, rule)
        monkeypatch.setattr(engine_module, rule,
                            lambda *a, _f=real_rule, _n=rule, **k: (calls.update([_n]), _f(*a, **k))[1])
    params = SAMPLING[name]
    model, head = make_oracle_pair(vocab_size=8, logit_scale=3.0, noise=0.3)
    if draft_vocab is not None:
        head = with_draft_vocab(head, torch.tensor(draft_vocab))
    engine = Engine(model, head=head, tree=TreeConfig(top_k=3, depth=3, total_tokens=8))
    engine.draft_sampling = drafts != "top-k"
    engine.fuse_catchup = drafts != "sampled"
    if drafts == "sampled-kernel" and not engine._draws_kernel:
        pytest.skip("cpugemm's kernels are not built here")
    engine._draws_kernel = drafts == "sampled-kernel"
    fused = engine._fused_sampled_call
    engine._fused_sampled_call = lambda *a, **k: (calls.update(["fused call"]), fused(*a, **k))[1]
    prompt = [1, 2, 3]
    expected = exact_continuations(model, prompt, 3, params)
    counts, accepted = Counter(), 0
    for seed in range(draws):
        r = engine.generate(input_ids=prompt, max_new_tokens=3, temperature=params.temperature, top_p=params.top_p,
                            top_k=params.top_k, seed=seed, ignore_eos=True)
        counts[tuple(r.token_ids)] += 1
        accepted += r.accept_lengths[0] > 1
    assert accepted > draws // 4  # drafts do get accepted
    filtered = params.top_p < 1 or params.top_k
    used = {"top-k": {"verify"}, "sampled": {"verify_sampled"}, "sampled-kernel": {"fused call"},
            "sampled-tensors": {"fused call", "tree_draws"}}[drafts]
    if filtered and drafts.startswith("sampled"):
        used = {"verify_sampled"}
    assert all(calls[u] > draws // 2 for u in used) and set(calls) == used, calls
    assert chi_square_pvalue(counts, expected) > 1e-3


# ---- sampled drafts (verify_sampled) -----------------------------------------------------------

def _prefix_logits(prefix: tuple, vocab: int, salt: int, scale: float) -> torch.Tensor:
    """A fixed, arbitrary distribution for every prefix (a stand-in for a model): seeded by the prefix."""
    g = torch.Generator().manual_seed(hash((salt,) + prefix) % (2 ** 31))
    return scale * torch.randn(vocab, generator=g)


def _draws_by_rule(rule, tree, logits, params, gen, q_rows, rows, ranks, ids, vocab, k=3, chain=frozenset()):
    """tree_draws on one tree, as the engine feeds it (rule "tensors": the reference, "kernel": cpugemm's):
    (accepted path, bonus, trials), as verify_sampled returns them. chain: the tree nodes an n-gram chain proposed
    (tried first under their parent, as `det`; rank -1 for those the head did not draw)."""
    n, tokens = len(tree), tree.host_lists()[0]
    kid_tok, kid_ok, q_of = torch.zeros(n, k, dtype=torch.long), torch.zeros(n, k, dtype=torch.bool), [0] * n
    det = torch.full((n,), -1, dtype=torch.long)
    for j, kids in enumerate(tree.children()):
        for c in kids:
            if c in chain:
                det[j] = tokens[c]
            if ranks[c] >= 0:
                kid_tok[j, ranks[c]], kid_ok[j, ranks[c]] = tokens[c], True
                q_of[j] = rows[c]
    p = target_probs(logits, params)
    q = q_rows[q_of].exp()
    u = torch.rand(n, k + 2, generator=gen, dtype=torch.float64)
    if rule == "kernel":
        of = torch.full((vocab,), -1, dtype=torch.long)
        ids_ = ids if ids is not None else torch.arange(vocab)
        of[ids_] = torch.arange(len(ids_))
        draws = torch.ops.eaglespec.tree_draws(p, q, ids_, of, kid_tok, kid_ok, det, u)
    else:
        if ids is not None:
            q = torch.zeros(n, vocab).index_copy(1, ids, q)
        draws = tree_draws(p, q, kid_tok, kid_ok, u, det)
    draws = draws.tolist()
    path, bonus, _ = greedy_accept(tree, draws)
    return path, bonus, trials_from_draws(tree, path, draws, ranks, chain)


@pytest.mark.parametrize("rule", ["host", "tensors", "kernel", "tensors-chain", "kernel-chain"])
@pytest.mark.parametrize("name,draft_vocab", [("t1", None), ("t0.7-p0.9-k5", None), ("t1", [0, 2, 3, 5, 7])])
def test_sampled_drafts_emit_the_target_distribution(name, draft_vocab, rule):
    """verify_sampled, driven like the engine drives it: each round drafts a fixed-shape tree whose children are
    drawn without replacement (Gumbel-top-k) from a *different* distribution q than the target's p, verifies it,
    and continues from what was emitted; the first three tokens follow the target's exact joint distribution.
    The tree's shape (3 children at the root, 2 under the first, 1 under the second, 1 below that) is fixed,
    as the engine's is by position scores alone. The same for its in-graph form, every node's draw at once
    (tree_draws, as tensor operations and as cpugemm's kernel) walked like greedy acceptance; "-chain": with an
    n-gram-like chain of two tokens below the root, a fixed function of the prefix (the target's most likely
    token or an arbitrary one), merged with the head's child where the head drew the same token."""
    rule, with_chain = rule.removesuffix("-chain"), rule.endswith("-chain")
    if rule == "kernel":
        from eaglespec import cpugemm
        if cpugemm.why_unavailable() is not None:
            pytest.skip(cpugemm.why_unavailable())
    params, vocab = SAMPLING[name], 8
    ids = torch.tensor(draft_vocab) if draft_vocab is not None else None
    dv = vocab if ids is None else len(ids)
    shape = [-1, 0, 0, 0, 1, 1, 2, 4]   # parents; node 0 is the root
    ranks = [0, 0, 1, 2, 0, 1, 0, 0]    # each child's place among its siblings
    gen = torch.Generator().manual_seed(1)

    def p_logits(prefix):
        return _prefix_logits(prefix, vocab, 1, 1.5)

    def q_logp(prefix):
        return torch.log_softmax(_prefix_logits(prefix, dv, 2, 1.5), -1)

    def round_(prefix):
        """Draft a tree below `prefix` (its last token the root) and verify it: the emitted tokens."""
        n = len(shape)
        toks, rows, node_prefix, q_rows = [prefix[-1]] + [0] * (n - 1), [0] * n, [prefix] + [()] * (n - 1), []
        for node in range(n):  # parents come before their children
            kids = [c for c in range(1, n) if shape[c] == node]
            if not kids:
                continue
            lq = q_logp(node_prefix[node])
            noise = -torch.log(-torch.log(torch.rand(dv, generator=gen).clamp(min=1e-20)))
            order = (lq + noise).topk(len(kids)).indices  # a sample without replacement, in drawing order
            q_rows.append(lq)
            for c in kids:
                t = int(order[ranks[c]])
                toks[c], rows[c] = (int(ids[t]) if ids is not None else t), len(q_rows) - 1
                node_prefix[c] = node_prefix[node] + (toks[c],)
        parents, node_ranks, chain = list(shape), list(ranks), set()
        if with_chain:  # two chain tokens below the root, each merged with the head's child of that token if any
            at = 0
            for _ in range(2):
                t = chain_token(node_prefix[at])
                same = [c for c in range(1, len(toks)) if parents[c] == at and toks[c] == t]
                if same:
                    at = same[0]
                else:
                    toks.append(t); parents.append(at); node_ranks.append(-1); rows.append(0)
                    node_prefix.append(node_prefix[at] + (t,))
                    at = len(toks) - 1
                chain.add(at)
        depths = [0]
        for c in range(1, len(toks)):
            depths.append(depths[parents[c]] + 1)
        tree = Tree(torch.tensor(toks), torch.tensor(parents), torch.tensor(depths))
        logits = torch.stack([p_logits(pr) for pr in node_prefix])
        if rule == "host":
            path, bonus, trials = verify_sampled(tree, logits, params, gen, torch.stack(q_rows), rows, ranks, ids)
        else:
            path, bonus, trials = _draws_by_rule(rule, tree, logits, params, gen, torch.stack(q_rows), rows,
                                                 node_ranks, ids, vocab, chain=frozenset(chain))
        # every tried child but the last of each node was rejected; an accepted one is on the path (or the chain's)
        on_chain = sum(c in chain for c in path[1:])
        assert sum(ok for _, _, ok in trials) + on_chain == len(path) - 1
        counted["chain"] += on_chain
        return [toks[i] for i in path[1:]] + [bonus], len(path) - 1

    def chain_token(prefix):
        logits = p_logits(prefix)
        return int(logits.argmax()) if hash(prefix) % 2 else hash(prefix + (7,)) % vocab

    counted = Counter()

    expected: dict[tuple, float] = {}

    def walk(prefix, seq, prob):
        if len(seq) == 3:
            expected[seq] = expected.get(seq, 0.0) + prob
            return
        for x, px in enumerate(target_probs(p_logits(prefix), params).double().tolist()):
            if px > 0:
                walk(prefix + (x,), seq + (x,), prob * px)
    walk((1,), (), 1.0)

    counts, accepted = Counter(), 0
    for _ in range(6000):
        prefix, out = (1,), []
        while len(out) < 3:
            new, n_acc = round_(prefix)
            accepted += n_acc
            out += new
            prefix += tuple(new)
        counts[tuple(out[:3])] += 1
    assert accepted > 2000  # drafts are accepted, so the test sees acceptance, not only bonus tokens
    assert not with_chain or counted["chain"] > 1000  # and the chain's tokens too
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_rank_acceptance_scores_fall_with_rank_and_follow_what_is_observed():
    from eaglespec.costmodel import RankAcceptance
    ranks = RankAcceptance(max_depth=3, k=4)
    for d in range(1, 4):
        s = ranks.log_scores(d)
        assert all(a > b for a, b in zip(s, s[1:]))
    # depth 2's first child is always accepted, depth 1's never: the estimates follow
    for _ in range(500):
        ranks.observe([(1, 0, False), (1, 1, True), (2, 0, True)])
    assert ranks.accept(2, 0) > 0.95 and ranks.accept(1, 0) < 0.05 and ranks.accept(1, 1) > 0.95
    s = ranks.log_scores(1)
    assert all(a > b for a, b in zip(s, s[1:]))  # still decreasing, even where rank 1 beats rank 0
    for _ in range(5000):  # counts are halved past the half-life: a drift is followed
        ranks.observe([(1, 0, True)])
    assert ranks.accept(1, 0) > 0.9 and ranks.tries[1][0] <= RankAcceptance.HALF_LIFE
