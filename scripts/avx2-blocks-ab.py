"""The AVX2 path on GGUF blocks: the default model's 121 linears (random weights rounded to Q4_1 blocks, the LM
head to Q8_0, as its GGUF file holds them) on 8-column fp32 panels (packed_mm) against the same weights as
8-column blocks (quant_mm8 with every row on the blocks), interleaved, medians in ms; bit-identity checked
first. Runs on any CPU with the packed kernel (AVX2 or AVX-512: the 8-column kernels are AVX2 code either way).
Run it quiet. Its table picks EAGLESPEC_CPU_QUANT_ROWS: the most rows at which the blocks still win.

    python scripts/avx2-blocks-ab.py [ROWS] [REPS]      e.g. 1,2,3,4,5,6,8,16 9
"""
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from eaglespec import cpugemm  # noqa: E402
from tests.test_cpugemm import gguf_q4_1, gguf_q8_0  # noqa: E402

assert cpugemm.why_unavailable() is None, cpugemm.why_unavailable()
rows = [int(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "1,2,3,4,5,6,8,16").split(",")]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 9
torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
layers = []
for i, (n, k) in enumerate(shapes):
    w = (gguf_q8_0 if i == len(shapes) - 1 else gguf_q4_1)(torch.randn(n, k) * 0.02)
    kind, blocks = cpugemm.quant_pack(w, width=8)
    layers.append((n, kind, blocks, torch.ops.eaglespec.packed_pack(w, 8)))
print(f"blocks {sum(b.numel() for _, _, b, _ in layers) / 2**20:.0f} MiB, "
      f"fp32 panels {sum(p.numel() * 4 for *_, p in layers) / 2**20:.0f} MiB", flush=True)
xs = {m: {k: torch.randn(m, k) for k in (576, 1536)} for m in rows}
for m in rows:
    for n, kind, b, p in layers[:4] + layers[-1:]:
        x = xs[m][p.shape[1]]
        assert torch.equal(torch.ops.eaglespec.quant_mm8(x, b, p, n, kind, 8 if m <= 8 else 0),
                           torch.ops.eaglespec.packed_mm(x, p, n)), m
print("bit-identical", flush=True)


def run(m, blocks):
    t = time.perf_counter()
    for n, kind, b, p in layers:
        x = xs[m][p.shape[1]]
        if blocks:
            torch.ops.eaglespec.quant_mm8(x, b, p, n, kind, 8)
        else:
            torch.ops.eaglespec.packed_mm(x, p, n)
    return (time.perf_counter() - t) * 1e3


times = {(m, b): [] for m in rows for b in (False, True)}
for _ in range(reps):
    for m in rows:
        for b in (False, True) if _ % 2 == 0 else (True, False):
            run(m, b and m <= 8)
            times[(m, b)].append(run(m, b and m <= 8))
print("rows  fp32 panels  blocks  (ms, medians of %d)" % reps)
for m in rows:
    f, q = statistics.median(times[(m, False)]), statistics.median(times[(m, True)])
    print(f"{m:4d}  {f:10.2f}  {q:7.2f}" + ("  (more than 8 rows always read the fp32 panels)" if m > 8 else f"  {f / q:.2f}x"))
