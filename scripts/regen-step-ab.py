"""Batched regeneration's decoding step (`regenerate.BatchDecoder.step`, eager, the default model) at several
batch sizes and weight settings, interleaved: ms a step and tokens/s at contexts of 300-500 tokens, and each
batch size against one row of the same setting. Every other process should be stopped meanwhile.

    python scripts/regen-step-ab.py [ROWS] [REPS]     e.g. 1,8,16,32,64 7; MODES=int8,1,0 (EAGLESPEC_CPU_QUANT)
"""
import os
import statistics
import sys
import time

import torch

from eaglespec.loading import load_target
from eaglespec.regenerate import BatchDecoder

rows = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,8,16,32,64").split(",")]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
modes = os.environ.get("MODES", "int8,1,0").split(",")
torch.manual_seed(0)
lengths = [300 + 200 * r // max(rows) for r in range(max(rows))]  # each row a context of its own, 300-500 tokens
prompts = [torch.randint(0, 49152, (n,)).tolist() for n in lengths]
decoders = {}
for mode in modes:
    os.environ["EAGLESPEC_CPU_QUANT"] = mode
    model, _ = load_target(None)
    for n in rows:  # a decoder of n rows per batch size: a step always runs all of its decoder's rows
        dec = BatchDecoder(model, n, 1024)
        for r in range(n):
            dec.prefill(r, prompts[r], 0)
        decoders[(mode, n)] = dec
times = {(m, n): [] for m in modes for n in rows}
with torch.inference_mode():
    for rep in range(reps):
        for n in rows:
            for m in (modes if rep % 2 == 0 else modes[::-1]):
                toks = torch.randint(0, 49152, (n,)).tolist()
                t = time.perf_counter()
                decoders[(m, n)].step(list(range(n)), toks, lengths[:n])
                times[(m, n)].append((time.perf_counter() - t) * 1e3)
print("rows | " + " | ".join(f"{m} ms a step (tok/s, vs 1 row)" for m in modes))
for n in rows:
    cells = []
    for m in modes:
        ms = statistics.median(times[(m, n)])
        one = statistics.median(times[(m, rows[0])]) / rows[0]
        cells.append(f"{ms:.1f} ({n / ms * 1e3:.0f}, {n / ms / (1 / one):.1f}x)")
    print(f"{n} | " + " | ".join(cells), flush=True)
