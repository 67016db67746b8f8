"""Weights kept as their GGUF blocks (cpugemm.quant_mm, the default where the target's weights are exact Q4_1 /
Q8_0 blocks) against fp32 panels (EAGLESPEC_CPU_QUANT=0), both on the default path (compiled): plain decoding
and EAGLE on the first N MT-bench questions (128 tokens, T = 0), two engines on separate copies of the weights,
interleaved in one process (the order alternates each repetition); outputs compared token for token.

    python scripts/gguf-gemm-ab.py [N] [REPS]      PAUSE=PID stops a background job meanwhile
    AB=EAGLESPEC_DRAFT_Q8 ...   both on GGUF blocks; the draft head on fp32 ("fp32") or Q8_0 blocks ("gguf")
    AB=EAGLESPEC_SPEC_SWITCH ...  both on GGUF blocks; the speculate-or-not switch off ("fp32") or on ("gguf")
    VALUES=1,int8 ...  the two values the AB variable takes (default 0,1); "fp32" names the engine with
                    the first, "gguf" the one with the second (EAGLESPEC_CPU_QUANT=int8: GGUF blocks times
                    int8 activations, against the exact blocks)
    TEMP=1 ...      sample at T = 1 (outputs are then not compared)
"""
import json, os, signal, statistics as st, sys, time
from eaglespec.bench import conversation, load_questions, pick, resolve_dataset
from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig

n_q = int(sys.argv[1]) if len(sys.argv) > 1 else 6
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
pause = int(os.environ.get("PAUSE", 0))
if pause:
    os.kill(pause, signal.SIGSTOP)
try:
    qs = pick(load_questions(resolve_dataset("mt_bench", None)), n_q)
    engines = {}
    values = os.environ.get("VALUES", "0,1").split(",")
    for name, flag in (("fp32", values[0]), ("gguf", values[1])):
        os.environ[os.environ.get("AB", "EAGLESPEC_CPU_QUANT")] = flag
        engines[name] = Engine.load(compile=True, tree=TreeConfig(auto=True))
    kinds = {name: [sorted({getattr(m, "kind", 0) for m in mod.modules() if hasattr(m, "kind")}) for mod in (e.model, e.head)]
             for name, e in engines.items()}
    print("linear kinds:", kinds, flush=True)
    prompts = [engines["fp32"].encode(messages=conversation(q.turns[:1], [])) for q in qs]
    for e in engines.values():
        e.warmup()
        for method in ("vanilla", "eagle"):
            e.generate(input_ids=prompts[0], method=method, max_new_tokens=16, ignore_eos=True)
    rates, outs, taus = {}, {}, {}
    for rep in range(reps):
        order = list(engines.items()) if rep % 2 == 0 else list(engines.items())[::-1]
        for name, e in order:
            for method in ("vanilla", "eagle"):
                toks, secs, rounds = 0, 0.0, 0
                for p in prompts:
                    t = time.perf_counter()
                    r = e.generate(input_ids=p, method=method, max_new_tokens=128,
                                   temperature=float(os.environ.get("TEMP", 0)), seed=rep)
                    secs += time.perf_counter() - t
                    toks += len(r.token_ids)
                    outs.setdefault((name, method, tuple(p)), r.token_ids)
                rates.setdefault((name, method), []).append(toks / secs)
                print(rep, name, method, f"{toks / secs:.1f} tok/s", flush=True)
finally:
    if pause:
        os.kill(pause, signal.SIGCONT)
med = {f"{n}/{m}": st.median(v) for (n, m), v in rates.items()}
same = {f"{a}/{ma} == {b}/{mb}": all(outs[(a, ma, tuple(p))] == outs[(b, mb, tuple(p))] for p in prompts)
        for a, ma, b, mb in (("fp32", "vanilla", "gguf", "vanilla"), ("gguf", "vanilla", "gguf", "eagle"),
                             ("fp32", "vanilla", "gguf", "eagle"))}
print(json.dumps({"median_tok_s": med, "gguf_over_fp32_plain": med["gguf/vanilla"] / med["fp32/vanilla"],
                  "gguf_eagle_over_gguf_plain": med["gguf/eagle"] / med["gguf/vanilla"],
                  "gguf_eagle_over_fp32_plain": med["gguf/eagle"] / med["fp32/vanilla"],
                  "identical": same, "runs": {f"{n}/{m}": v for (n, m), v in rates.items()}}, indent=1))
