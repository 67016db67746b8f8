"""Does an EAGLE-1 head draft better past depth 1 when it is also trained on its own predicted features? An A/B.

Drafting feeds the head its own predicted feature from depth 2 on, but an EAGLE-1 head is trained on the target's
true features only, and its top-1 drops with depth (docs/training.md: v11 0.711 / 0.616 / 0.583 held-out at depths
1 / 2 / 3). EAGLE-3's training-time test fixes that mismatch inside another objective; HASS (arXiv 2408.15766,
"harmonized context alignment") does it inside EAGLE's. Arm A is today's recipe (`train`'s `batch_loss`, steps 1).
Arm C is the same loss over a K-step unroll (`batch_loss(..., steps=K)`, `EagleHead.unroll`: step k regresses the
same next feature from a chain that began k - 1 positions earlier, step k weighted 0.8^(k-1)).

The protocol of docs/bench/issue10/fused-input/probe.py's INIT mode, so that its arm A is this one's too: both arms
start from HEAD (v11), train in lockstep on the same batches of the regenerated corpus's train split (the trainer's
split, seed 0, the first N conversations; one bf16 target forward feeds both), lr LR (1e-4) with 20 warm-up steps,
SmoothL1 + 0.1 CE, feature noise 0.1, clip 0.5, batches <= 4,096 tokens, the head's own draft vocabulary. Scored
at depths 1-3 (the head fed its own predictions) on the trainer's 40 held-out conversations and on the target's
own answers to the 80 MT-bench first turns at T = 0 (runs/s21/mt80-regen-T0, docs/bench/issue10/v9/texts.sh).

    [K=3] [LR=1e-4] [INIT=heads/smollm2-135m-instruct] python docs/bench/issue10/unroll/probe.py 800 0 > out.txt
"""
import contextlib
import json
import os
import sys
import time

import torch

from eaglespec.data import make_batches, split
from eaglespec.features import forward_autocast, load_examples, pad_batch, target_features
from eaglespec.head import load_head
from eaglespec.loading import load_target, load_tokenizer
from eaglespec.train import batch_loss, clip_gradients, eval_metrics, evaluate, lr_at

n_train = int(sys.argv[1]) if len(sys.argv) > 1 else 800
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
K = int(os.environ.get("K", "3"))
LR, WARMUP = float(os.environ.get("LR", "1e-4")), 20
INIT = os.environ.get("INIT", "heads/smollm2-135m-instruct")
EVAL = 40
torch.manual_seed(seed)

target, folder = load_target(None)
tok = load_tokenizer(folder)
examples, _ = load_examples(tok, "corpora/smollm2-135m-instruct/regen", None, 1024)
tr, he = split([e.key for e in examples], 0, 0.05)
wanted = set(list(dict.fromkeys(examples[i].key for i in tr))[:n_train])
train_ex = [examples[i] for i in tr if examples[i].key in wanted]
mt, _ = load_examples(tok, "runs/s21/mt80-regen-T0", None, 1024)
eval_sets = {"held-out": [examples[i] for i in he[:EVAL]], "mt-bench T=0 answers": mt}
heads = {"A": load_head(INIT, target.args), "C": load_head(INIT, target.args)}
draft_ids = heads["A"].draft_ids
vocab = (target.lm_head.weight[draft_ids].detach(), draft_ids)
full_w = target.lm_head.weight.detach()
ac = forward_autocast(target, "bf16")


def batch(exs, b):
    ids = pad_batch([exs[i].ids for i in b])
    amask = pad_batch([exs[i].mask for i in b], False, torch.bool)
    with torch.no_grad(), ac():
        feats = target_features(target, ids).float()
    return ids, amask, feats


train_b = make_batches([len(e.ids) for e in train_ex], 4096, seed, 0)
total = len(train_b)
opts = {k: torch.optim.AdamW(hd.parameters(), lr=LR, weight_decay=0.0) for k, hd in heads.items()}
gens = {k: torch.Generator().manual_seed(seed) for k in heads}
steps = {"A": 1, "C": K}
print(f"train {len(train_ex)} records, {sum(len(e.ids) for e in train_ex)} tokens, {total} steps; K={K} lr={LR}",
      flush=True)
t0 = time.time()
stats = {k: [0, 0] for k in heads}
secs = {k: 0.0 for k in heads}
for step, b in enumerate(train_b):
    ids, amask, feats = batch(train_ex, b)
    for k, hd in heads.items():
        s0 = time.time()
        for g in opts[k].param_groups:
            g["lr"] = lr_at(step, LR, WARMUP, total)
        loss, st = batch_loss(hd, target, ids, amask, feats, noise=0.1, weights=(1.0, 0.1), generator=gens[k],
                              autocast=contextlib.nullcontext, vocab=vocab, steps=steps[k])
        opts[k].zero_grad()
        loss.backward()
        clip_gradients(list(hd.parameters()), 0.5, "value")
        opts[k].step()
        stats[k][0] += st["top1"]
        stats[k][1] += st["n"]
        secs[k] += time.time() - s0
    if (step + 1) % 20 == 0 or step + 1 == total:
        print(f"step {step + 1}/{total} {time.time() - t0:.0f}s train top1 " +
              " ".join(f"{k} {v[0] / max(v[1], 1):.3f}" for k, v in stats.items()) +
              " head s/step " + " ".join(f"{k} {v / (step + 1):.2f}" for k, v in secs.items()), flush=True)
        stats = {k: [0, 0] for k in heads}


class Texts:
    """A text set as `train.evaluate` reads it: batches of indices -> (ids, mask, features)."""

    def __init__(self, exs):
        self.exs = exs

    def batch(self, b):
        return batch(self.exs, b)


def score(head, exs):
    """top-1 against the target's argmax at depths 1-3 over exs' assistant positions (`eaglespec evaluate`'s
    numbers: the positions too early for a k-step chain count as misses)."""
    batches = [list(range(i, min(i + 8, len(exs)))) for i in range(0, len(exs), 8)]
    sums = evaluate(head, target, Texts(exs), batches, (1.0, 0.1), contextlib.nullcontext, depth=3, vocab=vocab)
    m = eval_metrics(sums, 3)
    return [m["top1"], m["top1_depth2"], m["top1_depth3"]], m["tokens"]


arms = {"start": load_head(INIT, target.args), **heads}
for name, exs in eval_sets.items():
    res = {m: score(hd, exs) for m, hd in arms.items()}
    print(json.dumps({"text": name, "init": INIT, "K": K, "train_records": len(train_ex), "seed": seed, "steps": total,
                      "lr": LR, "wall_s": round(time.time() - t0),
                      **{m: {"top1_d1_d2_d3": r[0], "positions": r[1]} for m, r in res.items()}}), flush=True)
out = os.environ.get("SAVE")
if out:  # the C arm's head, for a live run (`bench --heads c=DIR`)
    heads["C"].save(out, {"note": f"v11 + {total} steps, unrolled K={K} (docs/bench/issue10/unroll/probe.py)"})
