# Coverage of draft vocabularies: token counts of the regenerated store's answers (shards 50 on), and the share of the
# target's own MT-bench answers (runs/s21/mt80-regen-T{0,1}, first 128 tokens each) inside the shipped head's 8,192
# tokens and inside the N most frequent regenerated-answer tokens. Run from the repository root.
import gzip, json, glob, os, torch, time
from safetensors import safe_open
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(os.path.expanduser('~/.cache/eaglespec/models/SmolLM2-135M-Instruct'))
t0 = time.time()
counts = torch.zeros(49152, dtype=torch.long)
texts = []
shards = sorted(glob.glob("corpora/smollm2-135m-instruct/regen/shard-*.jsonl.gz"))
for sh in shards[50:]:  # leave the first shards out: the held-out conversations are chosen among all; fine for counts
    for line in gzip.open(sh, "rt"):
        for x in json.loads(line)["messages"]:
            if x["role"] == "assistant":
                texts.append(x["content"])
enc = tok(texts).input_ids
for ids in enc:
    counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=49152)
print("answers", len(texts), "tokens", int(counts.sum()), f"{time.time()-t0:.0f}s")
torch.save(counts, "runs/s23/regen-answer-counts.pt")
f = safe_open('heads/smollm2-135m-instruct-v6/model.safetensors', 'pt'); t2d = f.get_tensor('t2d')
order = counts.argsort(descending=True)
sets = {"shipped 8192": t2d}
for n in (8192, 12288, 16384, 24576):
    m = torch.zeros(49152, dtype=torch.bool); m[order[:n]] = True; sets[f"regen top {n}"] = m
for d in ("runs/s21/mt80-regen-T0", "runs/s21/mt80-regen-T1"):
    ids = []
    for sh in sorted(glob.glob(d + "/shard-*.jsonl.gz")):
        for line in gzip.open(sh, "rt"):
            for x in json.loads(line)["messages"]:
                if x["role"] == "assistant":
                    ids += tok(x["content"]).input_ids[:128]
    ids = torch.tensor(ids)
    print(d, len(ids), {k: round(v[ids].float().mean().item(), 4) for k, v in sets.items()})
