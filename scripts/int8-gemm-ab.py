"""The GGUF-block kernels, exact (fp32 activations) against int8 activations, interleaved, over all 121
linears of the default model's shapes (random weights through llama.cpp's quantizers): ms for all 121.

    python scripts/int8-gemm-ab.py ROWS REPS       e.g. 1,2,4,8,12,16,24,32 9
    python scripts/int8-gemm-ab.py ROWS REPS REV   the int8 kernel of git revision REV (its own packing, built
                                                   as eaglespec_old) against the working tree's, results compared
    python scripts/int8-gemm-ab.py ROWS REPS hugepages   the int8 kernel on weights on 4 KiB pages against the same
                                                   weights moved onto 2 MiB pages (cpugemm.onto_huge_pages)
    PAUSE=PID stops a background job while it times.
"""
import os
import signal
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


def old_module(rev: str):
    """eaglespec/cpugemm.py of `rev`, its ops registered as torch.ops.eaglespec_old (built into the cache)."""
    import importlib.util
    import subprocess
    import tempfile
    src = subprocess.run(["git", "show", f"{rev}:eaglespec/cpugemm.py"], capture_output=True, text=True, check=True).stdout
    src = (src.replace("TORCH_LIBRARY(eaglespec,", "TORCH_LIBRARY(eaglespec_old,")
           .replace("TORCH_LIBRARY_IMPL(eaglespec,", "TORCH_LIBRARY_IMPL(eaglespec_old,")
           .replace("torch.ops.eaglespec.", "torch.ops.eaglespec_old.").replace('"eaglespec::', '"eaglespec_old::')
           .replace('f"eaglespec_cpugemm_{tag}"', 'f"eaglespec_old_cpugemm_{tag}"').replace("from .", "from eaglespec."))
    path = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    path.write(src)
    path.close()
    spec = importlib.util.spec_from_file_location("cpugemm_old", path.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.why_unavailable() is None
    return mod


ws = [exact_blocks(torch.randn(n, k) * 0.02, i == len(shapes) - 1) for i, (n, k) in enumerate(shapes)]
if len(sys.argv) > 3 and sys.argv[3] == "hugepages":
    small = [cpugemm.quant_pack(w, int8=True) for w in ws]
    holders = [torch.nn.Module() for _ in small]
    for h, (_, p) in zip(holders, small):
        h.packed = p  # onto_huge_pages copies it and rebinds h.packed; `small` keeps the 4 KiB original
    assert cpugemm.onto_huge_pages([(h, "packed") for h in holders])
    packs = {"4k": small, "2M": [(kind, h.packed) for (kind, _), h in zip(small, holders)]}
    assert all(torch.equal(a[1], b[1]) for a, b in zip(packs["4k"], packs["2M"]))
    ops = {v: torch.ops.eaglespec.quant_mm for v in packs}
elif len(sys.argv) > 3:  # int8 of REV against int8 of the working tree
    old = old_module(sys.argv[3])
    packs = {"old": [old.quant_pack(w, int8=True) for w in ws], "new": [cpugemm.quant_pack(w, int8=True) for w in ws]}
    ops = {"old": torch.ops.eaglespec_old.quant_mm, "new": torch.ops.eaglespec.quant_mm}
    x = torch.randn(5, 576)
    same = all(torch.equal(ops["old"](x, po[1], n, po[0]), ops["new"](x, pn[1], n, pn[0]))
               for (n, k), po, pn in zip(shapes[:3] + shapes[-1:], packs["old"][:3] + packs["old"][-1:],
                                         packs["new"][:3] + packs["new"][-1:]))
    print("same results as", sys.argv[3], ":", same, flush=True)
else:
    packs = {v: [cpugemm.quant_pack(w, int8=(v == "int8")) for w in ws] for v in ("exact", "int8")}
    ops = {v: torch.ops.eaglespec.quant_mm for v in packs}
rows = [int(a) for a in sys.argv[1].split(",")]
xs = {M: {k: torch.randn(M, k) for k in (576, 1536)} for M in rows}
res = {(v, M): [] for v in packs for M in rows}
pause = int(os.environ.get("PAUSE", 0))
if pause:
    os.kill(pause, signal.SIGSTOP)
try:
    for rep in range(int(sys.argv[2])):
        for M in rows:
            for v, pk in (packs.items() if rep % 2 else list(packs.items())[::-1]):  # the order alternates
                t = time.perf_counter()
                op = ops[v]
                for (n, k), (kind, p) in zip(shapes, pk):
                    op(xs[M][k], p, n, kind)
                res[(v, M)].append((time.perf_counter() - t) * 1e3)
finally:
    if pause:
        os.kill(pause, signal.SIGCONT)
print("rows | " + " | ".join(map(str, rows)))
for v in packs:
    med = {M: statistics.median(res[(v, M)]) for M in rows}
    print(f"{v:5s} ms | " + " | ".join(f"{med[M]:.1f}" for M in rows),
          "| ratio to 1 row:", " ".join(f"{med[M] / med[rows[0]]:.2f}" for M in rows), flush=True)
