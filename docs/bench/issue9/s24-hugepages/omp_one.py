"""One process: plain and EAGLE, interleaved, on the first N MT-bench questions; prints medians (tok/s)."""
import json, os, statistics as st, sys, time
from eaglespec.bench import conversation, load_questions, pick, resolve_dataset
from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig
n_q, reps = int(sys.argv[1]), int(sys.argv[2])
e = Engine.load(compile=True, tree=TreeConfig(auto=True))
if os.environ.get("COST_TABLE"):  # one table for every process: the policy's choices do not differ by table
    from eaglespec.costmodel import CostTable
    e._cost_table = CostTable.from_json(json.load(open(os.environ["COST_TABLE"])))
qs = pick(load_questions(resolve_dataset("mt_bench", None)), n_q)
prompts = [e.encode(messages=conversation(q.turns[:1], [])) for q in qs]
e.warmup()
for m in ("vanilla", "eagle"):
    e.generate(input_ids=prompts[0], method=m, max_new_tokens=16, ignore_eos=True)
rates, outs, tau = {"vanilla": [], "eagle": []}, {}, []
for rep in range(reps):
    for m in (("vanilla", "eagle") if rep % 2 == 0 else ("eagle", "vanilla")):
        toks = secs = 0
        for p in prompts:
            t = time.perf_counter()
            r = e.generate(input_ids=p, method=m, max_new_tokens=128, temperature=0)
            secs += time.perf_counter() - t; toks += len(r.token_ids)
            outs.setdefault((m, tuple(p)), r.token_ids)
        rates[m].append(toks / secs)
same = all(outs[("vanilla", tuple(p))] == outs[("eagle", tuple(p))] for p in prompts)
print(json.dumps({"setting": os.environ.get("SETTING"), "plain": st.median(rates["vanilla"]), "eagle": st.median(rates["eagle"]),
                  "ratio": st.median(rates["eagle"]) / st.median(rates["vanilla"]), "identical": same}))
