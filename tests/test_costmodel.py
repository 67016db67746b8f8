"""The cost model and the per-round tree policy: tree sizes follow the cost table, and every policy
is lossless (greedy identical to plain decoding, sampling follows the target's distribution)."""
from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import pytest
import torch

from eaglespec import costmodel
from eaglespec.cli import main, resolve_compile, tree_config
from eaglespec.costmodel import AUTO_BUCKETS, CostTable, TreePolicy, SpecSwitch
from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig

BUCKETS = (4, 8, 12, 16)


def table(verify_ms: dict[int, float], first: float = 1.0, step: float = 1.0) -> CostTable:
    return CostTable(verify_ms, first, step, {"mode": "synthetic"})


FREE = table({n: 10.0 for n in (1, 2, 4, 8, 12, 16, 24, 32)}, first=0.1, step=0.1)   # verifying costs nothing extra
STEEP = table({n: 10.0 * n for n in (1, 2, 4, 8, 12, 16, 24, 32)}, first=0.1, step=0.1)  # every token costs a step


def candidates(depth: int, k: int = 4, p: float = 0.5):
    """A full k-ary candidate set to `depth`, each child with draft probability p: scores and depths lists."""
    scores, depths = [], []
    for d in range(1, depth + 1):
        n = k if d == 1 else k * k
        scores += [d * math.log(p)] * n
        depths += [d] * n
    return scores, depths


def chain_like(depth: int, k: int = 4, p: float = 0.95):
    """Candidates where one child per depth is almost surely right and its siblings almost surely wrong:
    here depth pays, if drafting it is cheap."""
    scores, depths = [], []
    for d in range(1, depth + 1):
        n = k if d == 1 else k * k
        scores += [d * math.log(p)] + [d * math.log(p) + math.log(0.01)] * (n - 1)
        depths += [d] * n
    return scores, depths


def test_free_verification_picks_the_largest_tree_and_a_steep_cost_the_smallest():
    scores, depths = candidates(depth=4)
    n_free, keep_free = TreePolicy(FREE, BUCKETS, max_depth=5).choose(scores, depths, 4)
    n_steep, keep_steep = TreePolicy(STEEP, BUCKETS, max_depth=5).choose(scores, depths, 4)
    assert n_free == max(BUCKETS) and len(keep_free) == max(BUCKETS) - 1
    assert n_steep == min(BUCKETS) and len(keep_steep) == min(BUCKETS) - 1


def test_measured_verification_times_correct_a_wrong_table():
    """A table that says verification is free (taken at a moment when it was) against rounds that measure every
    token costing a step: once its rounds have timed the sizes, the policy picks the smallest tree where the
    table alone keeps the largest. A machine that is only slower everywhere changes no choice, and one
    preempted call moves an estimate a little."""
    scores, depths = candidates(depth=4)
    online, fixed = TreePolicy(FREE, BUCKETS, max_depth=5), TreePolicy(FREE, BUCKETS, max_depth=5, online=False)
    for policy in (online, fixed):
        assert policy.choose(scores, depths, 4)[0] == max(BUCKETS)
        for _ in range(3 * TreePolicy.TIME_SEEN):
            for n in BUCKETS:
                policy.observe_time(n, STEEP.t_verify(n))
    assert online.choose(scores, depths, 4)[0] == min(BUCKETS) and fixed.choose(scores, depths, 4)[0] == max(BUCKETS)
    assert all(online.t_verify(n) == pytest.approx(STEEP.t_verify(n), rel=0.1) for n in BUCKETS)
    before = online.t_verify(min(BUCKETS))
    online.observe_time(min(BUCKETS), 100 * STEEP.t_verify(min(BUCKETS)))
    assert online.t_verify(min(BUCKETS)) < 1.1 * before

    slower = TreePolicy(STEEP, BUCKETS, max_depth=5)
    for _ in range(3 * TreePolicy.TIME_SEEN):
        for n in BUCKETS:
            slower.observe_time(n, 1.5 * STEEP.t_verify(n))
    assert slower.mean_time_factor == pytest.approx(1.5, rel=0.05)
    assert slower.choose(scores, depths, 4) == TreePolicy(STEEP, BUCKETS, max_depth=5).choose(scores, depths, 4)


def test_the_kept_candidates_form_a_connected_tree():
    """The policy keeps the best-scoring candidates; a child never outscores its parent, so the parents of
    every kept candidate are kept (checked on a drafted candidate set)."""
    torch.manual_seed(0)
    scores, depths = [], []
    parents = []
    for d in range(1, 4):
        for i in range(4 if d == 1 else 16):
            # depth 1: the root's 4 children; depth 2: 4 children of each; depth 3: children of candidates 4..7
            parent = -1 if d == 1 else (i // 4 if d == 2 else 4 + i // 4)
            base = 0.0 if parent < 0 else scores[parent]
            parents.append(parent)
            scores.append(base + math.log(torch.rand(()).item() * 0.9 + 0.05))
            depths.append(d)
    _, keep = TreePolicy(FREE, BUCKETS, max_depth=5).choose(scores, depths, 3)
    kept = set(keep)
    assert all(parents[i] < 0 or parents[i] in kept for i in keep)


def test_depth_follows_the_cost_of_drafting():
    """Cheap drafting with free verification drifts deeper; drafting that costs more than it can win
    drifts to depth 1."""
    cheap = TreePolicy(table({n: 10.0 for n in (1, 4, 8, 12, 16)}, first=0.1, step=0.01), BUCKETS, max_depth=5)
    dear = TreePolicy(table({n: 10.0 for n in (1, 4, 8, 12, 16)}, first=0.1, step=100.0), BUCKETS, max_depth=5)
    for _ in range(30):
        cheap.choose(*chain_like(cheap.depth()), cheap.depth())
        dear.choose(*chain_like(dear.depth()), dear.depth())
    assert cheap.depth_estimate > 3.5 and dear.depth_estimate < 1.5


def test_fused_rounds_are_sized_by_the_fused_call_and_draft_depth_1_for_free(tmp_path, monkeypatch):
    """Greedy rounds that verify with the head's catch-up inside the call: each size costs the fused call's
    time, depth 1 costs no drafting, and a table that never timed the fused call falls back to the sum of
    the two calls. The same candidates then get another size under the two cost models."""
    t = CostTable({n: 10.0 for n in (1, 2, 4, 8, 16)}, 5.0, 1.0, {"mode": "synthetic"},
                  fused_verify_ms={2: 10.5, 4: 20.0, 8: 30.0, 16: 40.0})
    assert t.t_draft(1, fused=True) == 0.0 and t.t_draft(3, fused=True) == 2.0 and t.t_draft(3) == 7.0
    assert t.t_verify(4, fused=True) == 20.0 and t.t_verify(6, fused=True) == pytest.approx(25.0)
    assert t.t_verify(4) == 10.0 and dataclasses.replace(t, fused_verify_ms={}).t_verify(4, fused=True) == 15.0
    assert CostTable.from_json(json.loads(json.dumps(t.to_json()))).fused_verify_ms == t.fused_verify_ms
    scores, depths = candidates(depth=1)
    # 4 candidates worth 0.5 each: 2 tokens verified give 1.5 expected, 4 give 2.5
    assert TreePolicy(t, (2, 4), max_depth=5).choose(scores, depths, 1)[0] == 4  # 2.5 / 15 ms against 1.5 / 15
    assert TreePolicy(t, (2, 4), max_depth=5, fused=True).choose(scores, depths, 1)[0] == 2  # 1.5 / 10.5 vs 2.5 / 20


def test_calibration_learns_observed_acceptance():
    """Drafts that are never accepted (whatever their scores say) lower the policy's factor for depth 1."""
    policy = TreePolicy(FREE, BUCKETS, max_depth=5)
    for _ in range(200):
        policy.observe([math.log(0.9)] * 3, [1, 1, 1], accepted_depth=0)
    assert policy.factor(1) < 0.2


def test_table_round_trips_and_interpolates(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    t = table({1: 10.0, 8: 17.0, 16: 30.0}, 2.0, 1.0)
    back = CostTable.from_json(json.loads(json.dumps(t.to_json())))
    assert back.verify_ms == t.verify_ms and back.t_draft(3) == t.t_draft(3) == 4.0
    assert t.t_verify(12) == pytest.approx(23.5)
    assert t.ratios()[16] == pytest.approx(3.0)
    path = costmodel.save_table(t)
    assert path.is_file() and json.loads(path.read_text())["ratios"]["8"] == 1.7


@pytest.fixture(scope="module")
def good(make_oracle_pair):
    model, head = make_oracle_pair(vocab_size=64, logit_scale=2.0, noise=0.3)
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in range(3, 13)]
    plain = Engine(model)
    want = [plain.generate(input_ids=p, method="vanilla", max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
    return model, head, prompts, want


@pytest.mark.parametrize("cost", ["free", "steep", "measured"])
def test_every_policy_is_greedy_lossless(cost, good, same_or_tie):
    model, head, prompts, want = good
    tab = {"free": FREE, "steep": STEEP, "measured": None}[cost]
    engine = Engine(model, head=head, tree=TreeConfig(auto=True, depth=5, total_tokens=16), cost_table=tab)
    engine.online_costs = cost == "measured"  # synthetic tables: sizes follow the table, not these tiny calls' times
    assert not Engine(model, head=head).online_costs  # off by default
    sizes = Counter()
    for p, w in zip(prompts, want):
        r = engine.generate(input_ids=p, max_new_tokens=24, ignore_eos=True)
        same_or_tie(model, p, r.token_ids, w)
        sizes[r.tree_tokens / r.target_forwards] += 1
    assert engine.policy is not None and engine.policy.rounds > 0
    assert bool(engine.policy.time_seen) == engine.online_costs  # every round's verification time is fed back
    mean = sum(k * v for k, v in sizes.items()) / sum(sizes.values())
    if cost == "free":
        assert mean > 12  # close to the largest bucket
    if cost == "steep":
        assert mean == pytest.approx(min(AUTO_BUCKETS))  # the smallest bucket, every round


@pytest.mark.parametrize("plain_rounds", [False, True])
def test_auto_policy_sampling_follows_the_target(plain_rounds, make_oracle_pair):
    """Sampling with the cost-model tree still draws the target's exact joint distribution; so it does
    with the speculate-or-not switch's plain rounds (forced every other round) among the speculative ones."""
    from test_lossless import SAMPLING, chi_square_pvalue, exact_continuations
    params = SAMPLING["t1"]
    model, head = make_oracle_pair(vocab_size=8, logit_scale=3.0, noise=0.3)
    engine = Engine(model, head=head, tree=TreeConfig(top_k=3, depth=3, total_tokens=8, auto=True),
                    cost_table=table({n: 10.0 + n for n in (1, 4, 8)}, 0.1, 0.1))
    if plain_rounds:
        engine._get_policy()
        engine._switch = Alternating(1, engine._pad)
    prompt = [1, 2, 3]
    expected = exact_continuations(model, prompt, 3, params)
    counts = Counter()
    for seed in range(1500):
        r = engine.generate(input_ids=prompt, max_new_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)
        counts[tuple(r.token_ids)] += 1
    if plain_rounds:
        assert engine._switch.plain_rounds > 1000
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_cli_tree_size_and_compile_flags(monkeypatch, capsys):
    import argparse
    ns = argparse.Namespace(tree="dynamic", top_k_draft=None, depth=None, total_tokens=None, tree_size="auto")
    assert tree_config(ns).auto
    ns.tree_size = "8"
    assert tree_config(ns) == TreeConfig(total_tokens=8)
    ns.tree, ns.tree_size = "static", "auto"
    assert not tree_config(ns).auto
    ns.tree_size = "big"
    with pytest.raises(ValueError, match="--tree-size"):
        tree_config(ns)
    flags = argparse.Namespace(compile=None, eager=False)
    monkeypatch.delenv("EAGLESPEC_EAGER", raising=False)
    monkeypatch.setattr("eaglespec.compiled.compiler_available", lambda: None)
    assert resolve_compile(flags) is True  # compiled is the default
    monkeypatch.setattr("eaglespec.compiled.compiler_available", lambda: "no C++ compiler found")
    assert resolve_compile(flags) is False
    assert "running eager" in capsys.readouterr().err
    assert resolve_compile(argparse.Namespace(compile=None, eager=True)) is False
    with pytest.raises(ValueError, match="contradict"):
        resolve_compile(argparse.Namespace(compile=True, eager=True))


def test_calibrate_command(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    model = str(tiny_checkpoint("llama"))
    argv = ["calibrate", "--model", model, "--head", "random", "--device", "cpu", "--eager", "--reps", "2",
            "--context", "32", "--sizes", "1,4,8"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["verify_ms"]) == {"1", "4", "8"} and out["ratios"]["1"] == 1.0 and out["draft_first_ms"] > 0
    assert list((tmp_path / "calibration").glob("*.json"))
    assert main(argv) == 0
    assert "T(n)/T(1)" in capsys.readouterr().out
    assert main(argv[:-1] + ["1,x"]) == 2
    assert "--sizes" in capsys.readouterr().err


def test_a_cached_table_that_no_longer_matches_the_machine_is_remeasured(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """A table timed on a loaded machine (here: T(n) 1 s, far off the live sub-100 ms calls) is caught by
    the spot check, replaced with a fresh measurement and reported in one line; a table that matches
    is kept as it is."""
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    engine = Engine.load(str(tiny_checkpoint("llama")), head="random", device="cpu", compile=False)
    sizes = (1,) + engine.auto_buckets()
    stale = CostTable({n: 1000.0 for n in sizes}, 500.0, 500.0, costmodel.table_key(engine), context=32)
    costmodel.save_table(stale)
    notes = []
    fresh = costmodel.load_or_measure(engine, sizes, log=notes.append)
    assert len(notes) == 1 and "T(1) 1000.0 ms cached" in notes[0] and "eaglespec calibrate" in notes[0]
    assert all(fresh.verify_ms[n] < 1000.0 for n in sizes) and fresh.draft_first_ms < 500.0
    assert costmodel.load_table(engine).verify_ms == fresh.verify_ms  # the fresh one is what is cached now

    # a table that matches the live timings (faked here: real sub-ms timings jitter) is returned untouched
    monkeypatch.setattr(costmodel, "_median_ms", lambda fn, reps: fresh.verify_ms[1] * 1.1)
    assert engine.fuses_catchup and set(fresh.fused_verify_ms) == set(sizes) - {1}  # greedy rounds' call timed too
    matching = CostTable({n: fresh.verify_ms[1] for n in sizes}, 1.0, 1.0, costmodel.table_key(engine),
                         fused_verify_ms={n: fresh.verify_ms[1] for n in sizes if n > 1})
    costmodel.save_table(matching)
    notes.clear()
    assert costmodel.load_or_measure(engine, sizes, log=notes.append).verify_ms == matching.verify_ms and not notes

    # a table from before the fused call (no timings of it) is measured again, with them, and without a notice
    costmodel.save_table(dataclasses.replace(matching, fused_verify_ms={}))
    again = costmodel.load_or_measure(engine, sizes, log=notes.append)
    assert set(again.fused_verify_ms) == set(sizes) - {1} and not notes


def test_a_run_times_only_the_calls_its_generations_make(tiny_checkpoint, tmp_path, monkeypatch):
    """A greedy-only engine (warmed for T = 0) times the plain step, the fused verification and a further depth,
    not the separate verification sizes or catch-up (on the default model each of those graphs costs a first
    run ~80 s of compiling); a later sampling run with the same table adds its own fused call and keeps the
    rest; only an engine warmed for everything (a filter at T > 0 may need them) times the separate calls."""
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    engine = Engine.load(str(tiny_checkpoint("llama")), head="random", device="cpu", compile=False)
    sizes = (1,) + engine.auto_buckets()
    timed = Counter()
    verify, draft = engine.time_verify_call, engine.time_draft_call
    monkeypatch.setattr(engine, "time_verify_call", lambda n, c, fused=False, sampled=False: (
        timed.update([("sampled-fused" if sampled else "fused" if fused else "verify", n)]),
        verify(n, c, fused, sampled))[1])
    monkeypatch.setattr(engine, "time_draft_call", lambda which, c, f=None: (
        timed.update([("draft", which)]), draft(which, c, f))[1])
    # the spot check (tested above) would re-time on a sub-ms jitter of these tiny calls; here the machine is as it was
    monkeypatch.setattr(costmodel, "stale_sizes", lambda *a, **k: {})
    engine.warmed_for = True
    greedy = costmodel.load_or_measure(engine, sizes)
    assert {k for k in timed if k[0] == "verify"} == {("verify", 1)} and ("draft", "first") not in timed
    assert not any(k[0] == "sampled-fused" for k in timed)
    assert set(greedy.fused_verify_ms) == set(sizes) - {1} and greedy.draft_step_ms > 0 and greedy.draft_first_ms == 0
    timed.clear()
    engine.warmed_for = False
    sampling = costmodel.load_or_measure(engine, sizes)
    assert {k[0] for k in timed} == {"sampled-fused"} and set(sampling.sampled_fused_ms) == set(sizes) - {1}
    assert sampling.fused_verify_ms == greedy.fused_verify_ms and sampling.verify_ms == greedy.verify_ms
    timed.clear()
    engine.warmed_for = None
    full = costmodel.load_or_measure(engine, sizes)
    assert {k[0] for k in timed} == {"verify", "draft"} and ("draft", "first") in timed
    assert set(full.verify_ms) == set(sizes) and full.draft_first_ms > 0 and full.fused_verify_ms == greedy.fused_verify_ms
    assert full.sampled_fused_ms == sampling.sampled_fused_ms
    timed.clear()
    assert costmodel.load_or_measure(engine, sizes).verify_ms == full.verify_ms and not timed  # complete now


class Alternating(SpecSwitch):
    """A switch that forces a pattern: plain rounds (as many as `plain` in a row, within the stretch),
    then one speculative round, whatever the timings; it still records them."""

    def __init__(self, plain: int, stretch: int):
        super().__init__(1.0, stretch)
        self.plain = plain
        self.plain_rounds = 0

    def plain_next(self, pending: int) -> bool:
        go = pending < min(self.plain, self.stretch)
        self.plain_rounds += go
        return go


def test_spec_switch_prefers_what_measures_faster():
    s = SpecSwitch(plain_ms_prior=10.0, stretch=5)
    assert not s.plain_next(0)  # nothing measured: speculate
    s.record(True, 0.030, 2)  # 15 ms a token, against a 10 ms plain step: plain rounds, up to the stretch
    assert s.plain_next(0) and s.plain_next(4) and not s.plain_next(5)
    s.record(False, 0.020, 1)  # a measured plain step (20 ms) replaces the prior: speculating pays again
    assert s.plain_ms == pytest.approx(20.0) and not s.plain_next(0)
    for _ in range(50):
        s.record(True, 0.060, 2)  # 30 ms a token, steadily
    assert s.plain_next(0)


@pytest.mark.parametrize("plain", [1, 3, 99])
def test_plain_rounds_inside_eagle_are_greedy_lossless(plain, good, same_or_tie):
    """Rounds that verify the root alone (the switch's plain rounds), mixed with speculative ones in
    every pattern, including the longest stretch the head's catch-up takes: plain decoding's tokens."""
    model, head, prompts, want = good
    engine = Engine(model, head=head, tree=TreeConfig(auto=True, depth=5, total_tokens=16), cost_table=FREE)
    engine._get_policy()
    engine._switch = switch = Alternating(plain, engine._pad)
    for p, w in zip(prompts, want):
        r = engine.generate(input_ids=p, max_new_tokens=24, ignore_eos=True)
        same_or_tie(model, p, r.token_ids, w)
    assert switch.plain_rounds > 20 and switch.spec_ms is not None and switch.plain_measured

