"""Prints a calibration (T(n), the greedy and sampled fused calls, as T(n)/T(1)) and each benchmarked method's speed-up,
tau, round and draft cost, over all questions and over the first 20 (tokens and time summed over them, as the bench
does). Shared by the issue-9 run scripts: python docs/bench/issue9/summary.py CALIBRATE_JSON BENCH_JSON..."""
import json
import sys
from collections import defaultdict

cal = json.load(open(sys.argv[1]))
v, f, s = cal["verify_ms"], cal.get("fused_verify_ms", {}), cal.get("sampled_fused_ms", {})
t1 = v["1"]
print(f"calibration: T(1) {t1:.2f} ms; draft first {cal['draft_first_ms']:.2f} ms, step {cal['draft_step_ms']:.2f} ms")
for n in sorted(v, key=int):
    extra = f" fused {f[n]:.2f} ms ({f[n] / t1:.2f})" if n in f else ""
    extra += f" sampled fused {s[n]:.2f} ms ({s[n] / t1:.2f})" if n in s else ""
    print(f"  T({n}) {v[n]:.2f} ms ({v[n] / t1:.2f}){extra}")
for path in sys.argv[2:]:
    d = json.load(open(path))
    print(path, "greedy identical:", d.get("greedy_identical"))
    for m, r in d["methods"].items():
        print(f"  {m:14s} {r['tokens_per_s']:7.1f} tok/s  {r['speedup']:.3f}x  tau {r['tau']:.3f}  "
              f"round {r['round_cost_steps']:.3f}  draft {r['draft_cost_steps']:.3f}  tree {r['mean_tree_tokens']:.2f}")
    firsts = sorted({rec["question_id"] for rec in d["records"]})[:20]
    tok, sec, fwd = defaultdict(int), defaultdict(float), defaultdict(int)
    for rec in d["records"]:
        if rec["question_id"] in firsts:
            tok[rec["method"]] += rec["new_tokens"]
            sec[rec["method"]] += rec["time_s"]
            fwd[rec["method"]] += rec["target_forwards"]
    base = tok["vanilla"] / sec["vanilla"]
    print("  first 20 questions: " + ", ".join(
        f"{m} {tok[m] / sec[m] / base:.3f}x (tau {tok[m] / max(fwd[m], 1):.3f})" for m in tok if m != "vanilla"))
