"""One side of a cross-process A/B: plain decoding and EAGLE (default path, shipped head) interleaved question
by question over MT-bench first turns, T = 0, 128 tokens; prints both rates and their ratio. Run alternately
from two checkouts (PYTHONPATH=CHECKOUT) so that machine drift hits both alike.

    PYTHONPATH=DIR python ab_procs.py QUESTIONS LABEL
"""
import json, sys, time
import eaglespec
from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig

nq, label = int(sys.argv[1]), sys.argv[2]
qs = [json.loads(l)["turns"][0] for l in open("/work/shared/datasets/mt_bench.jsonl")][:nq]
e = Engine.load(compile=True, tree=TreeConfig(auto=True))
e.warmup()
for m in ("vanilla", "eagle"):
    e.generate(messages=[{"role": "user", "content": qs[0]}], max_new_tokens=32, method=m)
tot = {"vanilla": [0.0, 0], "eagle": [0.0, 0]}
ids = {}
for q in qs:
    for m in ("vanilla", "eagle"):
        t = time.perf_counter()
        r = e.generate(messages=[{"role": "user", "content": q}], max_new_tokens=128, method=m)
        tot[m][0] += time.perf_counter() - t
        tot[m][1] += r.new_tokens
        ids.setdefault(q, []).append(r.token_ids)
same = all(a == b for a, b in ids.values())
v, g = (tot[m][1] / tot[m][0] for m in ("vanilla", "eagle"))
huge = next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages"))
print(f"{label} {eaglespec.__file__.split('/eaglespec/')[0]} (AnonHugePages {huge // 1024} MiB): vanilla {v:.1f} eagle {g:.1f} tok/s ratio {g / v:.3f} "
      f"identical {same}", flush=True)
