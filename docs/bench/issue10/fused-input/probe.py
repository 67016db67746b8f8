"""Does an EAGLE-1 head draft better when it also reads the target's lower layers? A from-scratch A/B.

EAGLE-1 heads read the target's last feature f_t (and the next token) and regress f_{t+1} through the target's
own LM head. EAGLE-3 heads fuse three layers (low, middle, high) but lose the regression and the borrowed LM head,
and here they lag EAGLE-1 at depth 1 at every data size we could train (docs/training.md). This asks the
question the EAGLE-3 runs could not separate: do the lower layers carry what the last feature lacks, when the head
keeps EAGLE-1's objective? Arm A is today's head. Arm B is the same head whose fc also reads the hidden states
entering layers 2, 15 and 27 (RMS-normed, no weights), at depth 1 only: a drafted token has no target layers, so
from depth 2 on B is fed zeros there, and in training a random 30 % of positions see zeros too (the rows the
draft's depth 2+ would be).

Both arms train in lockstep on the same batches (one target forward feeds both), the same initial weights where
they share a shape, the recipe of docs/training.md's from-scratch A/Bs (batch <= 4,096 tokens, lr 6e-4, 12
warm-up steps, SmoothL1 + 0.1 CE, feature noise 0.1, clip 0.5, bf16 target forward), v11's draft vocabulary.
Scored on 40 regenerated conversations that neither trained on: top-1 against the target's argmax at depths 1-3
(the head fed its own predictions; EagleHead.unroll), B with and without its extra input at depth 1.

    python docs/bench/issue10/fused-input/probe.py [TRAIN_CONVERSATIONS] [SEED] > out.txt

With INIT=HEAD both arms start from that head instead (B: its fc with zero columns for the new input, so B starts
drafting exactly as A), train on the regenerated corpus's train split (the trainer's split, seed 0) at LR (default
1e-4, 20 warm-up steps: v11's fine-tune), and are scored on the trainer's 40 held-out conversations and on the
target's own answers to the 80 MT-bench first turns at T = 0 (runs/s21/mt80-regen-T0, docs/bench/issue10/v9/texts.sh):

    INIT=heads/smollm2-135m-instruct python docs/bench/issue10/fused-input/probe.py 800 0 > out.txt
"""
import os
import json
import random
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from eaglespec.features import forward_autocast, load_examples, pad_batch, target_features
from eaglespec.head import load_head, random_head
from eaglespec.loading import load_target, load_tokenizer
from eaglespec.train import CE_CHUNK, SoftCrossEntropy, _logits, clip_gradients, lr_at, shift_inputs

n_train = int(sys.argv[1]) if len(sys.argv) > 1 else 500
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
AUX = (2, 15, 27)
EVAL = 40
torch.manual_seed(seed)

target, folder = load_target(None)
tok = load_tokenizer(folder)
h = target.args.hidden_size
INIT = os.environ.get("INIT")
LR, WARMUP = (6e-4, 12) if INIT is None else (float(os.environ.get("LR", "1e-4")), 20)
if INIT is None:
    examples, _ = load_examples(tok, "corpora/smollm2-135m-instruct/regen", n_train + EVAL, 1024)
    keys = list(dict.fromkeys(e.key for e in examples))
    held = set(keys[-EVAL:])  # the last 40 conversations, all their records: no conversation on both sides
    train_ex, eval_ex = [e for e in examples if e.key not in held], [e for e in examples if e.key in held]
    eval_sets = {"held-out": eval_ex}
else:
    from eaglespec.data import split
    examples, _ = load_examples(tok, "corpora/smollm2-135m-instruct/regen", None, 1024)
    tr, he = split([e.key for e in examples], 0, 0.05)
    train_keys = list(dict.fromkeys(examples[i].key for i in tr))[:n_train]
    wanted = set(train_keys)
    train_ex = [examples[i] for i in tr if examples[i].key in wanted]
    eval_ex = [examples[i] for i in he[:EVAL]]  # as `eaglespec evaluate --eval-conversations 40`
    mt, _ = load_examples(tok, "runs/s21/mt80-regen-T0", None, 1024)
    eval_sets = {"held-out": eval_ex, "mt-bench T=0 answers": mt}
draft_ids = load_head(INIT or "heads/smollm2-135m-instruct", target.args).draft_ids
w_draft = target.lm_head.weight[draft_ids].detach()
full_w = target.lm_head.weight.detach()
ac = forward_autocast(target, "bf16")


class FusedFC(nn.Module):
    """fc over cat(embed, f, aux): 2H + 3H -> H; a 2H input (a drafted token: no target layers) gets zeros."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.lin = nn.Linear(5 * h, h, bias=base.bias is not None)
        with torch.no_grad():  # the shared columns start as arm A's, the new ones at zero: B starts as A
            self.lin.weight.zero_()
            self.lin.weight[:, :2 * h] = base.weight
            if base.bias is not None:
                self.lin.bias.copy_(base.bias)

    def forward(self, x):
        if x.shape[-1] == 2 * h:
            x = torch.cat([x, x.new_zeros(*x.shape[:-1], 3 * h)], -1)
        return self.lin(x)


def aux_in(feats, drop: float = 0.0, gen=None):
    """cat(f, rmsnorm(each aux layer)), with a share `drop` of positions' aux zeroed."""
    f, aux = feats[..., :h], feats[..., h:].reshape(*feats.shape[:-1], 3, h)
    aux = (aux * torch.rsqrt(aux.pow(2).mean(-1, keepdim=True) + 1e-6)).flatten(-2)
    if drop:
        keep = (torch.rand(feats.shape[:-1], generator=gen) >= drop).to(aux.dtype)[..., None]
        aux = aux * keep
    return torch.cat([f, aux], -1)


head_a = random_head(target.args, seed=seed, draft_vocab=draft_ids) if INIT is None else load_head(INIT, target.args)
head_b = random_head(target.args, seed=seed, draft_vocab=draft_ids)
head_b.load_state_dict(head_a.state_dict())
head_b.fc = FusedFC(head_a.fc)


def batches_of(exs, budget=4096, shuffle=True):
    if INIT is not None and shuffle:  # the trainer's batches (sorted by length within pools: less padding)
        from eaglespec.data import make_batches
        return make_batches([len(e.ids) for e in exs], budget, seed, 0)
    idx = list(range(len(exs)))
    if shuffle:
        random.Random(seed).shuffle(idx)
    out, cur, longest = [], [], 0
    for i in idx:
        n = len(exs[i].ids)
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return out + ([cur] if cur else [])


_eval_cache = {}


def batch(exs, b):
    key = (id(exs), tuple(b))
    evaluating = exs is not train_ex
    if evaluating and key in _eval_cache:
        return _eval_cache[key]
    ids = pad_batch([exs[i].ids for i in b])
    amask = pad_batch([exs[i].mask for i in b], False, torch.bool)
    with torch.no_grad(), ac():
        feats = target_features(target, ids, AUX).float()
    if evaluating:
        _eval_cache[key] = ids, amask, feats
    return ids, amask, feats


def loss_of(head, ids, amask, feats_in, final, gen):
    tok_in, counted, tgt = shift_inputs(ids, amask, final)
    noise = (2 * torch.rand(feats_in[..., :h].shape, generator=gen) - 1) * 0.1
    x = torch.cat([feats_in[..., :h] + noise, feats_in[..., h:]], -1)
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        emb = target.embed_tokens(tok_in)
    pred = head(emb, x, pos)
    sel = counted.bool()
    p, t = pred[sel].float(), tgt[sel].float()
    fl = F.smooth_l1_loss(p, t, reduction="none").mean(-1).mean()
    ce, hits = SoftCrossEntropy.apply(p, t, w_draft, draft_ids)
    return fl + 0.1 * ce, int(hits[0]), int(sel.sum())


# EagleHead.forward concatenates (embeds, features): arm B's features are (f, aux), so its fc sees 5H
train_b = batches_of(train_ex)
total = len(train_b)
opts = {k: torch.optim.AdamW(hd.parameters(), lr=LR, weight_decay=0.0) for k, hd in (("A", head_a), ("B", head_b))}
gens = {"A": torch.Generator().manual_seed(seed), "B": torch.Generator().manual_seed(seed)}
drop_gen = torch.Generator().manual_seed(seed + 1)
print(f"train {len(train_ex)} records, {sum(len(e.ids) for e in train_ex)} tokens, {total} steps; "
      f"eval {len(eval_ex)} records", flush=True)
t0 = time.time()
stats = {"A": [0, 0], "B": [0, 0]}
for step, b in enumerate(train_b):
    ids, amask, feats = batch(train_ex, b)
    final = feats[..., :h]
    for k, hd in (("A", head_a), ("B", head_b)):
        lr = lr_at(step, LR, WARMUP, total)
        for g in opts[k].param_groups:
            g["lr"] = lr
        x = final if k == "A" else aux_in(feats, 0.3, drop_gen)
        loss, hit, n = loss_of(hd, ids, amask, x, final, gens[k])
        opts[k].zero_grad()
        loss.backward()
        clip_gradients(list(hd.parameters()), 0.5, "value")
        opts[k].step()
        stats[k][0] += hit
        stats[k][1] += n
    if (step + 1) % 20 == 0 or step + 1 == total:
        print(f"step {step + 1}/{total} {time.time() - t0:.0f}s train top1 A {stats['A'][0] / stats['A'][1]:.3f} "
              f"B {stats['B'][0] / stats['B'][1]:.3f}", flush=True)
        stats = {"A": [0, 0], "B": [0, 0]}


@torch.no_grad()
def score(head, mode, exs):
    """top-1 at depths 1-3 over exs' assistant positions; mode: A, B (aux at depth 1), B0 (no aux)."""
    head.eval()
    hits, n = torch.zeros(3), 0
    for b in batches_of(exs, shuffle=False):
        ids, amask, feats = batch(exs, b)
        final = feats[..., :h]
        tok_in, counted, tgt = shift_inputs(ids, amask, final)
        x = final if mode == "A" else aux_in(feats) if mode == "B" else torch.cat([final, final.new_zeros(*final.shape[:-1], 3 * h)], -1)
        outs = head.unroll(target.embed_tokens(tok_in), x, 3)
        sel = counted.bool()
        best = torch.cat([_logits(r, full_w).argmax(-1) for r in tgt[sel].split(CE_CHUNK)])
        pos = torch.arange(ids.shape[1])[None].expand_as(sel)[sel]
        n += int(sel.sum())
        for k in range(3):
            valid = pos >= k
            guess = draft_ids[torch.cat([_logits(r, w_draft).argmax(-1) for r in outs[k][sel][valid].split(CE_CHUNK)])]
            hits[k] += int((guess == best[valid]).sum())
    head.train()
    return [round(float(x) / n, 4) for x in hits], n


arms = (("A", head_a), ("B", head_b), ("B0", head_b))
if INIT is not None:  # the starting point, for scale (B starts as A)
    arms = (("start", load_head(INIT, target.args)),) + arms
for name, exs in eval_sets.items():
    res = {m: score(hd, m if m != "start" else "A", exs) for m, hd in arms}
    print(json.dumps({"text": name, "init": INIT, "train_records": len(train_ex), "seed": seed, "steps": total,
                      "lr": LR, "wall_s": round(time.time() - t0),
                      **{m: {"top1_d1_d2_d3": r[0], "positions": r[1]} for m, r in res.items()}}), flush=True)
