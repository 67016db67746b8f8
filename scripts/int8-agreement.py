"""How far the int8-activation default (EAGLESPEC_CPU_QUANT=int8) moves the default target from its exact
GGUF-block weights (EAGLESPEC_CPU_QUANT=1, bit for bit the fp32 model): on the first N conversations of a
regenerated store (text the target wrote), one prefill each through both, per position: whether the argmax
agrees, KL(exact || int8), and the largest logit difference.

    python scripts/int8-agreement.py [N]     (default 20; corpora/smollm2-135m-instruct/regen)
"""
import gzip
import json
import os
import sys

import torch

from eaglespec.engine import Engine

n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
models = {}
for mode in ("1", "int8"):
    os.environ["EAGLESPEC_CPU_QUANT"] = mode
    models[mode] = Engine.load(compile=False)
e = models["1"]
rows = []  # the store's shards: gzipped JSONL of {"messages": [...]}
with gzip.open("corpora/smollm2-135m-instruct/regen/shard-00000.jsonl.gz", "rt") as f:
    for line in f:
        rows.append(json.loads(line)["messages"])
        if len(rows) == n:
            break
agree = total = 0
kls, gaps = [], []
with torch.inference_mode():
    for msgs in rows:
        ids = e.tokenizer(e.tokenizer.apply_chat_template(msgs, tokenize=False)).input_ids[:1024]
        x = torch.tensor([ids])
        pos = torch.arange(len(ids))[None]
        la = models["1"].model(x, pos)[1][0].float()
        lb = models["int8"].model(x, pos)[1][0].float()
        agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
        total += len(ids)
        pa, pb = la.log_softmax(-1), lb.log_softmax(-1)
        kls.append((pa.exp() * (pa - pb)).sum(-1))
        gaps.append((la - lb).abs().amax(-1))
kl = torch.cat(kls)
gap = torch.cat(gaps)
print(f"{len(rows)} conversations, {total} positions: argmax agreement {agree / total:.4f}; "
      f"KL(exact || int8) mean {kl.mean():.2e}, p99 {kl.quantile(0.99):.2e}; "
      f"largest logit difference median {gap.median():.3f}, p99 {gap.quantile(0.99):.3f}")
