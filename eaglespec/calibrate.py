"""`eaglespec calibrate`: measure what verification and drafting cost on this machine.

Prints T(n), the time to verify n tree tokens (root included; n = 1 is one plain decoding step), its
ratio to T(1), and the draft head's cost per depth. The table is what the `auto` tree policy sizes
trees with (costmodel.py); it is cached under ~/.cache/eaglespec/calibration per (model, device,
dtype, torch version, threads, mode), so later runs and `--tree-size auto` reuse it.
"""
from __future__ import annotations

import json
import sys

from .cli import add_engine_args, build_engine


def add_cli(sub) -> None:
    p = sub.add_parser("calibrate", help="measure verification cost T(n) and draft cost on this machine (cached)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated tree sizes n to time (default: 1,2,3,4,6,8,12,16,24,32)")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per size; the median is kept")
    p.add_argument("--context", type=int, default=256, help="cached prefix length the calls run after (tokens)")
    p.add_argument("--json", action="store_true", help="print the table as one JSON object")
    add_engine_args(p)
    p.set_defaults(func=run_calibrate)


def parse_sizes(text: str | None) -> tuple[int, ...]:
    from .costmodel import CALIBRATION_SIZES
    if text is None:
        return CALIBRATION_SIZES
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"--sizes must be comma-separated integers, got '{text}'") from None
    if not sizes or sizes[0] < 1:
        raise ValueError("--sizes must be integers >= 1")
    return tuple(sorted(set(sizes) | {1}))  # T(1) is the unit every ratio is taken against


def format_table(table) -> str:
    base = table.t_verify(1)
    fused, sampled = table.fused_verify_ms, table.sampled_fused_ms
    lines = ["   n   T(n) ms   T(n)/T(1)" + ("   with catch-up ms   /T(1)" if fused else "")
             + ("   sampled, with catch-up ms   /T(1)" if sampled else "")]
    lines += [f"{n:>4} {ms:>9.2f} {ms / base:>11.2f}"
              + (f" {fused[n]:>18.2f} {fused[n] / base:>7.2f}" if n in fused else " " * 26 if fused else "")
              + (f" {sampled[n]:>27.2f} {sampled[n] / base:>7.2f}" if n in sampled else "")
              for n, ms in sorted(table.verify_ms.items())]
    if table.draft_first_ms:
        lines.append(f"draft: catch-up + depth 1 {table.draft_first_ms:.2f} ms ({table.draft_first_ms / base:.2f} steps), "
                     f"each further depth {table.draft_step_ms:.2f} ms ({table.draft_step_ms / base:.2f} steps)")
    key = table.key
    if fused or sampled:
        lines.append("with catch-up: rounds verify with the head's catch-up and depth 1 in the same call (sampled: "
                     "and the rejection sampling)")
    lines.append(f"({key.get('device')} {key.get('dtype')}, {key.get('mode')}, torch {key.get('torch')}, "
                 f"{key.get('threads')} threads, {key.get('gemm', 'torch')} GEMM)")
    return "\n".join(lines)


def run_calibrate(args) -> int:
    from . import costmodel
    sizes = parse_sizes(args.sizes)
    if args.reps < 1 or args.context < 1:
        raise ValueError("--reps and --context must be >= 1")
    engine = build_engine(args)
    if args.context + max(sizes) >= engine.max_context:
        raise ValueError(f"--context {args.context} plus n={max(sizes)} does not fit the context of {engine.max_context}")
    table = costmodel.measure(engine, sizes, reps=args.reps, context=args.context,
                              progress=None if args.json else lambda s: print(f"timing {s}", file=sys.stderr))
    path = costmodel.save_table(table)
    if args.json:
        print(json.dumps({**table.to_json(), "cache": str(path)}))
    else:
        print(format_table(table))
        print(f"cached in {path}", file=sys.stderr)
    return 0
