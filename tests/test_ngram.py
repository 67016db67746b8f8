"""The n-gram chain (prompt lookup) beside the head's drafts: what it proposes, how it joins the
candidates, and that outputs stay the target's, greedy token for token and sampled in distribution."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from eaglespec.engine import Engine
from eaglespec.head import random_head
from eaglespec.ngram import NgramProposer, attach_chain
from eaglespec.tree import Candidates, HostCandidates, TreeConfig, top_by_score, tree_from_host
from test_lossless import SAMPLING, chi_square_pvalue, exact_continuations, random_prompts


def test_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(max_len=4)
    p.reset([5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 5, 6, 7])
    # suffix (5, 6, 7) occurred at 0..2, followed by 8 9 1 6; the 2-gram (6, 7) also after 1 (-> 3 4),
    # but the longer match wins
    assert p.propose() == [8, 9, 1, 6]
    short = NgramProposer(max_len=2)
    short.reset(p.tokens)
    assert short.propose() == [8, 9]
    p.extend([2])                     # (7, 2) never occurred
    assert p.propose() == []
    p.reset([1, 2, 3, 1, 2])          # the suffix itself is not a match for itself
    assert p.propose() == [3, 1, 2]  # ends at the context's end: shorter than asked
    p.reset([1, 2])
    assert p.propose() == []
    p.reset([9, 1, 9])                # a 1-token match is not used
    assert p.propose() == []


def test_chain_acceptance_is_calibrated_per_depth():
    p = NgramProposer(max_len=3)
    for _ in range(400):
        p.observe([1, 2], [True, False])  # depth 3 is never verified with its parent accepted
    assert p.accept[1] > 0.95 and p.accept[2] < 0.05 and p.accept[3] == pytest.approx(0.5)


def cands(tokens, parents, depths, scores):
    """The head's candidates as the round reads them: tensors, then one read to host lists."""
    return HostCandidates.read(Candidates(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths),
                                          torch.tensor(scores)))


def test_the_chain_reuses_the_heads_nodes_and_keeps_any_prefix_connected():
    # the head drafted 10, 11 under the root and 12 under 10
    c = cands([10, 11, 12], [-1, -1, 0], [1, 1, 2], [-0.5, -1.0, -2.0])
    assert c.tokens == [10, 11, 12] and c.parents == [-1, -1, 0] and c.depths == [1, 1, 2]
    assert c.scores == [torch.tensor(x).item() for x in (-0.5, -1.0, -2.0)]  # float32 values, exactly
    rates = [None, 0.9, 0.5, 0.25]
    out, nodes, alone = attach_chain(c, [10, 13, 14], rates)
    assert nodes == [0, 3, 4] and alone == [False, True, True]  # 10 is the head's node 0; 13, 14 are new
    assert out.tokens == [10, 11, 12, 13, 14]
    assert out.parents == [-1, -1, 0, 0, 3]
    assert out.depths == [1, 1, 2, 2, 3]
    assert len(c) == 3  # the head's own candidates are left as they were
    # the head's node keeps its score; new nodes: the parent's score + log(rate at their depth)
    assert out.scores == pytest.approx([-0.5, -1.0, -2.0, -0.5 + math.log(0.5),
                                        -0.5 + math.log(0.5) + math.log(0.25)])
    out2, nodes2, alone2 = attach_chain(c, [13, 10], rates)   # a chain the head did not start
    assert nodes2 == [3, 4] and alone2 == [True, True] and out2.parents[3:] == [-1, 3]
    for o in (out, out2):
        for n in range(1, len(o) + 1):  # every prefix of the stable score order is a connected tree
            keep = top_by_score(o.scores, n)
            assert keep == sorted(keep) and all(o.parents[i] < 0 or o.parents[i] in keep for i in keep)
            tree = tree_from_host(7, o, keep, "cpu")  # and builds a tree whose parents precede children
            assert tree.host_lists()[0] == [7] + [o.tokens[i] for i in keep]
            assert all(p < i for i, p in enumerate(tree.host_lists()[1]))


@pytest.fixture(scope="module")
def looping(make_oracle_pair):
    """A tiny target over 16 tokens with a peaky distribution: its greedy text falls into loops, so
    earlier n-grams recur (as in a small real model's long answers)."""
    model, _ = make_oracle_pair(vocab_size=16, logit_scale=3.0)
    prompts = random_prompts(12, seed=5, vocab=16, max_len=12)
    plain = Engine(model)
    want = [plain.generate(input_ids=p, method="vanilla", max_new_tokens=32, ignore_eos=True).token_ids for p in prompts]
    return model, prompts, want


@pytest.mark.parametrize("auto", [False, True])
def test_chain_drafts_are_accepted_and_greedy_output_is_unchanged(auto, looping, same_or_tie, monkeypatch):
    model, prompts, want = looping
    seen = []
    real = NgramProposer.observe
    monkeypatch.setattr(NgramProposer, "observe", lambda self, d, ok: (seen.extend(ok), real(self, d, ok)))
    # a random head is (nearly) never right, so what gets accepted beyond it is the chain's doing
    engine = Engine(model, head=random_head(model.args, seed=0), tree=TreeConfig(auto=auto, total_tokens=8))
    off = Engine(model, head=random_head(model.args, seed=0), tree=TreeConfig(auto=auto, total_tokens=8, ngram=0))
    taus = []
    for p, w in zip(prompts, want):
        r = engine.generate(input_ids=p, max_new_tokens=32, ignore_eos=True)
        same_or_tie(model, p, r.token_ids, w)
        taus.append((r.tau, off.generate(input_ids=p, max_new_tokens=32, ignore_eos=True).tau))
    assert sum(seen) > 20, f"only {sum(seen)} chain nodes accepted: the test does not exercise the chain"
    assert sum(a for a, _ in taus) > sum(b for _, b in taus)


def test_ngram_zero_turns_it_off(looping, monkeypatch):
    model, prompts, _ = looping
    monkeypatch.setattr(NgramProposer, "propose", lambda *a: pytest.fail("proposed with --ngram 0"))
    Engine(model, head=random_head(model.args), tree=TreeConfig(ngram=0)).generate(input_ids=prompts[0], max_new_tokens=8)
    with pytest.raises(ValueError, match="ngram"):
        TreeConfig(ngram=-1)


@pytest.mark.parametrize("drafts", ["top-k", "sampled-kernel", "sampled-tensors"])
@pytest.mark.parametrize("auto", [False, True])
def test_sampling_with_the_chain_follows_the_target(auto, drafts, make_oracle_pair, monkeypatch):
    """The first three sampled tokens after a repetitive prompt follow the target's exact joint
    distribution, with chain nodes accepted (and rejected) along the way: beside the head's top-k (`verify`,
    every candidate a fixed token) and beside drafts sampled from the head, verified inside the verification
    call (tree_draws, as cpugemm's kernel or as tensor operations: the chain's token tried first, as a proposal
    of all its mass on one token)."""
    params = SAMPLING["t1"]
    model, _ = make_oracle_pair(vocab_size=8, logit_scale=3.0, noise=0.3)
    head = random_head(model.args, seed=1)  # its drafts rarely match the chain's: the chain's own nodes get verified
    seen = []
    real = NgramProposer.observe
    monkeypatch.setattr(NgramProposer, "observe", lambda self, d, ok: (seen.extend(ok), real(self, d, ok)))
    engine = Engine(model, head=head, tree=TreeConfig(top_k=2, depth=3, total_tokens=6, auto=auto))
    engine.draft_sampling = drafts != "top-k"
    if drafts == "sampled-kernel" and not engine._draws_kernel:
        pytest.skip("cpugemm's kernels are not built here")
    engine._draws_kernel = drafts == "sampled-kernel"
    if drafts != "top-k":  # the sampled drafts' fused call ran, with chain tokens among its inputs
        real_call, dets = engine._fused_sampled_call, []
        engine._fused_sampled_call = lambda *a, **k: (dets.append(int((a[6] >= 0).sum())), real_call(*a, **k))[1]
    prompt = [3, 5, 6, 3, 5, 6, 3, 5]  # this target often samples 6 after 3, 5: the chain gets accepted
    expected = exact_continuations(model, prompt, 3, params)
    counts = Counter()
    for seed in range(1500):
        r = engine.generate(input_ids=prompt, max_new_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)
        counts[tuple(r.token_ids)] += 1
    assert sum(seen) > 100 and len(seen) - sum(seen) > 100  # chain nodes both accepted and rejected
    assert drafts == "top-k" or sum(d > 0 for d in dets) > 300
    assert chi_square_pvalue(counts, expected) > 1e-3
