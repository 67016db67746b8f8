"""Where a round's time goes, part by part: each call of one EAGLE round (and of a plain step) wrapped in a timer,
on the default path, over MT-bench first turns at T = 0 (128 tokens), the engine warmed up first.

    PAUSE=PID python docs/bench/issue9/s25/round_parts.py [QUESTIONS] [TEMPERATURE]
"""
import collections, json, os, signal, sys, time
import torch
import eaglespec.engine as E
import eaglespec.tree as T
from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig

nq = int(sys.argv[1]) if len(sys.argv) > 1 else 10
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
pause = int(os.environ.get("PAUSE", 0))
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
if pause: os.kill(pause, signal.SIGSTOP)
try:
    e = Engine.load(compile=True, tree=TreeConfig(auto=True))
    e.warmup()
    for m in ("vanilla", "eagle"):  # warm both paths (the cost table, the policy's first rounds)
        e.generate(messages=[{"role": "user", "content": qs[0]}], max_new_tokens=32, method=m)
    e._verify_forward = timed("verify_forward", e._verify_forward)
    e._move = timed("move (KV compaction)", e._move)
    e._choose_tree = timed("choose_tree (policy)", e._choose_tree)
    e._catchup = timed("catch-up (+depth 1)", e._catchup)
    e._learn = timed("learn (policy update)", e._learn)
    E.greedy_accept = timed("greedy_accept", E.greedy_accept)
    E.verify = timed("verify (sampling)", E.verify)
    E.Drafter.draft = timed("drafter.draft (depths >= 2)", E.Drafter.draft)
    res = {}
    for m in ("vanilla", "eagle"):
        acc.clear(); calls.clear()
        tot, toks, rounds = 0.0, 0, 0
        for q in qs:
            t = time.perf_counter()
            r = e.generate(messages=[{"role": "user", "content": q}], max_new_tokens=128, method=m,
                           temperature=temp, seed=0)
            tot += time.perf_counter() - t
            toks += r.new_tokens; rounds += r.target_forwards
        print(f"\n{m}: {toks} tokens, {rounds} target forwards, {1e3 * tot / rounds:.3f} ms per forward "
              f"(whole generate, prefill included), {toks / tot:.1f} tok/s")
        for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
            print(f"  {k:32s} {1e3 * v / rounds:7.3f} ms/round  ({calls[k]} calls)")
        print(f"  {'(all else)':32s} {1e3 * (tot - sum(acc.values())) / rounds:7.3f} ms/round")
finally:
    if pause: os.kill(pause, signal.SIGCONT)
