"""Plain decoding, default path (packed GEMM, compiled) against the compiled path as it was before
this work (torch's GEMMs: MKL GEMV for one row, frozen), on the first 6 MT-bench questions, 128 tokens,
interleaved in one process over the same weights."""
import json, sys, time
import torch
from eaglespec.engine import Engine
from eaglespec.loading import load_target, load_tokenizer
from eaglespec.bench import resolve_dataset, load_questions, pick, conversation
qs = pick(load_questions(resolve_dataset("mt_bench", None)), 6)
t_old, folder = load_target(None); tok = load_tokenizer(folder)
t_new, _ = load_target(None)
old = Engine(t_old, tok, None, compile=True, packed_gemm=False)
new = Engine(t_new, tok, None, compile=True)
assert new.packed_gemm and not old.packed_gemm
prompts = [old.encode(messages=conversation(q.turns[:1], [])) for q in qs]
for e in (old, new):
    e.warmup(); e.generate(input_ids=prompts[0], method="vanilla", max_new_tokens=16, ignore_eos=True)
rates = {"torch": [], "packed": []}
outs = {}
for rep in range(3):
    for name, e in (("torch", old), ("packed", new)) if rep % 2 == 0 else (("packed", new), ("torch", old)):
        toks, secs = 0, 0.0
        for p in prompts:
            t = time.perf_counter()
            r = e.generate(input_ids=p, method="vanilla", max_new_tokens=128, temperature=0)
            secs += time.perf_counter() - t; toks += len(r.token_ids)
            outs.setdefault((name, tuple(p)), r.token_ids)
        rates[name].append(toks / secs)
        print(name, f"{toks / secs:.1f} tok/s", flush=True)
same = all(outs[("torch", tuple(p))] == outs[("packed", tuple(p))] for p in prompts)
import statistics as st
res = {k: st.median(v) for k, v in rates.items()}
print(json.dumps({"median_tok_s": res, "ratio_packed_over_torch": res["packed"] / res["torch"], "runs": rates, "identical": same}))
