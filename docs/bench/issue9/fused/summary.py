"""Prints the calibration (T(n), fused T(n), ratios) and each method's speed-up, tau, round and draft cost."""
import json
import sys

cal = json.load(open(sys.argv[1]))
v, f = cal["verify_ms"], cal.get("fused_verify_ms", {})
t1 = v["1"]
print(f"calibration: T(1) {t1:.2f} ms; draft first {cal['draft_first_ms']:.2f} ms, step {cal['draft_step_ms']:.2f} ms")
for n in sorted(v, key=int):
    extra = f" fused {f[n]:.2f} ms ({f[n] / t1:.2f}; +{f[n] - v[n]:.2f})" if n in f else ""
    print(f"  T({n}) {v[n]:.2f} ms ({v[n] / t1:.2f}){extra}")
for path in sys.argv[2:]:
    d = json.load(open(path))
    print(path, "greedy identical:", d.get("greedy_identical"))
    for m, r in d["methods"].items():
        print(f"  {m:14s} {r['tokens_per_s']:7.1f} tok/s  {r['speedup']:.3f}x  tau {r['tau']:.3f}  "
              f"round {r['round_cost_steps']:.3f}  draft {r['draft_cost_steps']:.3f}  tree {r['mean_tree_tokens']:.2f}")
