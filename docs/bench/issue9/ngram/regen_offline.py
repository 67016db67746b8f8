"""The head's teacher-forced top-1 on regenerated records it never saw (shards 57-59), first answer, by temperature."""
import gzip, json, sys, torch
from collections import defaultdict
from eaglespec.engine import Engine, _Timers
eng = Engine.load(compile=False, packed_gemm=False, head=sys.argv[2] if len(sys.argv) > 2 else None)
torch.set_grad_enabled(False)
res = defaultdict(lambda: [0, 0]); bypos = defaultdict(lambda: [0, 0])
n = 0
for shard in sys.argv[1].split(","):
    for line in gzip.open(shard, "rt"):
        r = json.loads(line)
        msgs = r["messages"]
        i = next(j for j, m in enumerate(msgs) if m["role"] == "user")
        if i + 1 >= len(msgs) or msgs[i + 1]["role"] != "assistant": continue
        prompt = eng.encode(messages=msgs[: i + 1])
        full = eng._tokenize(eng.render_chat(msgs[: i + 2]))
        if full[: len(prompt)] != prompt: print("prefix mismatch"); continue
        seq = full[: len(prompt) + 128]
        feats, _ = eng._prefill(seq, _Timers())
        toks = torch.tensor([seq[1:] + [0]])
        h = eng.head.first(eng.model.embed_tokens(toks), feats[None], torch.arange(len(seq))[None], cache_start=0)[0]
        top = eng._to_target_ids(eng._draft_logprobs(h).argmax(-1))
        # label: the target's own argmax at the next position (as evaluate does)
        x = torch.tensor([seq]); _, logits = eng.model(x, torch.arange(len(seq))[None], cache_start=0)
        amax = logits[0].argmax(-1)
        P = len(prompt)
        t = r.get("temperature")
        for k in range(P - 1, len(seq) - 2):
            hh = int(top[k] == amax[k + 1]); res[t][0] += 1; res[t][1] += hh
            b = (k - P + 1) // 32; bypos[b][0] += 1; bypos[b][1] += hh
        n += 1
print(n, "records;", {k: (round(v[1] / v[0], 3), v[0]) for k, v in res.items()})
print("by block", {k: round(v[1] / v[0], 3) for k, v in sorted(bypos.items())})
