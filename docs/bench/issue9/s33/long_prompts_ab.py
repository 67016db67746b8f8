"""The context-aware cost table's A/B (thirty-third session; not kept): plain decoding, EAGLE with the verification time
corrected for each round's context, and EAGLE with the table alone, interleaved per prompt. Needs
docs/bench/issue9/s33/context-aware.patch applied (it toggles CostTable.context_extra). Run from the repository root:
    git apply docs/bench/issue9/s33/context-aware.patch
    python docs/bench/issue9/s33/long_prompts_ab.py N TEMPERATURE long|mt
"long": each of the first N MT-bench questions after a passage of the regenerated corpus (shards 300-339, answers
over 2,500 characters, cut at 4,000); "mt": the questions alone."""
import gzip, json, sys, time, os
import eaglespec.costmodel as C
from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig
nq = int(sys.argv[1]); temp = float(sys.argv[2]); kind = sys.argv[3]  # kind: long | mt
e = Engine.load(compile=True, tree=TreeConfig(auto=True))
e.warmup(greedy=temp == 0)
tab = e._table()
print("table long", tab.long_context, {k: round(v, 2) for k, v in tab.long_verify_ms.items()}, "short", {k: round(v, 2) for k, v in tab.verify_ms.items()}, flush=True)
qs = [json.loads(l)["turns"][0] for l in open("../shared/datasets/mt_bench.jsonl")][:nq]
if kind == "long":
    passages = []
    for sh in range(300, 340):
        for line in gzip.open(f"corpora/smollm2-135m-instruct/regen/shard-{sh:05d}.jsonl.gz", "rt"):
            for m in json.loads(line)["messages"]:
                if m["role"] == "assistant" and len(m["content"]) > 2500:
                    passages.append(m["content"][:4000])
        if len(passages) >= nq: break
    msgs = [[{"role": "user", "content": f"Background:\n{passages[i]}\n\nUsing the background where it helps, answer: {q}"}] for i, q in enumerate(qs)]
else:
    msgs = [[{"role": "user", "content": q}] for q in qs]
real = C.CostTable.context_extra
stats = {k: [0, 0, 0, 0.0, 0] for k in ("vanilla", "eagle-context", "eagle-table")}
same = 0
for i, m in enumerate(msgs):
    outs = {}
    for name in ("vanilla", "eagle-context", "eagle-table"):
        C.CostTable.context_extra = real if name == "eagle-context" else (lambda self, n, c: 0.0)
        t = time.perf_counter()
        r = e.generate(messages=m, max_new_tokens=128, method="vanilla" if name == "vanilla" else "eagle", temperature=temp, seed=i)
        dt = time.perf_counter() - t
        s = stats[name]; s[0] += r.new_tokens; s[1] += r.target_forwards; s[2] += r.tree_tokens; s[3] += dt; s[4] += r.prompt_tokens
        outs[name] = r.token_ids
    same += outs["vanilla"] == outs["eagle-context"] == outs["eagle-table"]
base = stats["vanilla"][0] / stats["vanilla"][3]
for name, (toks, fw, tt, secs, pt) in stats.items():
    print(f"{name}: {toks / secs:.1f} tok/s, speed-up {toks / secs / base:.3f}, tau {toks / fw:.3f}, tree tokens {tt / fw:.2f}, mean prompt {pt / len(msgs):.0f}")
print("identical", same, "of", len(msgs))
