"""cpugemm's attention kernel against torch's SDPA inside the default (packed, compiled) engine: T(n) of the
verification call and plain / EAGLE decoding on the first 6 MT-bench questions (128 tokens, T = 0),
two engines on separate weights, interleaved in one process (the order alternates each repetition)."""
import json, os, signal, statistics as st, sys, time
import torch
from eaglespec.engine import Engine
from eaglespec.model import Attention
from eaglespec.tree import TreeConfig
from eaglespec.bench import resolve_dataset, load_questions, pick, conversation

# PAUSE=PID: a background job (the regeneration) is stopped throughout (the tree policy calibrates too)
pause = int(os.environ.get("PAUSE", 0))
if pause:
    os.kill(pause, signal.SIGSTOP)
qs = pick(load_questions(resolve_dataset("mt_bench", None)), 6)
engines = {}
for name in ("sdpa", "kernel"):
    e = Engine.load(compile=True, tree=TreeConfig(auto=True))
    if name == "sdpa":
        for m in list(e.model.modules()) + list(e.head.modules()):
            if isinstance(m, Attention):
                m.small_attention = False
    engines[name] = e
assert any(isinstance(m, Attention) and m.small_attention for m in engines["kernel"].model.modules())
prompts = [engines["sdpa"].encode(messages=conversation(q.turns[:1], [])) for q in qs]
for e in engines.values():
    e.warmup()
    for method in ("vanilla", "eagle"):
        e.generate(input_ids=prompts[0], method=method, max_new_tokens=16, ignore_eos=True)
sizes = (1, 4, 8, 16, 32)
ctx = 384
tv = {(n, s): [] for n in engines for s in sizes}
for rep in range(15):
    for name in (("sdpa", "kernel") if rep % 2 == 0 else ("kernel", "sdpa")):
        for s in sizes:
            t = time.perf_counter(); engines[name].time_verify_call(s, ctx); tv[(name, s)].append(time.perf_counter() - t)
T = {name: {s: 1e3 * st.median(tv[(name, s)]) for s in sizes} for name in engines}
for name in engines:
    print(name, "T(n) ms", {s: round(v, 2) for s, v in T[name].items()}, "ratios", {s: round(T[name][s] / T[name][1], 2) for s in sizes}, flush=True)
rates = {(n, m): [] for n in engines for m in ("vanilla", "eagle")}
outs, tau = {}, {}
for rep in range(3):
    for name in (("sdpa", "kernel") if rep % 2 == 0 else ("kernel", "sdpa")):
        for method in ("vanilla", "eagle"):
            toks, secs, acc, rounds = 0, 0.0, 0, 0
            for p in prompts:
                t = time.perf_counter()
                r = engines[name].generate(input_ids=p, method=method, max_new_tokens=128, temperature=0)
                secs += time.perf_counter() - t; toks += len(r.token_ids)
                outs.setdefault((name, method, tuple(p)), r.token_ids)
            rates[(name, method)].append(toks / secs)
            print(rep, name, method, f"{toks / secs:.1f} tok/s", flush=True)
if pause:
    os.kill(pause, signal.SIGCONT)
same = all(outs[(n, m, tuple(p))] == outs[("sdpa", "vanilla", tuple(p))] for n in engines for m in ("vanilla", "eagle") for p in prompts)
med = {f"{n}/{m}": st.median(v) for (n, m), v in rates.items()}
print(json.dumps({"verify_ms": T, "median_tok_s": med,
                  "kernel_over_sdpa": {m: med[f"kernel/{m}"] / med[f"sdpa/{m}"] for m in ("vanilla", "eagle")},
                  "eagle_over_vanilla": {n: med[f"{n}/eagle"] / med[f"{n}/vanilla"] for n in engines},
                  "all_identical": same}, indent=1))
