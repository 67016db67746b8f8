"""Where a sampled round's time goes (T > 0, the rejection sampling and the catch-up inside the verification):
each part of a round wrapped in a timer, on the default path, over MT-bench first turns (128 tokens), the engine
warmed up first. As docs/bench/issue9/s25/round_parts.py, for the thirty-second session's rounds.

    python docs/bench/issue9/sampled-fused/parts/round_parts.py [QUESTIONS] [TEMPERATURE]
"""
import collections, json, sys, time
import eaglespec.engine as E
from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig

nq = int(sys.argv[1]) if len(sys.argv) > 1 else 10
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
acc = collections.defaultdict(float)
calls = collections.Counter()


def timed(name, fn):
    def wrap(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t
            calls[name] += 1
    return wrap


qs = [json.loads(l)["turns"][0] for l in open("../shared/datasets/mt_bench.jsonl")][:nq]
e = Engine.load(compile=True, tree=TreeConfig(auto=True))
e.warmup()
for m in ("vanilla", "eagle"):
    e.generate(messages=[{"role": "user", "content": qs[0]}], max_new_tokens=32, method=m, temperature=temp, seed=1)
e._fused_sampled_call = timed("fused sampled call", e._fused_sampled_call)
e._fused_call = timed("fused greedy call", e._fused_call)
e._verify_forward = timed("verify_forward", e._verify_forward)
e._tree_draw_inputs = timed("tree_draw_inputs", e._tree_draw_inputs)
e._sampled_rows = timed("sampled_rows", e._sampled_rows)
e._move_both = timed("move_both (KV compaction)", e._move_both)
e._choose_tree = timed("choose_tree (policy)", e._choose_tree)
e._children_of = timed("children_of (next root's draws)", e._children_of)
e._learn = timed("learn (policy update)", e._learn)
E.greedy_accept = timed("greedy_accept", E.greedy_accept)
E.trials_from_draws = timed("trials_from_draws", E.trials_from_draws)
E.Drafter.draft = timed("drafter.draft", E.Drafter.draft)
for m in ("vanilla", "eagle"):
    acc.clear(); calls.clear()
    tot, toks, rounds = 0.0, 0, 0
    for q in qs:
        t = time.perf_counter()
        r = e.generate(messages=[{"role": "user", "content": q}], max_new_tokens=128, method=m, temperature=temp, seed=0)
        tot += time.perf_counter() - t
        toks += r.new_tokens; rounds += r.target_forwards
    print(f"\n{m} (T = {temp}): {toks} tokens, {rounds} target forwards, {1e3 * tot / rounds:.3f} ms per forward "
          f"(whole generate, prefill included), {toks / tot:.1f} tok/s")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {k:34s} {1e3 * v / rounds:7.3f} ms/round  ({calls[k]} calls)")
    print(f"  {'(all else)':34s} {1e3 * (tot - sum(acc.values())) / rounds:7.3f} ms/round")
