# two engines: inductor kernels with 2 threads (default) vs 1 thread; interleaved plain + eagle on 6 MT-bench
import os, sys, time, statistics as st
from eaglespec.bench import conversation, load_questions, pick, resolve_dataset
from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig
qs = pick(load_questions(resolve_dataset("mt_bench", None)), 6)
engines = {}
for name, v in (("thr2", ""), ("thr1", "1")):
    if v: os.environ["EAGLESPEC_INDUCTOR_THREADS"] = v
    else: os.environ.pop("EAGLESPEC_INDUCTOR_THREADS", None)
    engines[name] = Engine.load(compile=True, tree=TreeConfig(auto=True))
prompts = [engines["thr2"].encode(messages=conversation(q.turns[:1], [])) for q in qs]
for e in engines.values():
    e.warmup()
    for m in ("vanilla", "eagle"):
        e.generate(input_ids=prompts[0], method=m, max_new_tokens=16, ignore_eos=True)
rates, outs = {}, {}
for rep in range(3):
    order = list(engines.items()) if rep % 2 == 0 else list(engines.items())[::-1]
    for name, e in order:
        for m in ("vanilla", "eagle"):
            toks, secs = 0, 0.0
            for p in prompts:
                t = time.perf_counter(); r = e.generate(input_ids=p, method=m, max_new_tokens=128, temperature=0); secs += time.perf_counter() - t
                toks += len(r.token_ids); outs.setdefault((name, m, tuple(p)), r.token_ids)
            rates.setdefault((name, m), []).append(toks / secs)
            print(rep, name, m, f"{toks/secs:.1f}", flush=True)
for k, v in rates.items(): print(k, f"median {st.median(v):.1f}")
print("identical:", all(outs[("thr1", m, tuple(p))] == outs[("thr2", "vanilla", tuple(p))] for m in ("vanilla", "eagle") for p in prompts))
