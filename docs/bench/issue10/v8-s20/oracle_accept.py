"""The ceiling a perfect draft would reach on a text: the target's own depth-1 acceptance at T = 1.

For each assistant position, with p the target's next-token distribution: E[max p] (one deterministic candidate,
accepted with p(x) as `verify` does) and E[top-3 mass of p] (three candidates); both over the whole vocabulary and
over the shipped head's 8,192-token draft vocabulary. Compare with `eaglespec evaluate`'s accept_t1_top1 / _top3.

    .venv/bin/python docs/bench/issue10/v8-s20/oracle_accept.py DATA [DATA ...]
"""
import argparse
import sys

import torch

from eaglespec.features import load_examples, load_model, target_features
from eaglespec.head import load_head
from eaglespec.train import expected_acceptance, shift_inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data", nargs="+")
    ap.add_argument("--head", default="heads/smollm2-135m-instruct-v6")
    ap.add_argument("--max-conversations", type=int, default=None)
    a = ap.parse_args()
    target, tokenizer, _ = load_model(argparse.Namespace(model=None, gguf_file=None, device=None, dtype=None))
    full = target.lm_head.weight
    ids_draft = load_head(a.head, target.args).draft_ids
    for data in a.data:
        examples, _ = load_examples(tokenizer, data, a.max_conversations, 1024, log=lambda *x: None)
        sums, n = torch.zeros(2, 3, dtype=torch.float64), 0
        for e in examples:
            ids, amask = torch.tensor([e.ids]), torch.tensor([e.mask])
            with torch.no_grad():
                feats = target_features(target, ids, None).float()
            _, counted, tgt = shift_inputs(ids, amask, feats)
            t = tgt[counted.bool()]
            sums[0] += expected_acceptance(t, t, full)
            sums[1] += expected_acceptance(t, t, full[ids_draft].contiguous(), ids_draft, full)
            n += t.shape[0]
        r = (sums / max(n, 1)).tolist()
        print(f"{data}: {len(examples)} conversations, {n:,} positions; perfect draft at T=1: "
              f"top-1 {r[0][1]:.3f}, top-3 {r[0][2]:.3f} (whole vocabulary); "
              f"top-1 {r[1][1]:.3f}, top-3 {r[1][2]:.3f} (draft vocabulary)")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
