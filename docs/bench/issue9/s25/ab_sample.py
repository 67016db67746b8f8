"""In-process A/B of sampling.sample's two-level draw (BLOCK = 1024) against one float64 scan of the whole
vocabulary (the previous draw), plain decoding and EAGLE at T = 1, interleaved question by question.

    PAUSE=PID python docs/bench/issue9/s25/ab_sample.py [QUESTIONS] [REPS]

The two-level draw was not kept (no measured win; docs/performance.md, twenty-fifth session), so
sampling.sample no longer reads BLOCK: to rerun this, put back the draw this script measured (a branch on
`probs.numel() >= 8 * BLOCK` in sample(): the blocks' float64 sums, searchsorted over their cumsum, then one
block's cumsum), with BLOCK a module global.
"""
import json, os, signal, sys, time
import eaglespec.sampling as S
from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig

nq = int(sys.argv[1]) if len(sys.argv) > 1 else 10
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
pause = int(os.environ.get("PAUSE", 0))
qs = [json.loads(l)["turns"][0] for l in open("../shared/datasets/mt_bench.jsonl")][:nq]
variants = {"one scan": 10**9, "two-level": 1024}
if pause: os.kill(pause, signal.SIGSTOP)
try:
    e = Engine.load(compile=True, tree=TreeConfig(auto=True)); e.warmup()
    for m in ("vanilla", "eagle"):
        e.generate(messages=[{"role": "user", "content": qs[0]}], max_new_tokens=32, method=m, temperature=1.0)
    tot = {(m, v): [0.0, 0] for m in ("vanilla", "eagle") for v in variants}
    for r in range(reps):
        for i, q in enumerate(qs):
            for m in ("vanilla", "eagle"):
                order = list(variants) if (i + r) % 2 == 0 else list(reversed(variants))
                for v in order:
                    S.BLOCK = variants[v]
                    t = time.perf_counter()
                    res = e.generate(messages=[{"role": "user", "content": q}], max_new_tokens=128, method=m,
                                     temperature=1.0, seed=i)
                    tot[(m, v)][0] += time.perf_counter() - t
                    tot[(m, v)][1] += res.new_tokens
    for m in ("vanilla", "eagle"):
        rates = {v: tot[(m, v)][1] / tot[(m, v)][0] for v in variants}
        print(f"{m}: " + ", ".join(f"{v} {x:.1f} tok/s" for v, x in rates.items())
              + f"  (two-level / one scan {rates['two-level'] / rates['one scan']:.3f})")
    print("eagle / vanilla: " + ", ".join(
        f"{v} {tot[('eagle', v)][1] / tot[('eagle', v)][0] / (tot[('vanilla', v)][1] / tot[('vanilla', v)][0]):.3f}"
        for v in variants))
finally:
    if pause: os.kill(pause, signal.SIGCONT)
