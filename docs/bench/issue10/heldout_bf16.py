"""Held-out top-1 of the shipped head (v5) on features computed in fp32 and under CPU bf16 autocast.

Run from the repository root: .venv/bin/python docs/bench/issue10/heldout_bf16.py OUT.json (about 11 min on 2 cores).
The fp32 arm is `eaglespec evaluate --head heads/smollm2-135m-instruct-v6 --data corpora/smollm2-135m-instruct/regen
--max-len 1024 --eval-conversations 40`; the other computes the same conversations' features under autocast."""
import contextlib, json, sys, time, torch
from eaglespec.features import load_examples, target_features, autocast_for
from eaglespec.loading import load_target, load_tokenizer
from eaglespec.data import make_batches, split
from eaglespec.head import load_head
from eaglespec.train import InLoopSource, evaluate, eval_metrics
torch.set_num_threads(2)
target, folder = load_target(None)
tok = load_tokenizer(folder)
ex, _ = load_examples(tok, "corpora/smollm2-135m-instruct/regen", None, 1024, log=lambda *a: None)
_, held = split([e.key for e in ex], 0, 0.05)
rows = held[:40]
head = load_head("heads/smollm2-135m-instruct-v6", target.args).eval()
vocab = (target.lm_head.weight[head.draft_ids].contiguous(), head.draft_ids)
class Bf16Source(InLoopSource):
    def batch(self, idx):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ids, amask, f = super().batch(idx)
        return ids, amask, f.float()
res = {}
for name, cls in (("fp32", InLoopSource), ("bf16-autocast", Bf16Source)):
    src = cls([ex[i] for i in rows], target)
    batches = make_batches(src.lengths, max(max(src.lengths), 8192 // 4), 0, 999_999)
    t = time.perf_counter()
    sums = evaluate(head, target, src, batches, (1.0, 0.1), contextlib.nullcontext, vocab=vocab)
    res[name] = {k: round(v, 4) for k, v in eval_metrics(sums).items() if isinstance(v, float)}
    print(name, round(time.perf_counter() - t), "s", res[name], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
