"""`eaglespec train`: train an EAGLE draft head on a frozen target (EAGLE-1 recipe).

Position t of a sequence feeds the head (embed(x_{t+1}), f_t) and asks for f_{t+1}; it counts in the
loss iff x_{t+1}, the token it is fed, is the assistant's (so the first position trained on a reply
is the one that drafts its second token, as at inference after the prompt). Loss per micro-batch:
  feature_weight * SmoothL1(pred, f_{t+1}) (mean over hidden dims)
  + ce_weight * cross-entropy(softmax(lm_head(f_{t+1})), log_softmax(lm_head(pred))),
both averaged over the counted positions. Input features get uniform noise U(-a, a), a = --noise;
unlike the official code we do not scale it by 512 / padded length, which makes the noise depend on
how sequences happen to be batched (a 64-token batch would get 8x the noise).

With `--arch eagle3` the head is EAGLE-3's (head.Eagle3Head): fed the hidden states entering three
target layers, trained by training-time test: unrolled `--ttt-steps` K steps on its own outputs
(Eagle3Head.unroll, the attention mask drafting sees), loss = sum_i 0.8^i CE_i, CE_i the
cross-entropy at step i to the target's distribution over the draft vocabulary, averaged over the
positions step i is scored at (its fed token the assistant's, the target's best token draftable).
No feature regression and no input noise, as in the official EAGLE-3 trainer.

With `--ttt-steps K` > 1 an EAGLE-1 head is trained on its own predictions too (EagleHead.unroll, HASS's
"harmonized context alignment", arXiv 2408.15766): the loss above at each of K unrolled steps, step k's
prediction at t regressing the same f_{t+1} from a chain that began k - 1 positions earlier, weighted
0.8^(k-1) as EAGLE-3's steps are.

OUT/head (latest head, `--head OUT/head`), OUT/checkpoint/ (head + optimizer, position and RNG
state for --resume), OUT/metrics.jsonl (held-out evaluations), OUT/train_log.jsonl (every step),
OUT/card.md (at the end). Under `torchrun --nproc_per_node N` it trains data-parallel; step s then
uses the same micro-batches as one process with --grad-accum N would (see `rank_batches`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .data import make_batches, split
from .features import (FeatureStore, add_arch_args, add_autocast_arg, add_data_args, add_model_args, autocast_for,
                       forward_autocast, check_positive, load_examples, load_model, model_fingerprint, pad_batch, parse_aux_layers, target_features)
from .head import EagleHead, grown_head, load_head, random_eagle3_head, random_head

EVAL_DEPTHS = 4
DEFAULT_WARMUP = 100
CE_CHUNK = 512  # rows of logits alive at once (chunk x vocab floats, a few of them)
# An EAGLE-3 step's log-probabilities (rows x draft vocabulary) are kept for backward up to this many
# elements (512 MiB in fp32) instead of being recomputed chunk by chunk.
CE_KEEP_MAX = 1 << 27


def add_cli(sub) -> None:
    p = sub.add_parser("train", help="train an EAGLE draft head for a target model")
    add_model_args(p)
    d = add_data_args(p)
    d.add_argument("--features-dir", default=None,
                   help="features precomputed by `eaglespec features` (default: run the target in the loop)")
    e = p.add_argument_group("evaluation")
    e.add_argument("--held-out", type=float, default=0.05, help="held-out fraction (split by a hash of each chat)")
    e.add_argument("--eval-conversations", type=int, default=32,
                   help="held-out conversations evaluated (the LM head makes evaluation costly on CPU)")
    o = p.add_argument_group("objective")
    o.add_argument("--feature-weight", type=float, default=1.0, help="weight of the SmoothL1 feature loss")
    o.add_argument("--ce-weight", type=float, default=0.1, help="weight of the cross-entropy to the target's distribution")
    o.add_argument("--loss-weights", default=None, metavar="F,C", help="shorthand for --feature-weight F --ce-weight C (default: unset)")
    add_arch_args(o)
    o.add_argument("--ttt-steps", type=int, default=None, metavar="K",
                   help="unroll the head K steps on its own outputs (training-time test); step i weighs 0.8**i. "
                        "eagle3: its objective (default 7); eagle: the EAGLE-1 loss at every step, as the head "
                        "drafts from depth 2 on (HASS; default 1: true features only)")
    o.add_argument("--eagle3-output-init", choices=("random", "target"), default="random",
                   help="eagle3: start the head's own norm and lm_head at random (the official recipe) or as a copy "
                        "of the target's final norm and its LM-head rows for the draft vocabulary, so that the "
                        "first steps need not learn an output layer from scratch (default: random)")
    o.add_argument("--eagle3-feature-weight", type=float, default=0.0, metavar="W",
                   help="eagle3: add W x SmoothL1 between the head's normed output at each unrolled step and the "
                        "target's next feature, EAGLE-1's dense signal, to the cross-entropy (not in the official "
                        "recipe; default 0 = official)")
    o.add_argument("--head-layers", type=int, default=None, metavar="N",
                   help="eagle: decoder layers in the head (default: 1, as the released heads; with --init-head, "
                        "its own). A head given to --init-head with fewer layers grows to N: the new layers start "
                        "as the identity (zero output projections), so training starts from what it drafts")
    o.add_argument("--noise", type=float, default=0.1, help="uniform noise amplitude on input features (eagle only)")
    o.add_argument("--no-fc-bias", action="store_true", help="fc without bias (as the LLaMA3 heads; vLLM drops it)")
    o.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="draft from the N most frequent assistant tokens of the training data (EAGLE-3's d2t); "
                        "cheaper training and drafting, same output (0 = the whole vocabulary)")
    t = p.add_argument_group("optimisation")
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--grown-lr", type=float, default=None, metavar="LR",
                   help="the peak learning rate of the layers --head-layers adds to an --init-head head, on the same "
                        "schedule (default: --lr). Why: a fine-tune's low --lr leaves new layers near the identity")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--warmup-steps", type=int, default=None,
                   help=f"linear warm-up, then linear decay to 0 (default: {DEFAULT_WARMUP}, or a tenth of the run "
                        "when the run is too short to reach the peak after it)")
    t.add_argument("--clip", type=float, default=0.5, help="gradient clipping threshold (0 = off)")
    t.add_argument("--clip-mode", default="value", choices=["value", "norm"],
                   help="clip each gradient element (official EAGLE) or the global norm")
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimiser step (per process)")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many optimiser steps (default: all epochs)")
    t.add_argument("--init-head", default=None, metavar="HEAD",
                   help="start from this head's weights (fine-tuning, e.g. the shipped head on regenerated answers); "
                        "it keeps its own draft vocabulary unless --draft-vocab N chooses one again from this run's "
                        "data (EAGLE-1 heads only) (default: a fresh head)")
    r = p.add_argument_group("run")
    r.add_argument("--out", required=True, help="output folder")
    r.add_argument("--resume", action="store_true", help="continue the run in --out where it stopped")
    r.add_argument("--replan", action="store_true",
                   help="with --resume: accept a changed plan (--epochs, --max-steps, --lr, --warmup-steps); the "
                        "learning rate follows the new schedule from the current step and OUT/head is overwritten")
    r.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps (and at each epoch end)")
    r.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (and at each epoch end)")
    r.add_argument("--seed", type=int, default=0, help="the head's initial weights, batch order and noise")
    e.add_argument("--split-seed", type=int, default=None, metavar="S",
                   help="seed of the held-out split (default: --seed); fix it to train with other seeds and still "
                        "score every run on the same held-out conversations")
    r.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: die like a killed run
    # tests: the process sends itself SIGINT after this step, as a Ctrl-C would arrive
    r.add_argument("--signal-after", type=int, default=None, help=argparse.SUPPRESS)
    add_autocast_arg(r, "the training steps (evaluation stays fp32 on a CPU, so held-out numbers compare)")
    p.set_defaults(func=run_train, parser=p)
    add_evaluate_cli(sub)


def add_evaluate_cli(sub) -> None:
    p = sub.add_parser("evaluate", help="held-out accuracy of a head (top-1 at draft depths 1-4) on any data")
    add_model_args(p)
    p.add_argument("--head", required=True, help="the head folder (a training run's OUT/head)")
    d = add_data_args(p)
    d.add_argument("--features-dir", default=None, help="features from `eaglespec features` (default: --data, "
                                                        "the target run in the loop)")
    e = p.add_argument_group("evaluation")
    e.add_argument("--held-out", type=float, default=0.05,
                   help="the held-out fraction the split was made with (a hash of each chat, as in train)")
    e.add_argument("--eval-conversations", type=int, default=40, help="held-out conversations evaluated")
    e.add_argument("--seed", type=int, default=0, help="the split's seed (train's --split-seed, else its --seed)")
    e.add_argument("--ttt-steps", type=int, default=7, metavar="K", help="eagle3 heads: the loss's unroll depth")
    e.add_argument("--answer-tokens", type=int, default=None, metavar="N",
                   help="score only the first N tokens of each assistant answer (a benchmark of N new tokens sees "
                        "those; long answers' repetitive tails are easier) (default: every token)")
    e.add_argument("--json", default=None, metavar="PATH", help="also write the metrics to PATH (default: print only)")
    p.set_defaults(func=run_evaluate, parser=p)


def command_line(args, world: int) -> str:
    """The command as it would be typed, rebuilt from the parsed flags (main() may get argv from a caller)."""
    parts = ["eaglespec", "train"] if world == 1 else ["torchrun", "--nproc_per_node", str(world), "-m",
                                                       "eaglespec.cli", "train"]
    for action in args.parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in ("help", "stop_after", "signal_after") or value == action.default:
            continue
        parts += [action.option_strings[-1]] if value is True else [action.option_strings[-1], str(value)]
    return shlex.join(parts)


# ---- the objective ------------------------------------------------------------------------------------

def _logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.to(weight.dtype) @ weight.T).float()


def soft_ce(pred, target, weight, want_grad: bool = True, draft_ids=None, full_weight=None):
    """mean over rows of -sum_v p(v) log q(v), q = softmax(pred W^T), p = softmax(target W^T), W frozen.

    W holds the LM head rows of the draft vocabulary (`draft_ids`; None: the whole vocabulary), so p is
    the target's distribution renormalised over it (as EAGLE-3). Walks the rows in chunks, so the rows x
    vocab logits never exist all at once, and forms d loss / d pred on the way (no recomputation in
    backward). Returns the loss, top-1/top-3 hits of q's ranking against the target's argmax (over the
    whole vocabulary when `full_weight` is given, else over W's), that argmax, and the gradient."""
    n = pred.shape[0]
    loss = torch.zeros((), dtype=torch.float32, device=pred.device)
    hits = torch.zeros(2, dtype=torch.long, device=pred.device)
    grad = torch.empty(pred.shape, dtype=torch.float32, device=pred.device) if want_grad else None
    best = torch.empty(n, dtype=torch.long, device=pred.device)
    k = min(3, weight.shape[0])
    to_target = (lambda i: i) if draft_ids is None else (lambda i: draft_ids[i])
    for s in range(0, n, CE_CHUNK):
        zq, zp = _logits(pred[s:s + CE_CHUNK], weight), _logits(target[s:s + CE_CHUNK], weight)
        logq, p = torch.log_softmax(zq, -1), torch.softmax(zp, -1)
        loss -= (p * logq).sum()
        if full_weight is not None:
            best[s:s + CE_CHUNK] = _logits(target[s:s + CE_CHUNK], full_weight).argmax(-1)
        else:
            best[s:s + CE_CHUNK] = to_target(zp.argmax(-1))
        top = to_target(zq.topk(k, -1).indices)
        hits[0] += (top[:, 0] == best[s:s + CE_CHUNK]).sum()
        hits[1] += (top == best[s:s + CE_CHUNK, None]).any(-1).sum()
        if want_grad:  # d/dz of -sum p log softmax(z) is softmax(z) - p
            grad[s:s + CE_CHUNK] = _logits(logq.exp_() - p, weight.T)
    n = max(n, 1)
    return loss / n, hits, best, (grad / n if want_grad else None)


@torch.no_grad()
def expected_acceptance(pred, target, weight, draft_ids=None, full_weight=None) -> torch.Tensor:
    """Sums over rows of how often the target accepts the head's first draft at T = 1 (depth-1 acceptance,
    which top-1 does not show: a head can rank better and still spread q worse), as three numbers:
    - sum_v min(p(v), q(v)): a token sampled from the draft's q, accepted by rejection sampling (the rule of
      engines that sample their drafts, such as vLLM's);
    - p(top-1 of q) and p(top-3 of q): deterministic candidates, accepted as `verify` does (child x with
      probability p(x), then p renormalised without it), so k candidates are accepted with their total mass.
    p is the target's distribution over its whole vocabulary (`full_weight`), q is zero outside the draft
    vocabulary."""
    full = weight if full_weight is None else full_weight
    total = torch.zeros(3, dtype=torch.float64, device=pred.device)
    k = min(3, weight.shape[0])
    for s in range(0, pred.shape[0], CE_CHUNK):
        zq = _logits(pred[s:s + CE_CHUNK], weight)
        q = torch.softmax(zq, -1)
        p = torch.softmax(_logits(target[s:s + CE_CHUNK], full), -1)
        if draft_ids is not None and full_weight is not None:
            p = p[:, draft_ids]
        top = p.gather(1, zq.topk(k, -1).indices)
        total += torch.stack((torch.minimum(p, q).sum(), top[:, 0].sum(), top.sum())).double()
    return total


class SoftCrossEntropy(torch.autograd.Function):
    """`soft_ce` as an autograd function of `pred`; also returns the (non-differentiable) hits."""

    @staticmethod
    def forward(ctx, pred, target, weight, draft_ids):
        loss, hits, _, grad = soft_ce(pred, target, weight, draft_ids=draft_ids)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(hits)
        return loss, hits

    @staticmethod
    def backward(ctx, grad_loss, _grad_hits):
        (grad,) = ctx.saved_tensors
        return grad_loss * grad, None, None, None


TTT_DECAY = 0.8  # step i of the unroll weighs 0.8**i (official EAGLE-3 trainer, eagle/traineagle3/main.py)


def shift_inputs(ids, amask, feats):
    """Head inputs and targets from a right-padded batch: tokens and targets shifted left by one."""
    tok_in = F.pad(ids[:, 1:], (0, 1))
    counted = F.pad(amask[:, 1:], (0, 1))          # position t counts iff x_{t+1} is the assistant's
    target = F.pad(feats[:, 1:], (0, 0, 0, 1))
    return tok_in, counted, target


def batch_loss(head, target_model, ids, amask, feats, *, noise: float, weights: tuple[float, float],
               generator: torch.Generator | None, autocast, vocab=None, steps: int = 1) -> tuple[torch.Tensor, dict]:
    """Loss of one micro-batch; `head` may be the DDP wrapper; `vocab`: (draft LM head rows, their ids)
    or None for the whole vocabulary. Returns (loss, float statistics: the loss optimised, then the feature
    loss, cross-entropy and hits of the first step); top-1 is within the draft vocabulary.

    steps > 1: the head is also trained on its own predicted features, as it drafts from depth 2 on
    (`EagleHead.unroll`; HASS, arXiv 2408.15766): step k's prediction at p, from a chain that began k - 1
    positions earlier on the true feature, regresses the same target f_{p+1}; step k weighs
    TTT_DECAY**(k-1). Why: a head trained on true features only meets its own, noisier ones at every
    depth past the first, and its top-1 drops there (docs/training.md)."""
    tok_in, counted, target = shift_inputs(ids, amask, feats)
    feat_in = feats.float()
    if noise:
        u = torch.rand(feat_in.shape, generator=generator, device="cpu").to(feat_in.device)
        feat_in = feat_in + (2 * u - 1) * noise
    positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        embeds = target_model.embed_tokens(tok_in)
    with autocast():
        outs = head(embeds, feat_in, positions, ttt_steps=steps) if steps > 1 else [head(embeds, feat_in, positions)]
    sel = counted.bool()
    n = int(sel.sum())
    if n == 0:  # nothing to learn here; keep every parameter in the graph for DDP
        return sum(o.sum() for o in outs) * 0.0, {"loss": 0.0, "feature_loss": 0.0, "ce_loss": 0.0, "top1": 0,
                                                  "top3": 0, "n": 0}
    pos, t_all = positions[sel], target[sel].float()
    loss = 0.0
    for k, out in enumerate(outs):
        valid = pos >= k  # a chain of k + 1 steps needs a start at p - k >= 0
        p, t = out[sel][valid].float(), t_all[valid]
        feature_loss = F.smooth_l1_loss(p, t, reduction="none").mean(-1).mean()
        if weights[1]:
            w, draft_ids = vocab or (target_model.lm_head.weight, None)
            ce_loss, hits = SoftCrossEntropy.apply(p, t, w, draft_ids)
        else:  # the LM head passes are most of a step's cost on CPU: skip them when unused
            ce_loss, hits = torch.zeros(()), torch.full((2,), -1)
        step_loss = weights[0] * feature_loss + weights[1] * ce_loss
        loss = loss + TTT_DECAY ** k * step_loss
        if k == 0:
            stats = {"feature_loss": feature_loss.item(), "ce_loss": ce_loss.item(), "top1": int(hits[0]),
                     "top3": int(hits[1]), "n": n}
    return loss, {"loss": loss.item(), **stats}


# ---- EAGLE-3: training-time test -----------------------------------------------------------------------

def ttt_targets(target_model, ids, amask, feats, vocab, full: bool = False, memo=None):
    """What every unrolled step is scored against, computed once per batch (the steps only shift it).

    Rows are the positions s whose token the head is fed somewhere in the chain and which count
    (assistant tokens, s >= 1). For each: p = the target's distribution at s over the draft
    vocabulary (the next token's, x_{s+1}), the target's argmax over its whole vocabulary, and
    whether that argmax is in the draft vocabulary: the official trainer leaves positions out of
    the loss whose best token the head cannot draft. Returns (row index per position (B, T), -1 =
    not a row; p (R, Vd); best (R,) target ids; draftable (R,) bool).

    memo: (cache dict, one key per sequence) from the source's `memo`, to keep `best` across epochs."""
    h = target_model.args.hidden_size
    w, draft_ids = vocab or (target_model.lm_head.weight, None)
    counted = amask.clone()
    counted[:, 0] = False
    rows = torch.full(amask.shape, -1, dtype=torch.long, device=amask.device)
    rows[counted] = torch.arange(int(counted.sum()), device=amask.device)
    final = feats[..., :h][counted].float()
    with torch.no_grad():
        p = torch.cat([torch.softmax(_logits(final[c:c + CE_CHUNK], w), -1) for c in range(0, final.shape[0], CE_CHUNK)]) \
            if final.shape[0] else final.new_zeros(0, w.shape[0])
        if draft_ids is None:
            best = p.argmax(-1) if p.shape[0] else torch.zeros(0, dtype=torch.long, device=p.device)
            draftable = torch.ones_like(best, dtype=torch.bool)
        else:
            # in the dtype of the draft rows: bf16 under --autocast bf16, where this full-vocabulary pass
            # (4,096 rows x 49,152 on the default target) runs ~3x faster than in fp32
            full_w = lm_head_weight(target_model, w.dtype)
            best = target_best(final, counted.sum(1).tolist(), full_w, memo)
            t2d = torch.zeros(full_w.shape[0], dtype=torch.bool, device=p.device)
            t2d[draft_ids] = True
            draftable = t2d[best]
    return rows, p, best, draftable


def lm_head_weight(target_model, dtype: torch.dtype) -> torch.Tensor:
    """The target's whole LM-head weight in `dtype`, cast once per model (it is frozen)."""
    w = target_model.lm_head.weight
    if w.dtype == dtype:
        return w
    casts = target_model.__dict__.setdefault("_eaglespec_lm_head_casts", {})
    if dtype not in casts:
        casts[dtype] = w.detach().to(dtype)
    return casts[dtype]


def target_best(final: torch.Tensor, per_seq: list[int], weight: torch.Tensor, memo=None) -> torch.Tensor:
    """The target's argmax over its whole vocabulary at each row of `final` (rows of consecutive
    sequences, `per_seq` each). It is a full-vocabulary LM-head pass, a sixth of an EAGLE-3 step on
    this CPU, and the same every epoch because the features are fixed: with memo = (cache, keys) it
    is computed once per sequence and kept (a long per row)."""
    def compute(x):
        return torch.cat([_logits(x[c:c + CE_CHUNK], weight).argmax(-1) for c in range(0, x.shape[0], CE_CHUNK)]) \
            if x.shape[0] else torch.zeros(0, dtype=torch.long, device=x.device)

    if memo is None:
        return compute(final)
    cache, keys = memo
    parts = final.split(per_seq)
    todo = [i for i, k in enumerate(keys) if k not in cache or cache[k].numel() != per_seq[i]]
    if todo:
        fresh = compute(torch.cat([parts[i] for i in todo])).split([per_seq[i] for i in todo])
        for i, b in zip(todo, fresh):
            cache[keys[i]] = b
    return torch.cat([cache[k].to(final.device) for k in keys])


def _step_ce(head, hidden, p):
    """sum over rows of -sum_v p(v) log q(v), q = softmax(head.lm_head(head.norm(hidden))); also the
    rows' top-3 draft ids. Checkpointed per chunk: the rows x draft-vocabulary logits of one chunk
    exist at a time, in backward too."""
    from torch.utils.checkpoint import checkpoint

    def chunk(hc, pc):
        logq = torch.log_softmax(head.draft_logits(hc).float(), -1)
        return -(pc * logq).sum(), logq.detach().topk(min(3, logq.shape[-1]), -1).indices

    total, tops = hidden.new_zeros((), dtype=torch.float32), []
    keep = hidden.shape[0] * p.shape[1] <= CE_KEEP_MAX if CE_KEEP_MAX is not None else False
    for c in range(0, hidden.shape[0], CE_CHUNK):
        if keep:  # small enough to keep every chunk's log-probabilities for backward: no recompute
            loss, top = chunk(hidden[c:c + CE_CHUNK], p[c:c + CE_CHUNK])
        else:
            loss, top = checkpoint(chunk, hidden[c:c + CE_CHUNK], p[c:c + CE_CHUNK], use_reentrant=False)
        total = total + loss
        tops.append(top)
    return total, (torch.cat(tops) if tops else hidden.new_zeros(0, 3, dtype=torch.long))


def ttt_losses(head, target_model, ids, amask, feats, steps: int, autocast, vocab=None, depth: int = 0, memo=None,
               feature_weight: float = 0.0):
    """The unrolled head's per-step cross-entropy to the target's distribution, for one batch.

    Step i at position t is fed x_{t+1+i} and drafts x_{t+2+i}: it is scored where s = t+1+i is a
    row of `ttt_targets`. Returns per step (mean loss over its scored rows or None, scored rows,
    top-1 hits, top-3 hits, rows in the loss, feature loss or None) for max(steps, depth) steps; hits count every row of s (accuracy is over
    the whole vocabulary: a best token outside the draft vocabulary is a miss), loss only the
    draftable ones (official). `head` may be a DDP wrapper of an Eagle3Head.

    feature_weight > 0 adds, to each trained step's mean, that weight times the SmoothL1 between
    head.norm(output) and the target's feature at s over every row: the dense regression target that
    EAGLE-1 learns from, tried because EAGLE-3 heads trained here lag EAGLE-1 at depth 1 on few tokens.
    The sixth item is that step's feature loss (None when the weight is 0)."""
    module = getattr(head, "module", head)
    h = target_model.args.hidden_size
    rows, p, best, draftable = ttt_targets(target_model, ids, amask, feats, vocab, memo=memo)
    draft_ids = None if vocab is None else vocab[1]
    tok_in = F.pad(ids[:, 1:], (0, 1))
    with torch.no_grad():
        embeds = target_model.embed_tokens(tok_in)
    n_steps = max(steps, depth)
    # the target's feature at each row, in ttt_targets' order: the feature term's regression targets
    final = feats[..., :h][rows >= 0].float() if feature_weight else None

    with autocast():
        outs = head(embeds, feats[..., h:].float(), ttt_steps=n_steps)
    results = []
    for i, out in enumerate(outs):
        r = F.pad(rows[:, 1 + i:], (0, 1 + i), value=-1)  # the row of s = t + 1 + i, at t
        sel = r >= 0
        idx = r[sel]
        keep = draftable[idx]
        # Only draftable rows can be hit (a draft is always in the draft vocabulary), so the kept
        # rows' top-3 from the loss pass give the hits of every row, with no second LM head pass.
        hidden, kept = out[sel][keep].float(), idx[keep]
        n_loss = int(keep.sum())
        if i < steps:
            # the head's own LM head over the draft vocabulary, forward and backward, is most of a step's
            # arithmetic: under --autocast bf16 it runs in bf16 like the layer (log-softmax stays fp32)
            with autocast():
                loss, top = _step_ce(module, hidden, p[kept])
            # nothing scored: a zero that still reaches every parameter (DDP expects a gradient for each)
            mean = loss / n_loss if n_loss else module.draft_logits(out[:1, :1]).sum() * 0.0
            if feature_weight and int(sel.sum()):
                # the target's feature at s = the one it drafts x_{s+1} from; the step's output at t drafts it too
                fl = F.smooth_l1_loss(module.norm(out[sel].float()), final[idx],
                                      reduction="none").mean(-1).mean()
                mean = mean + feature_weight * fl
                feature = float(fl.detach())
            else:
                feature = None
        else:
            mean, n_loss, feature = None, 0, None
            with torch.no_grad():
                top = torch.cat([module.draft_logits(hidden[c:c + CE_CHUNK]).topk(min(3, p.shape[1]), -1).indices
                                 for c in range(0, hidden.shape[0], CE_CHUNK)]) if hidden.shape[0] else \
                    torch.zeros(0, 3, dtype=torch.long, device=hidden.device)
        guess = top if draft_ids is None else draft_ids[top]
        want = best[kept]
        results.append((mean, int(sel.sum()), int((guess[:, 0] == want).sum()),
                        int((guess == want[:, None]).any(-1).sum()), n_loss, feature))
    return results


def ttt_batch_loss(head, target_model, ids, amask, feats, *, steps: int, autocast, vocab=None, memo=None,
                   feature_weight: float = 0.0):
    """Loss of one micro-batch for an EAGLE-3 head: sum_i 0.8**i L_i over the K = `steps` unrolled steps,
    L_i = CE_i (+ feature_weight x SmoothL1_i, see `ttt_losses`). Statistics as `batch_loss`, of the first
    step (feature_loss 0 when the official recipe regresses no feature)."""
    per_step = ttt_losses(head, target_model, ids, amask, feats, steps, autocast, vocab, memo=memo,
                          feature_weight=feature_weight)
    loss = sum(TTT_DECAY ** i * m for i, (m, *_rest) in enumerate(per_step))
    n, top1, top3, fl0 = per_step[0][1], per_step[0][2], per_step[0][3], per_step[0][5] or 0.0
    ce0 = float(per_step[0][0].detach()) - feature_weight * fl0 if per_step[0][4] else 0.0
    return loss, {"loss": float(loss.detach()), "feature_loss": fl0, "ce_loss": ce0, "top1": top1, "top3": top3,
                  "n": n}


@torch.no_grad()
def ttt_evaluate(head, target_model, source, batches, steps: int, autocast, depth: int = EVAL_DEPTHS,
                 vocab=None) -> torch.Tensor:
    """`evaluate`'s sums for an EAGLE-3 head: loss = the training objective, top-1 at depth k = its k-th
    unrolled step's top-1 against the target's argmax (the draft fed its own outputs and the real
    tokens), top-3 at depth 1; counted over the first step's rows."""
    head.eval()
    sums = torch.zeros(5 + depth, dtype=torch.float64)
    for b in batches:
        ids, amask, feats = source.batch(b)
        per_step = ttt_losses(head, target_model, ids, amask, feats, steps, autocast, vocab, depth,
                              memo=source.memo(b))
        n = per_step[0][1]
        if n == 0:
            continue
        loss = sum(TTT_DECAY ** i * float(m) for i, (m, *_rest) in enumerate(per_step[:steps]) if m is not None)
        sums[0] += n * loss
        sums[2] += n * float(per_step[0][0] or 0.0)
        sums[3] += n
        sums[4] += per_step[0][3]
        sums[5] += per_step[0][2]
        for k in range(2, depth + 1):
            sums[4 + k] += per_step[k - 1][2]
    head.train()
    return sums


# ---- evaluation: the head fed its own features, as when drafting -------------------------------------

@torch.no_grad()
def evaluate(head: EagleHead, target_model, source, batches: list[list[int]], weights, autocast,
             depth: int = EVAL_DEPTHS, vocab=None) -> dict:
    """Sums over `batches` of `source`: loss parts, top-1/top-3 at step 1, top-1 at steps 2..depth.
    Accuracies are against the target's argmax over its whole vocabulary, whatever the draft vocabulary."""
    head.eval()
    full = target_model.lm_head.weight
    w, draft_ids = vocab or (full, None)
    # loss, feat, ce, n, top3, top1 at each depth, then the three acceptances at T = 1
    sums = torch.zeros(8 + depth, dtype=torch.float64)
    for b in batches:
        ids, amask, feats = source.batch(b)
        tok_in, counted, target = shift_inputs(ids, amask, feats)
        with autocast():
            outs = head.unroll(target_model.embed_tokens(tok_in), feats.float(), depth)
        sel = counted.bool()
        n = int(sel.sum())
        if n == 0:
            continue
        p, t = outs[0][sel].float(), target[sel].float()
        fl = F.smooth_l1_loss(p, t, reduction="none").mean(-1).mean()
        ce, hits, best, _ = soft_ce(p, t, w, want_grad=False, draft_ids=draft_ids, full_weight=full)
        sums[0] += n * float(weights[0] * fl + weights[1] * ce)
        sums[1] += n * float(fl)
        sums[2] += n * float(ce)
        sums[3] += n
        sums[4] += int(hits[1])
        sums[5] += int(hits[0])
        sums[5 + depth:] += expected_acceptance(p, t, w, draft_ids, full)
        pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(sel)[sel]
        for k in range(2, depth + 1):
            valid = pos >= k - 1
            pk = outs[k - 1][sel][valid].float()
            guess = torch.cat([_logits(pk[s:s + CE_CHUNK], w).argmax(-1) for s in range(0, pk.shape[0], CE_CHUNK)]) \
                if pk.shape[0] else best[:0]
            guess = guess if draft_ids is None else draft_ids[guess]
            sums[4 + k] += int((guess == best[valid]).sum())
            # positions too early for a k-step chain count as misses: the denominator stays n
    head.train()
    return sums


def eval_metrics(sums: torch.Tensor, depth: int = EVAL_DEPTHS) -> dict:
    n = max(float(sums[3]), 1.0)
    out = {"loss": sums[0] / n, "feature_loss": sums[1] / n, "ce_loss": sums[2] / n, "top1": sums[5] / n,
           "top3": sums[4] / n}
    for k in range(2, depth + 1):
        out[f"top1_depth{k}"] = sums[4 + k] / n
    if len(sums) > 5 + depth:  # EAGLE-1 evaluation only (an EAGLE-3 head's sums stop at depth)
        for i, name in enumerate(("accept_t1_sampled", "accept_t1_top1", "accept_t1_top3")):
            out[name] = sums[5 + depth + i] / n
    out = {k: round(float(v), 5) for k, v in out.items()}
    out["tokens"] = int(sums[3])
    return out


# ---- where batches come from ----------------------------------------------------------------------------

class InLoopSource:
    """Tokenized conversations; the target computes their features per batch (cached if asked)."""

    def __init__(self, examples, target_model, cache: bool = False, aux_layers=None, autocast=contextlib.nullcontext):
        """autocast: the context of the target's forward. Training passes its --autocast, so that
        `train --data D --autocast bf16` computes the features as `features --autocast bf16` stores them
        (the forward is most of an in-loop step on a CPU); evaluation keeps the fp32 default."""
        self.examples, self.target, self.cache = examples, target_model, {} if cache else None
        self.autocast = autocast
        self.aux_layers = aux_layers  # EAGLE-3: the features then the three layers, (B, T, 4H)
        self.lengths = [len(e.ids) for e in examples]
        self.device = target_model.embed_tokens.weight.device
        self.best = {}  # per example: what `target_best` keeps across epochs

    def memo(self, idx: list[int]):
        return self.best, list(idx)

    def batch(self, idx: list[int]):
        ids = pad_batch([self.examples[i].ids for i in idx]).to(self.device)
        amask = pad_batch([self.examples[i].mask for i in idx], False, torch.bool).to(self.device)
        key = tuple(idx)
        if self.cache is not None and key in self.cache:
            return ids, amask, self.cache[key]
        with torch.no_grad(), self.autocast():
            feats = target_features(self.target, ids, self.aux_layers).float()
        if self.cache is not None:
            self.cache[key] = feats
        return ids, amask, feats


class StoredSource:
    """Rows of a FeatureStore."""

    def __init__(self, store: FeatureStore, rows: list[int], device, width: int | None = None):
        """width: feature columns to keep (an EAGLE-1 run on an EAGLE-3 store needs only the first H)."""
        self.store, self.rows, self.device, self.width = store, rows, device, width
        self.lengths = [store.lengths[r] for r in rows]
        self.best = {}  # per store row: what `target_best` keeps across epochs

    def memo(self, idx: list[int]):
        return self.best, [self.rows[i] for i in idx]

    def batch(self, idx: list[int]):
        items = [self.store.get(self.rows[i]) for i in idx]
        ids = pad_batch([x[0] for x in items]).to(self.device)
        amask = pad_batch([x[1] for x in items], False, torch.bool).to(self.device)
        t = ids.shape[1]
        width = self.width or items[0][2].shape[-1]
        feats = torch.zeros(len(items), t, width, dtype=torch.float32)
        for row, x in enumerate(items):
            feats[row, : x[2].shape[0]] = x[2][:, :width].float()
        return ids, amask, feats.to(self.device)


def rank_batches(batches: list[list[int]], step_in_epoch: int, rank: int, world: int, accum: int):
    """Step s uses micro-batches [s*W*A, (s+1)*W*A) of the epoch; rank r takes the r-th run of A.
    (global micro-batch number, batch) pairs: the number seeds that micro-batch's noise."""
    first = (step_in_epoch * world + rank) * accum
    return [(first + j, batches[first + j]) for j in range(accum)]


# ---- checkpoints ------------------------------------------------------------------------------------------

def checkpoint_dir(out: Path) -> Path | None:
    for name in ("checkpoint", "checkpoint.old"):  # .old survives a kill between the two renames
        if (out / name / "state.pt").is_file() and (out / name / "head" / "model.safetensors").is_file():
            return out / name
    return None


def save_checkpoint(out: Path, head: EagleHead, opt, state: dict, extra_config: dict) -> None:
    tmp, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    head.save(tmp / "head", extra_config)
    torch.save({**state, "optimizer": opt.state_dict(), "rng_cpu": torch.get_rng_state()}, tmp / "state.pt")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    head.save(out / "head", extra_config)


# ---- the command ----------------------------------------------------------------------------------------

def setup_distributed(device_arg: str | None):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device_arg
    import torch.distributed as dist
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device_arg is None else device_arg.startswith("cuda")
    device = f"cuda:{local}" if use_cuda else "cpu"
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return rank, world, device


def plan_warmup(requested: int | None, total_steps: int, log=print) -> int:
    """The warm-up steps to use. With 100 warm-up steps a 6-step run never gets past 6% of --lr and
    learns nothing: the default scales down to a tenth of the run then, an explicit value is kept and
    warned about."""
    if requested is None:
        if DEFAULT_WARMUP < total_steps:
            return DEFAULT_WARMUP
        warmup = max(1, total_steps // 10)
        log(f"note: the run has {total_steps} steps, too few for the default {DEFAULT_WARMUP} warm-up steps: "
            f"warming up over {warmup} instead (--warmup-steps sets it)")
        return warmup
    if requested >= total_steps:
        log(f"warning: --warmup-steps {requested} >= the run's {total_steps} steps: the learning rate never reaches "
            f"--lr (at most {lr_at(total_steps - 1, 1.0, requested, total_steps):.0%} of it); lower --warmup-steps")
    return requested


def check_plan(saved: dict, plan: dict, out: Path, replan: bool, log=print) -> None:
    """A resume continues the saved schedule. Another plan (more --epochs for a finished run, say) would
    silently re-plan the learning rate and overwrite the head: only with --replan."""
    before = saved.get("plan")
    if before is None or before == plan:  # checkpoints from before plans were saved are taken as they are
        return
    changed = ", ".join(f"{k} {before.get(k)} -> {plan[k]}" for k in plan if before.get(k) != plan[k])
    if not replan:
        raise ValueError(f"the run in {out} was planned otherwise ({changed}): resuming would re-plan the learning "
                         "rate and overwrite its head; add --replan to do that, or train into another --out")
    log(f"--replan: {changed}; the learning rate follows the new schedule from here")


def lr_at(step: int, lr: float, warmup: int, total: int) -> float:
    """Linear warm-up over `warmup` steps, then linear decay to 0 at `total` (EAGLE's schedule)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * max(0.0, (total - step) / max(1, total - warmup))


def clip_gradients(params, clip: float, mode: str) -> float:
    params = [p for p in params if p.grad is not None]
    norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip and mode == "norm" else float("inf")))
    if clip and mode == "value":
        torch.nn.utils.clip_grad_value_(params, clip)
    return norm


def parse_weights(args) -> tuple[float, float]:
    fw, cw = args.feature_weight, args.ce_weight
    if args.loss_weights:
        try:
            fw, cw = (float(x) for x in args.loss_weights.split(","))
        except ValueError:
            raise ValueError(f"--loss-weights must be F,C (two numbers), got '{args.loss_weights}'") from None
    if fw < 0 or cw < 0 or fw + cw == 0:
        raise ValueError("loss weights must be >= 0 and not both 0")
    return fw, cw


def split_seed(args) -> int:
    """The held-out split's seed: --split-seed, else --seed (as before the option, so old runs resume)."""
    return args.seed if getattr(args, "split_seed", None) is None else args.split_seed


def validate(args) -> None:
    if args.ttt_steps is None:
        args.ttt_steps = 7 if args.arch == "eagle3" else 1
    check_positive(max_conversations=args.max_conversations, max_len=args.max_len, batch_tokens=args.batch_tokens,
                   epochs=args.epochs, grad_accum=args.grad_accum, max_steps=args.max_steps,
                   eval_conversations=args.eval_conversations, ttt_steps=args.ttt_steps, head_layers=args.head_layers)
    if args.grown_lr is not None and not (args.grown_lr > 0 and args.init_head and args.head_layers):
        raise ValueError("--grown-lr sets the learning rate of the layers --head-layers adds to an --init-head head: "
                         "give both (and a --grown-lr > 0)")
    if args.arch == "eagle3" and args.head_layers not in (None, 1):
        raise ValueError("--head-layers applies to EAGLE-1 heads (--arch eagle); an EAGLE-3 head has one layer")
    for name in ("lr", "noise", "clip", "weight_decay", "save_every", "eval_every", "warmup_steps", "draft_vocab",
                 "eagle3_feature_weight"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not 0 <= args.held_out < 1:
        raise ValueError(f"--held-out must be in [0, 1), got {args.held_out}")


def assistant_token_counts(token_masks, vocab_size: int) -> torch.Tensor:
    """How often each token id is written by the assistant; `token_masks` yields (ids, assistant mask)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in token_masks:
        counts += torch.bincount(torch.as_tensor(ids)[torch.as_tensor(mask, dtype=torch.bool)], minlength=vocab_size)
    return counts


def training_token_masks(store, examples, train_rows):
    """(ids, assistant mask) of each training conversation, from the feature store or the examples."""
    if store is not None:
        return (store.tokens(r) for r in train_rows)
    return ((examples[r].ids, examples[r].mask) for r in train_rows)


def choose_draft_vocab(token_masks, n: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The n most frequent assistant tokens (ties: lower id), ascending, and the share of assistant
    tokens they cover. `token_masks` yields (ids, assistant mask) per conversation."""
    counts = assistant_token_counts(token_masks, vocab_size)
    ids = torch.argsort(-counts, stable=True)[:n].sort().values  # stable: equal counts keep id order
    return ids, float(counts[ids].sum()) / max(int(counts.sum()), 1)


def first_conversations(rows: list[int], keys: list[str], n: int) -> list[int]:
    """The rows of the first n conversations among `rows` (the parts of one chat share a key). A learning
    curve trains on growing prefixes of one feature store against the same held-out split."""
    seen: set[str] = set()
    out = []
    for r in rows:
        if keys[r] not in seen:
            if len(seen) >= n:
                break
            seen.add(keys[r])
        out.append(r)
    return out


def fingerprint_data(lengths: list[int], held: list[int]) -> str:
    import hashlib
    return hashlib.sha256(json.dumps([lengths, held]).encode()).hexdigest()[:16]


def run_train(args) -> int:
    validate(args)
    weights = parse_weights(args)
    rank, world, device = setup_distributed(args.device)
    args.command = command_line(args, world)  # before defaults get filled in
    args.device = device
    try:
        code = _train(args, weights, rank, world)
        if world > 1:
            # Rank 0 still writes the head and card when the others are done; a rank that tears gloo down
            # while a peer is busy can abort (seen under load: SIGABRT, "terminate called without an active
            # exception"). Only on success: a peer that failed would never reach the barrier.
            import torch.distributed as dist
            dist.barrier()
        return code
    finally:
        if world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()


# ---- steps of `_train` -------------------------------------------------------------------------------

EAGLE1_ONLY = {"noise": 0.1, "feature_weight": 1.0, "ce_weight": 0.1, "loss_weights": None, "no_fc_bias": False}


def run_aux_layers(args, target, store: FeatureStore | None, log=print) -> tuple[int, ...] | None:
    """--arch eagle3: the target layers the head fuses (a features folder's own, else --aux-layers or
    the default); None for EAGLE-1."""
    if args.arch != "eagle3":
        if args.eagle3_feature_weight:
            log("note: --eagle3-feature-weight applies to --arch eagle3 only (EAGLE-1 uses --feature-weight)")
        return None
    unused = [f"--{k.replace('_', '-')}" for k, v in EAGLE1_ONLY.items() if getattr(args, k) != v]
    if unused:
        log(f"note: {', '.join(unused)} do(es) not apply to --arch eagle3 (cross-entropy only, no input noise, "
            "fc without bias, as the official EAGLE-3 trainer)")
    wanted = parse_aux_layers(args.aux_layers, target.args.num_hidden_layers)
    if store is None:
        return wanted
    if store.aux_layers is None:
        raise ValueError(f"features in {store.folder} hold no EAGLE-3 layers: compute them with "
                         "`eaglespec features --arch eagle3`, or train --arch eagle")
    if args.aux_layers is not None and wanted != store.aux_layers:
        raise ValueError(f"--aux-layers {args.aux_layers} differs from the layers in {store.folder} "
                         f"({','.join(map(str, store.aux_layers))}): drop it or recompute the features")
    return store.aux_layers


def run_draft_vocab(args, target, store, examples, train_rows, log):
    """(draft ids or None, share of the training data's assistant tokens they cover)."""
    if not args.draft_vocab or args.draft_vocab >= target.args.vocab_size:
        return None, 1.0
    draft_vocab, coverage = choose_draft_vocab(training_token_masks(store, examples, train_rows), args.draft_vocab,
                                               target.args.vocab_size)
    log(f"draft vocabulary: {draft_vocab.numel():,} of {target.args.vocab_size:,} tokens, "
        f"covering {coverage:.1%} of the training data's assistant tokens")
    return draft_vocab, coverage


def new_head(args, target, draft_vocab, aux):
    if aux is not None:
        head = random_eagle3_head(target.args, seed=args.seed, draft_vocab=draft_vocab, aux_layers=aux)
        if args.eagle3_output_init == "target":
            copy_target_output(head, target)
        return head
    return random_head(target.args, seed=args.seed, bias=not args.no_fc_bias, draft_vocab=draft_vocab,
                       layers=args.head_layers or 1)


def copy_target_output(head, target) -> None:
    """An EAGLE-3 head's norm and lm_head set to the target's final norm and LM-head rows (its draft ids).
    EAGLE-1 heads borrow these and start out predicting through a trained output layer; an EAGLE-3 head
    owns them and must otherwise learn one from its (often small) training set."""
    ids = head.draft_ids
    w = target.lm_head.weight.detach()
    with torch.no_grad():
        head.lm_head.weight.copy_((w if ids is None else w[ids.to(w.device)]).to(head.lm_head.weight))
        head.norm.weight.copy_(target.norm.weight.detach().to(head.norm.weight))


def initial_head(args, target, aux, log):
    """--init-head: fine-tune a trained head (e.g. the shipped one on regenerated answers); it keeps its own
    draft vocabulary unless --draft-vocab chooses one again (EAGLE-1: see with_draft_vocab)."""
    head = load_head(args.init_head, target.args)
    if head.aux_layers != aux:
        raise ValueError(f"--init-head {args.init_head} is an {head.arch} head"
                         + (f" on layers {','.join(map(str, head.aux_layers))}" if head.aux_layers else "")
                         + f", this run trains --arch {args.arch}" + (f" on layers {','.join(map(str, aux))}" if aux else ""))
    if args.draft_vocab and aux is not None:
        raise ValueError(f"--draft-vocab with --init-head: an EAGLE-3 head's LM head is its own, over its own draft "
                         f"vocabulary, so {args.init_head} keeps it; leave --draft-vocab out")
    if aux is None and args.head_layers and args.head_layers != len(head.layers):
        if args.head_layers < len(head.layers):
            raise ValueError(f"--head-layers {args.head_layers}: --init-head {args.init_head} has {len(head.layers)} "
                             "layers, and a head can grow, not shrink")
        log(f"head: {args.init_head}'s {len(head.layers)} layer(s) grown to {args.head_layers} (the new ones start as "
            "the identity)")
        args.grown_from = len(head.layers)
        head = grown_head(head, args.head_layers, seed=args.seed)
    return head


def with_draft_vocab(head: EagleHead, ids: torch.Tensor | None) -> EagleHead:
    """`head` drafting from `ids` instead (None: the whole vocabulary). An EAGLE-1 head predicts the target's
    features and drafts through the target's LM-head rows, so no weight depends on which tokens those are:
    only d2t / t2d change. Why: a head first trained on ShareGPT's answers took its draft vocabulary from
    ChatGPT's tokens; fine-tuned on the target's own answers, it should draft the target's (the twenty-
    third session measured 89.4 % of the default target's greedy MT-bench tokens inside the shipped head's
    8,192, 91.6 % inside the 8,192 most frequent tokens of its regenerated answers)."""
    fresh = EagleHead(head.args, bias=head.fc.bias is not None, draft_vocab=ids)
    state = {k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"d2t", "t2d"}, (missing, unexpected)
    return fresh


def vocab_coverage(ids, store, examples, train_rows, vocab_size: int, log) -> float:
    """The share of the training data's assistant tokens inside draft vocabulary `ids` (None: all)."""
    if ids is None:
        return 1.0
    counts = assistant_token_counts(training_token_masks(store, examples, train_rows), vocab_size)
    coverage = float(counts[ids].sum()) / max(int(counts.sum()), 1)
    log(f"draft vocabulary: the initial head's {ids.numel():,} tokens, covering {coverage:.1%} of the training "
        f"data's assistant tokens")
    return coverage


def resumed_head(args, target, ckpt: Path, out: Path, fresh, data_fp, plan, per_step, log):
    """The checkpoint's head and saved state, refused (one line) unless it continues this very run."""
    head = load_head(ckpt / "head", target.args)  # ValueError (one line) if it does not fit the target
    if head.arch != fresh.arch or head.aux_layers != fresh.aux_layers:
        raise ValueError(f"the checkpoint in {out} is an {head.arch} head"
                         + (f" on layers {','.join(map(str, head.aux_layers))}" if head.aux_layers else "")
                         + ": resume with the same --arch/--aux-layers")
    if head.args.num_hidden_layers != fresh.args.num_hidden_layers:
        raise ValueError(f"the checkpoint in {out} is a head of {head.args.num_hidden_layers} layer(s), this run's has "
                         f"{fresh.args.num_hidden_layers}: resume with the same --head-layers")
    had, want = head.draft_ids, fresh.draft_ids
    if (had is None) != (want is None) or (had is not None and not torch.equal(had, want)):
        raise ValueError(f"the checkpoint in {out} drafts from another vocabulary: resume with the same --draft-vocab")
    saved = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
    if saved.get("data_fingerprint") != data_fp:
        raise ValueError(f"the checkpoint in {out} was trained on other data: resume with the same "
                         "--data/--max-conversations/--max-len/--features-dir/--seed/--held-out")
    check_plan(saved, plan, out, args.resume and args.replan, log)
    if saved.get("micro_batches_per_step") != per_step:
        raise ValueError(f"the checkpoint used {saved.get('micro_batches_per_step')} micro-batches per step "
                         f"(processes x grad-accum), this run {per_step}")
    return head, saved


def first_of_each_answer(amask: torch.Tensor, n: int) -> torch.Tensor:
    """amask (B, T) bool, True on assistant tokens: the same, kept only on each answer's first n tokens."""
    count = amask.long().cumsum(1)
    starts = amask & ~F.pad(amask, (1, 0))[:, :-1]
    base = torch.where(starts, count, 0).cummax(1).values  # the count at the current answer's first token
    return amask & (count - base < n)


class FirstAnswerTokens:
    """A batch source whose assistant masks keep only each answer's first n tokens (what `evaluate` scores)."""

    def __init__(self, src, n: int):
        self.src, self.n, self.lengths = src, n, src.lengths

    def memo(self, idx):
        return self.src.memo(idx)

    def batch(self, idx):
        ids, amask, feats = self.src.batch(idx)
        return ids, first_of_each_answer(amask, self.n), feats


def run_evaluate(args) -> int:
    """The held-out split of --features-dir / --data, as `train` makes it, scored for --head: a head trained
    on one corpus is measured on another's held-out text (the ablation's common yardstick)."""
    check_positive(eval_conversations=args.eval_conversations, max_len=args.max_len, ttt_steps=args.ttt_steps,
                   answer_tokens=args.answer_tokens)
    store = FeatureStore(args.features_dir) if args.features_dir else None
    if store is not None and args.model is None and store.manifest.get("model") not in (None, "default"):
        args.model = store.manifest["model"]
    target, tokenizer, _ = load_model(args)
    head = load_head(args.head, target.args)
    device = target.embed_tokens.weight.device
    aux = getattr(head, "aux_layers", None)
    if store is not None:
        m = store.manifest
        if m["model_fingerprint"] != model_fingerprint(target):
            raise ValueError(f"features in {store.folder} were computed with another model ({m.get('model')})")
        if aux is not None and tuple(m.get("aux_layers") or ()) != tuple(aux):
            raise ValueError(f"the EAGLE-3 head fuses layers {list(aux)} but {store.folder} holds "
                             f"{m.get('aux_layers') or 'the last feature only'}: compute features with --arch eagle3 "
                             f"--aux-layers {','.join(map(str, aux))}")
        keys, desc = store.keys, str(store.folder)
    else:
        examples, _ = load_examples(tokenizer, args.data or "sharegpt", args.max_conversations, args.max_len or 2048)
        keys, desc = [e.key for e in examples], args.data or "sharegpt"
    _, held_rows = split(keys, args.seed, args.held_out)
    rows = held_rows[: args.eval_conversations]
    if not rows:
        raise ValueError(f"no held-out conversations in {desc} (fraction {args.held_out}): add data or raise --held-out")
    if store is not None:
        src = StoredSource(store, rows, device, None if aux is not None else target.args.hidden_size)
    else:
        src = InLoopSource([examples[i] for i in rows], target, aux_layers=aux)
    batches = make_batches(src.lengths, max(max(src.lengths), args.batch_tokens // 4), args.seed, 999_999)
    if args.answer_tokens:
        src = FirstAnswerTokens(src, args.answer_tokens)
    head = head.to(device=device, dtype=torch.float32)
    vocab = None if head.draft_ids is None else (target.lm_head.weight[head.draft_ids].contiguous(), head.draft_ids)
    autocast = autocast_for(device, "auto")  # bf16 on CUDA, fp32 on a CPU, as training's evaluations
    t0 = time.perf_counter()
    if aux is not None:
        sums = ttt_evaluate(head, target, src, batches, args.ttt_steps, autocast, vocab=vocab)
    else:
        # the weights only combine the reported loss; the accuracies do not depend on them
        sums = evaluate(head, target, src, batches, (1.0, 0.1), autocast, vocab=vocab)
    res = {"head": str(args.head), "data": desc, "conversations": len(rows), "answer_tokens": args.answer_tokens,
           **eval_metrics(sums),
           "seconds": round(time.perf_counter() - t0, 1)}
    where = f"the first {args.answer_tokens} tokens of each answer, " if args.answer_tokens else ""
    print(f"held-out ({len(rows)} conversations, {where}{res['tokens']:,} positions of {desc}): top1 {res['top1']:.3f} "
          f"top3 {res['top3']:.3f} " + " ".join(f"d{k} {res[f'top1_depth{k}']:.3f}" for k in range(2, EVAL_DEPTHS + 1))
          + (" | accepted at T=1: sampled draft {:.3f}, top-1 {:.3f}, top-3 {:.3f}".format(
              res["accept_t1_sampled"], res["accept_t1_top1"], res["accept_t1_top3"]) if "accept_t1_top1" in res else ""))
    if args.json:
        Path(args.json).expanduser().write_text(json.dumps(res, indent=1) + "\n")
    return 0


@dataclass
class RunData:
    """What a run trains and evaluates on: the conversations' split and a source for each side."""
    desc: str
    summary: str
    store: FeatureStore | None
    examples: list | None  # tokenized conversations when features are computed in the loop
    train_rows: list[int]
    held_rows: list[int]
    eval_rows: list[int]
    train_src: "StoredSource | InLoopSource"
    eval_src: "StoredSource | InLoopSource"
    eval_batches: list[list[int]]


def open_output(args, log) -> tuple[Path, Path | None]:
    """The run's folder and its checkpoint, if any (one only with --resume)."""
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    ckpt = checkpoint_dir(out) if out.is_dir() else None
    if ckpt and not args.resume:
        raise ValueError(f"{out} already holds a training run: add --resume to continue it, or choose another --out")
    if args.resume and ckpt is None:
        log(f"--resume: no checkpoint in {out}, starting from scratch")
    return out, ckpt


def open_features(args, log) -> FeatureStore | None:
    """The --features-dir store; its model becomes the run's unless --model says otherwise."""
    if not args.features_dir:
        return None
    store = FeatureStore(args.features_dir)
    m = store.manifest
    if args.model is None and m.get("model") not in (None, "default"):
        args.model = m["model"]
    ignored = [f"--{n.replace('_', '-')}" for n in ("data", "max_len") if getattr(args, n) is not None]
    if ignored:
        log(f"note: {', '.join(ignored)} ignored: the data come from {store.folder}")
    return store


def run_data(args, target, tokenizer, store, aux, rank: int, world: int, log) -> RunData:
    """The split (fixed by the seed) and the train/eval sources, from the store or tokenized conversations."""
    examples = None
    if store is not None:
        m = store.manifest
        if (m["hidden_size"], m["vocab_size"]) != (target.args.hidden_size, target.args.vocab_size) \
                or m["model_fingerprint"] != model_fingerprint(target):
            raise ValueError(f"features in {store.folder} were computed with another model ({m.get('model')}); "
                             "pass the same --model or recompute them")
        desc = f"{m['data']} (features {store.folder}, max-len {m['max_len']})"
        summary = m.get("data_summary", "")
        keys = store.keys
    else:
        max_len = args.max_len or 2048
        examples, summary = load_examples(tokenizer, args.data or "sharegpt", args.max_conversations, max_len, log=log)
        desc = f"{args.data or 'sharegpt'} (max-len {max_len}, features computed in the loop)"
        keys = [e.key for e in examples]
    train_rows, held_rows = split(keys, split_seed(args), args.held_out)
    if store is not None and args.max_conversations is not None:
        train_rows = first_conversations(train_rows, keys, args.max_conversations)
        log(f"--max-conversations {args.max_conversations}: training on the first {len(train_rows):,} train rows of "
            f"{store.folder}; the held-out split stays the whole store's")
    eval_rows = held_rows[: args.eval_conversations]
    if not train_rows:
        raise ValueError("no training conversations after the held-out split")
    device = target.embed_tokens.weight.device
    if store is not None:
        width = None if aux is not None else target.args.hidden_size
        train_src, eval_src = StoredSource(store, train_rows, device, width), StoredSource(store, eval_rows, device, width)
    else:
        train_src = InLoopSource([examples[i] for i in train_rows], target, aux_layers=aux,
                                 autocast=forward_autocast(target, args.autocast))
        eval_src = InLoopSource([examples[i] for i in eval_rows], target, cache=True, aux_layers=aux)
    # Several attention score matrices of (batch, heads, T, T) live at once in the unrolled evaluation.
    eval_batches = make_batches(eval_src.lengths, max(max(eval_src.lengths, default=1), args.batch_tokens // 4),
                                args.seed, 999_999)[rank::world] if eval_rows else []
    return RunData(desc, summary, store, examples, train_rows, held_rows, eval_rows, train_src, eval_src, eval_batches)


@dataclass
class Schedule:
    epoch_batches: list[list[list[int]]]  # per epoch, the micro-batches in order
    steps_per_epoch: list[int]
    total_steps: int
    per_step: int  # micro-batches per optimizer step, all processes together
    plan: dict  # what a resume must keep (or --replan)
    data_fp: str


def schedule(args, data: RunData, aux, world: int, log) -> Schedule:
    per_step = world * args.grad_accum
    lengths = data.train_src.lengths
    epoch_batches = [make_batches(lengths, args.batch_tokens, args.seed, e) for e in range(args.epochs)]
    steps_per_epoch = [len(b) // per_step for b in epoch_batches]
    if sum(steps_per_epoch) == 0:
        raise ValueError(f"too little data for one step: {len(epoch_batches[0])} batches for {world} process(es) "
                         f"x grad-accum {args.grad_accum}; lower --batch-tokens or add data")
    total_steps = min(sum(steps_per_epoch), args.max_steps or sum(steps_per_epoch))
    args.warmup_steps = plan_warmup(args.warmup_steps, total_steps, log)
    plan = {"epochs": args.epochs, "total_steps": total_steps, "lr": args.lr, "warmup_steps": args.warmup_steps}
    if args.grown_lr is not None:  # absent when unset, so runs from before the option resume unchanged
        plan["grown_lr"] = args.grown_lr
    if aux is not None or args.ttt_steps > 1:  # another unroll depth is another objective: a resume keeps it
        plan["ttt_steps"] = args.ttt_steps    # (or --replan); absent for EAGLE-1 at 1, so older runs resume
        if args.eagle3_feature_weight:  # absent when 0, so runs from before the option resume unchanged
            plan["eagle3_feature_weight"] = args.eagle3_feature_weight
    log(f"train: {len(data.train_rows):,} records ({sum(lengths):,} tokens), held-out {len(data.held_rows):,} "
        f"(evaluating {len(data.eval_rows)}); {total_steps:,} steps of {per_step} micro-batch(es) of <= "
        f"{args.batch_tokens} tokens; {world} process(es) on {data.train_src.device}")
    return Schedule(epoch_batches, steps_per_epoch, total_steps, per_step, plan,
                    fingerprint_data(lengths, data.eval_rows))


def starting_head(args, target, data: RunData, aux, init, ckpt, out, sched: Schedule, log):
    """(head, draft vocabulary, its coverage, run state, the checkpoint's saved state or None): a new or
    --init-head head, or the checkpoint's when resuming."""
    examples = data.examples if data.store is None else None
    if init is not None and args.draft_vocab:  # a fine-tuned EAGLE-1 head, its draft vocabulary chosen again
        draft_vocab, coverage = run_draft_vocab(args, target, data.store, examples, data.train_rows, log)
        head = with_draft_vocab(init, draft_vocab)
    elif init is not None:
        head, draft_vocab = init, init.draft_ids
        coverage = vocab_coverage(draft_vocab, data.store, examples, data.train_rows, target.args.vocab_size, log)
    else:
        draft_vocab, coverage = run_draft_vocab(args, target, data.store, examples, data.train_rows, log)
        head = new_head(args, target, draft_vocab, aux)
    state = {"step": 0, "epoch": 0, "step_in_epoch": 0, "tokens_seen": 0, "wall_time": 0.0, "commands": []}
    saved = None
    if ckpt is not None:
        head, saved = resumed_head(args, target, ckpt, out, head, sched.data_fp, sched.plan, sched.per_step, log)
        state.update({k: saved[k] for k in state})
        log(f"resumed from {ckpt} at step {state['step']} (epoch {state['epoch'] + 1}, step {state['step_in_epoch']})")
    state["commands"] = list(state["commands"]) + [args.command]
    return head, draft_vocab, coverage, state, saved


def _train(args, weights, rank: int, world: int) -> int:
    log = print if rank == 0 else (lambda *a, **k: None)
    out, ckpt = open_output(args, log)
    store = open_features(args, log)
    target, tokenizer, _ = load_model(args)
    if args.draft_vocab > target.args.vocab_size:  # before any data is read
        raise ValueError(f"--draft-vocab {args.draft_vocab} is larger than the target's vocabulary "
                         f"({target.args.vocab_size:,} tokens): use at most that, or 0 for the whole vocabulary")
    aux = run_aux_layers(args, target, store, log)  # EAGLE-3: the target layers the head fuses; None for EAGLE-1
    args.aux_layers_used = ",".join(map(str, aux)) if aux is not None else None
    init = initial_head(args, target, aux, log) if args.init_head else None  # before the data: fail fast
    data = run_data(args, target, tokenizer, store, aux, rank, world, log)
    sched = schedule(args, data, aux, world, log)
    head, draft_vocab, coverage, state, saved = starting_head(args, target, data, aux, init, ckpt, out, sched, log)
    args.head_layers_used = head.args.num_hidden_layers  # for the card
    run = TrainRun(args, weights, rank, world, target, head, aux, data, sched, state, saved, out)
    with StopOnSignal() as stop:
        finished = run.loop(log, stop)
    if run.stopped_by is not None:
        log(f"train: interrupted ({signal.Signals(run.stopped_by).name}) after step {state['step']}, checkpoint saved in "
            f"{out}: rerun the same command with --resume to continue", flush=True)  # torchrun may kill us soon
        return 128 + run.stopped_by  # the shell's convention for a signalled process
    if not finished:
        return 0
    if os.environ.get("EAGLESPEC_TEST_CHECKSUM_DIR"):  # tests: does every rank hold the same weights?
        write_checksum(Path(os.environ["EAGLESPEC_TEST_CHECKSUM_DIR"]), run.head, rank, state["step"])
    if rank == 0:
        write_card(out, state, data.desc, data.summary, run.last_eval, sched.total_steps, args, weights,
                   data.train_rows, data.held_rows, data.eval_rows, sum(data.train_src.lengths), world,
                   None if draft_vocab is None else (draft_vocab.numel(), coverage))
        log(f"done: {state['step']} steps, {state['tokens_seen']:,} tokens, {state['wall_time']:.0f} s; head in {out / 'head'}")
    return 0


class StopOnSignal:
    """SIGINT/SIGTERM (Ctrl-C, a scheduler's stop, the end of a session) ask the loop to finish its step, save a
    checkpoint and exit, instead of losing up to --save-every steps. A second signal falls back to the old
    handler, so an impatient Ctrl-C still kills. Only in the main thread (where Python delivers signals)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self.previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def param_groups(head, args) -> list[dict]:
    """The optimizer's groups: the head, and apart from it the layers --head-layers grew (their own peak
    --grown-lr, as `lr_scale` x the schedule's lr). One group where nothing grew, as before the option."""
    grown_from = getattr(args, "grown_from", None)
    if grown_from is None or args.grown_lr is None:
        return [{"params": list(head.parameters())}]
    new = {id(p) for layer in head.layers[grown_from:] for p in layer.parameters()}
    return [{"params": [p for p in head.parameters() if id(p) not in new]},
            {"params": [p for p in head.parameters() if id(p) in new], "lr_scale": args.grown_lr / args.lr}]


class TrainRun:
    """The optimizer loop of one run: steps, evaluations, checkpoints and logs."""

    def __init__(self, args, weights, rank, world, target, head, aux, data: RunData, sched: Schedule, state, saved, out):
        self.args, self.weights, self.rank, self.world = args, weights, rank, world
        self.target, self.aux, self.data, self.sched, self.state, self.out = target, aux, data, sched, state, out
        device = target.embed_tokens.weight.device
        self.head = head = head.to(device=device, dtype=torch.float32).train()
        self.vocab = None if head.draft_ids is None else \
            (target.lm_head.weight[head.draft_ids].contiguous(), head.draft_ids)
        self.opt = torch.optim.AdamW(param_groups(head, args), lr=args.lr, betas=(0.9, 0.95),
                                     weight_decay=args.weight_decay)
        if saved is not None:
            self.opt.load_state_dict(saved["optimizer"])
            torch.set_rng_state(saved["rng_cpu"])
        self.model = head
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel
            self.model = DistributedDataParallel(head, device_ids=[device.index] if device.type == "cuda" else None)
        self.autocast = autocast_for(device, args.autocast)
        # The loss's frozen LM-head passes (soft_ce: most of a CPU step) are our own code, outside autocast;
        # an explicit --autocast bf16 runs them on bf16 rows too. (auto on CUDA keeps them fp32, as before.)
        self.train_vocab = self.vocab
        if args.autocast == "bf16":
            w, ids = self.vocab or (target.lm_head.weight, None)
            self.train_vocab = (w.to(torch.bfloat16), ids)
        # the held-out yardstick does not follow --autocast: fp32 on a CPU, so runs with and without it compare
        self.eval_autocast = autocast_for(device, "auto")
        self.extra = {"eaglespec": {"target": args.model or "default", "data": data.desc}}
        self.resumed = saved is not None
        self.last_eval: dict = {}
        self.stopped_by: int | None = None  # the signal that stopped the loop (on any rank)
        self.marks = {"eval": None, "save": state["step"] if self.resumed else None}  # steps last evaluated / saved

    def evaluate(self, tag: str) -> None:
        a, state = self.args, self.state
        self.marks["eval"] = state["step"]
        if self.aux is not None:
            sums = ttt_evaluate(self.head, self.target, self.data.eval_src, self.data.eval_batches, a.ttt_steps,
                                self.eval_autocast, vocab=self.vocab)
        else:
            sums = evaluate(self.head, self.target, self.data.eval_src, self.data.eval_batches, self.weights,
                            self.eval_autocast, vocab=self.vocab)
        if self.world > 1:
            import torch.distributed as dist
            dist.all_reduce(sums)
        if self.rank == 0 and self.data.eval_rows:
            ev = self.last_eval = {"step": state["step"], "epoch": state["epoch"], "at": tag, **eval_metrics(sums)}
            self.metrics_log.write(json.dumps(ev) + "\n")
            self.metrics_log.flush()
            self.bar.write(f"eval @ step {state['step']}: top1 {ev['top1']:.3f} top3 {ev['top3']:.3f} "
                           + " ".join(f"d{k} {ev[f'top1_depth{k}']:.3f}" for k in range(2, EVAL_DEPTHS + 1))
                           + f" loss {ev['loss']:.4f}")

    def save(self) -> None:
        state = self.state
        self.marks["save"] = state["step"]
        state["wall_time"] = self.wall_before + (time.perf_counter() - self.session_start)
        if self.rank == 0:
            save_checkpoint(self.out, self.head, self.opt, {**state, "data_fingerprint": self.sched.data_fp,
                                                            "micro_batches_per_step": self.sched.per_step,
                                                            "plan": self.sched.plan}, self.extra)

    def step(self, epoch: int, micro, stop: "StopOnSignal | None" = None) -> tuple[torch.Tensor, float]:
        """One optimizer step over this rank's micro-batches; the statistics summed over ranks."""
        a, src = self.args, self.data.train_src
        stats = torch.zeros(8, dtype=torch.float64)  # loss, feat, ce, top1, top3, n, tokens, signals received
        for j, (number, b) in enumerate(micro):
            ids, amask, feats = src.batch(b)
            gen = torch.Generator().manual_seed(a.seed * 1_000_003 + epoch * 10_000_019 + number)
            sync = self.model.no_sync() if self.world > 1 and j < len(micro) - 1 else contextlib.nullcontext()
            with sync:
                if self.aux is not None:
                    loss, s = ttt_batch_loss(self.model, self.target, ids, amask, feats, steps=a.ttt_steps,
                                             autocast=self.autocast, vocab=self.train_vocab, memo=src.memo(b),
                                             feature_weight=a.eagle3_feature_weight)
                else:
                    loss, s = batch_loss(self.model, self.target, ids, amask, feats, noise=a.noise, weights=self.weights,
                                         generator=gen, autocast=self.autocast, vocab=self.train_vocab, steps=a.ttt_steps)
                (loss / a.grad_accum).backward()
            stats[:7] += torch.tensor([s["loss"], s["feature_loss"], s["ce_loss"], s["top1"], s["top3"], s["n"],
                                       sum(src.lengths[i] for i in b)], dtype=torch.float64)
        grad_norm = clip_gradients(self.head.parameters(), a.clip, a.clip_mode)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        # A signal reaches the ranks at different moments; summed with the statistics, every rank sees the
        # same verdict after the same step, at no extra collective.
        stats[7] = float(stop.signum or 0) if stop is not None else 0.0
        if self.world > 1:
            import torch.distributed as dist
            dist.all_reduce(stats)
        return stats, grad_norm

    def log_step(self, epoch: int, lr: float, stats, grad_norm: float, rate: float) -> None:
        state, per_step, w = self.state, self.sched.per_step, self.weights
        top1_logged = bool(w[1] or self.aux)
        rec = {"step": state["step"], "epoch": epoch, "lr": lr, "loss": float(stats[0]) / per_step,
               "feature_loss": float(stats[1]) / per_step, "ce_loss": float(stats[2]) / per_step,
               "top1": float(stats[3]) / max(float(stats[5]), 1) if top1_logged else None,
               "grad_norm": grad_norm, "tokens": int(stats[6]), "tokens_seen": state["tokens_seen"],
               "tok_s": round(rate, 1), "time": round(self.wall_before + time.perf_counter() - self.session_start, 2)}
        self.train_log.write(json.dumps(rec) + "\n")
        self.train_log.flush()
        self.bar.set_postfix(loss=f"{rec['loss']:.4f}", top1=f"{rec['top1']:.3f}" if top1_logged else "-",
                             lr=f"{lr:.2e}", tok_s=f"{rate:.0f}", refresh=False)
        self.bar.update(1)

    def loop(self, log, stop: "StopOnSignal | None" = None) -> bool:
        """Run the remaining steps; evaluate and save at the end. False if --stop-after or a signal (`stop`)
        stopped it first; after a signal the checkpoint is at the last step run."""
        from tqdm import tqdm
        a, state, sched, rank = self.args, self.state, self.sched, self.rank
        if rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            for name in ("train_log.jsonl", "metrics.jsonl"):  # steps after the checkpoint are about to be redone
                trim_log(self.out / name, state["step"])
        self.train_log = open(self.out / "train_log.jsonl", "a") if rank == 0 else None
        self.metrics_log = open(self.out / "metrics.jsonl", "a") if rank == 0 else None
        self.wall_before, self.session_start = state["wall_time"], time.perf_counter()
        self.bar = tqdm(total=sched.total_steps, initial=min(state["step"], sched.total_steps), unit="step",
                        desc="train", disable=rank != 0, dynamic_ncols=True)
        session_tokens = 0
        for epoch in range(state["epoch"], a.epochs):
            state["epoch"] = epoch
            for step_in_epoch in range(state["step_in_epoch"], sched.steps_per_epoch[epoch]):
                if state["step"] >= sched.total_steps:
                    break
                lr = lr_at(state["step"], a.lr, a.warmup_steps, sched.total_steps)
                for g in self.opt.param_groups:
                    g["lr"] = lr * g.get("lr_scale", 1.0)
                stats, grad_norm = self.step(epoch, rank_batches(sched.epoch_batches[epoch], step_in_epoch, rank,
                                                                 self.world, a.grad_accum), stop)
                state["step"] += 1
                state["step_in_epoch"] = step_in_epoch + 1
                state["tokens_seen"] += int(stats[6])
                session_tokens += int(stats[6])
                if rank == 0:
                    self.log_step(epoch, lr, stats, grad_norm,
                                  session_tokens / max(time.perf_counter() - self.session_start, 1e-9))
                if state["step_in_epoch"] == sched.steps_per_epoch[epoch]:
                    state["epoch"], state["step_in_epoch"] = epoch + 1, 0
                    self.evaluate("epoch")
                    self.save()
                else:
                    if a.eval_every and state["step"] % a.eval_every == 0:
                        self.evaluate("step")
                    if a.save_every and state["step"] % a.save_every == 0:
                        self.save()
                if a.stop_after and state["step"] >= a.stop_after:
                    self.bar.close()
                    log(f"stopping after step {state['step']} as asked (--stop-after), without a final save")
                    return False
                if a.signal_after and state["step"] == a.signal_after and rank == self.world - 1:
                    os.kill(os.getpid(), signal.SIGINT)  # the last rank only: a signal that reaches one rank first
                if stats[7] > 0:
                    # this rank's own signal, else the one another rank received (one rank: the sum is it)
                    self.stopped_by = stop.signum or (int(stats[7]) if int(stats[7]) in StopOnSignal.SIGNALS
                                                      else int(signal.SIGTERM))
                    if self.marks["save"] != state["step"]:
                        self.save()
                    self.bar.close()
                    return False
            if state["step"] >= sched.total_steps:
                break
        if self.marks["eval"] != state["step"]:  # stopped mid-epoch by --max-steps, or nothing left to run
            self.evaluate("end")
        if self.marks["save"] != state["step"]:
            self.save()
        self.bar.close()
        state["wall_time"] = self.wall_before + (time.perf_counter() - self.session_start)
        return True


def trim_log(path: Path, step: int) -> None:
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


def write_checksum(folder: Path, head: EagleHead, rank: int, step: int) -> None:
    import hashlib
    folder.mkdir(parents=True, exist_ok=True)
    sd = head.state_dict()
    digest = hashlib.sha256(b"".join(sd[k].detach().cpu().float().numpy().tobytes() for k in sorted(sd))).hexdigest()
    sums = {k: float(sd[k].double().sum()) for k in sorted(sd)}
    (folder / f"rank{rank}.json").write_text(json.dumps({"step": step, "sha256": digest, "sums": sums}))


def write_card(out: Path, state, data_desc, data_summary, ev, total_steps, args, weights, train_rows, held_rows,
               eval_rows, train_tokens, world, head_vocab=None) -> None:
    lines = [
        "# EAGLE draft head — training card", "",
        f"- Target: {args.model or 'default (SmolLM2-135M-Instruct)'}",
        f"- Head: {'EAGLE-3' if args.arch == 'eagle3' else 'EAGLE-1'}, {getattr(args, 'head_layers_used', 1)} decoder layer(s)",
        f"- Data: {data_desc}",
        f"- Loaded: {data_summary.removeprefix('data: ')}",
        # rows are records: a long chat split into parts is several, and the split keeps a chat's parts together
        f"- Split: {len(train_rows):,} train records ({train_tokens:,} tokens), {len(held_rows):,} held out "
        f"(fraction {args.held_out}, seed {split_seed(args)}); {len(eval_rows)} evaluated",
        f"- Steps: {state['step']:,} of {total_steps:,} ({args.epochs} epoch(s), {world} process(es) x grad-accum "
        f"{args.grad_accum}, <= {args.batch_tokens} padded tokens per micro-batch)",
        f"- Tokens seen: {state['tokens_seen']:,}",
        f"- Wall time: {state['wall_time'] / 60:.1f} min (all sessions)",
        (f"- Objective: EAGLE-3 training-time test: the head unrolled {args.ttt_steps} steps on its own outputs, "
         f"sum of {TTT_DECAY}^i x CE(target distribution) at step i; fused target layers "
         f"{getattr(args, 'aux_layers_used', '')}; "
         + (f"plus {args.eagle3_feature_weight} x SmoothL1(norm(output), target feature) at each step (not official); "
            if args.eagle3_feature_weight else "no feature loss, ") + "no noise"
         + ("; norm and lm_head started as the target's" if args.eagle3_output_init == "target"
            and not args.init_head else "") if args.arch == "eagle3" else
         f"- Objective: {weights[0]} x SmoothL1(feature) + {weights[1]} x CE(target distribution); "
         f"noise U(-{args.noise}, {args.noise}) (not length-scaled)"
         + (f"; at each of {args.ttt_steps} steps unrolled on the head's own features, step i weighing {TTT_DECAY}^i"
            if args.ttt_steps > 1 else "")),
        ("- Draft vocabulary: the whole vocabulary" if head_vocab is None else
         f"- Draft vocabulary: {head_vocab[0]:,} "
         + (f"tokens of the initial head ({args.init_head})" if args.init_head else "most frequent assistant tokens")
         + f" (covering {head_vocab[1]:.1%} of the training data's assistant tokens)"),
        *([f"- Initial weights: {args.init_head} (fine-tuned)"] if args.init_head else []),
        f"- Optimiser: AdamW lr {args.lr}" + (f" (grown layers: {args.grown_lr})" if args.grown_lr is not None else "")
        + f", betas (0.9, 0.95), weight decay {args.weight_decay}, warm-up "
        f"{args.warmup_steps} steps then linear decay; clip by {args.clip_mode} {args.clip}",
        "", "## Held-out accuracy (against the target's argmax)", "",
    ]
    if ev:
        lines += [f"Measured at step {ev['step']} on {ev['tokens']:,} assistant positions.", "",
                  "| top-1 | top-3 | " + " | ".join(f"top-1 at depth {k}" for k in range(2, EVAL_DEPTHS + 1)) + " | loss |",
                  "|---|---|" + "---|" * (EVAL_DEPTHS - 1) + "---|",
                  f"| {ev['top1']:.3f} | {ev['top3']:.3f} | "
                  + " | ".join(f"{ev[f'top1_depth{k}']:.3f}" for k in range(2, EVAL_DEPTHS + 1)) + f" | {ev['loss']:.4f} |",
                  "", "Depth k: the head drafts k steps from a true feature, fed its own predicted features and the "
                  "real tokens; its k-th prediction is compared with the target's argmax there."]
    else:
        lines.append("No held-out evaluation (no held-out conversations).")
    lines += ["", "## Command(s)", ""] + [f"    {c}" for c in state["commands"]]
    (out / "card.md").write_text("\n".join(lines) + "\n")
