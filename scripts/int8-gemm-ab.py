"""The GGUF-block kernels, exact (fp32 activations) against int8 activations, interleaved, over all 121
linears of the default model's shapes (random weights through llama.cpp's quantizers): ms for all 121.

    python scripts/int8-gemm-ab.py ROWS REPS       e.g. 1,2,4,8,12,16,24,32 9
"""
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from eaglespec import cpugemm  # noqa: E402

assert cpugemm.why_unavailable() is None and bool(torch.ops.eaglespec.cpu_has_vnni())
torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def exact_blocks(w, last):
    n, k = w.shape
    b = w.reshape(n, k // 32, 32)
    if last:
        return cpugemm.q8_0_round(w)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d, m = ((hi - lo) / 15).half().float(), lo.half().float()
    return (d * ((b - lo) / d).round().clamp(0, 15) + m).reshape(n, k)


ws = [exact_blocks(torch.randn(n, k) * 0.02, i == len(shapes) - 1) for i, (n, k) in enumerate(shapes)]
packs = {v: [cpugemm.quant_pack(w, int8=(v == "int8")) for w in ws] for v in ("exact", "int8")}
rows = [int(a) for a in sys.argv[1].split(",")]
xs = {M: {k: torch.randn(M, k) for k in (576, 1536)} for M in rows}
res = {(v, M): [] for v in packs for M in rows}
for rep in range(int(sys.argv[2])):
    for M in rows:
        for v, pk in packs.items():
            t = time.perf_counter()
            for (n, k), (kind, p) in zip(shapes, pk):
                torch.ops.eaglespec.quant_mm(xs[M][k], p, n, kind)
            res[(v, M)].append((time.perf_counter() - t) * 1e3)
print("rows | " + " | ".join(map(str, rows)))
for v in packs:
    med = {M: statistics.median(res[(v, M)]) for M in rows}
    print(f"{v:5s} ms | " + " | ".join(f"{med[M]:.1f}" for M in rows),
          "| ratio to 1 row:", " ".join(f"{med[M] / med[rows[0]]:.2f}" for M in rows), flush=True)
