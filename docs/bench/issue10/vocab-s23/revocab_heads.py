# Heads v6 and v8 with their draft vocabulary replaced by the N most frequent regenerated-answer tokens (counts from
# coverage.py); an EAGLE-1 head's weights do not depend on it, only d2t / t2d change. Written to runs/s23/heads/.
import json, os, shutil, torch
from safetensors.torch import load_file, save_file
counts = torch.load("runs/s23/regen-answer-counts.pt")
order = counts.argsort(descending=True)
for src, tag in (("heads/smollm2-135m-instruct-v6", "v6"), ("heads/smollm2-135m-instruct-v8", "v8")):
    sd = load_file(f"{src}/model.safetensors")
    cfg = json.load(open(f"{src}/config.json"))
    for n in (8192, 16384, 24576):
        ids = order[:n].sort().values
        out = f"runs/s23/heads/{tag}-vocab{n}"
        os.makedirs(out, exist_ok=True)
        d = dict(sd)
        d["d2t"] = (ids - torch.arange(n)).to(sd["d2t"].dtype)
        t2d = torch.zeros(49152, dtype=torch.bool); t2d[ids] = True
        d["t2d"] = t2d
        save_file(d, f"{out}/model.safetensors")
        c = dict(cfg)
        for k in ("draft_vocab_size",):
            if k in c: c[k] = n
        json.dump(c, open(f"{out}/config.json", "w"), indent=1)
        print(out, {k: v for k, v in c.items() if "vocab" in k})
