"""The few-row GEMM of a git revision (built as eaglespec_old) against the working tree's, interleaved, over
all 121 linears of the default model's shapes (random weights); bit-identity checked first.

    python scripts/gemm-ab.py ROWS REPS [REV]      e.g. 1,2,4,8,12,16,24,32 9 HEAD
    W=8 ...        the 8-column AVX2 kernel instead of the AVX-512 one
    NOCHECK=1 ...  skip the identity check (a change that reorders the sums on purpose)
    QUANT=1 ...    the GGUF-block kernel (quant_mm) on Q4_1 weights and a Q8_0 LM head, as the default model's
"""
import sys, time, statistics, hashlib, subprocess, pathlib, re
import torch
from torch.utils import cpp_extension
sys.path.insert(0, '.')
from eaglespec import cpugemm
old_py = subprocess.run(["git", "show", f"{sys.argv[3] if len(sys.argv) > 3 else 'HEAD'}:eaglespec/cpugemm.py"], capture_output=True, text=True, check=True).stdout
old_src = re.search(r'_SOURCE = r"""(.*?)"""', old_py, re.S).group(1)
old_src = old_src.replace("TORCH_LIBRARY(eaglespec,", "TORCH_LIBRARY(eaglespec_old,").replace("TORCH_LIBRARY_IMPL(eaglespec,", "TORCH_LIBRARY_IMPL(eaglespec_old,")
tag = hashlib.sha256(old_src.encode()).hexdigest()[:10]
from eaglespec.loading import cache_root; b = cache_root() / "ext" / f"ab_old_{tag}"; b.mkdir(parents=True, exist_ok=True); (b / "x.cpp").write_text(old_src)
cpp_extension.load(f"old_{tag}", [str(b / "x.cpp")], build_directory=str(b), extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
assert cpugemm.why_unavailable() is None
torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
import os; W = int(os.environ.get("W", "16"))
QUANT = os.environ.get("QUANT") == "1"


def exact_blocks(w, last):
    """w through llama.cpp's quantizer and gguf-py's dequantizer: Q4_1, or Q8_0 for the LM head."""
    n, k = w.shape
    b = w.reshape(n, k // 32, 32)
    if last:
        d = (b.abs().amax(-1, keepdim=True) / 127).half().float()
        return ((b / d).round().clamp(-128, 127) * d).reshape(n, k)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d, m = ((hi - lo) / 15).half().float(), lo.half().float()
    return (d * ((b - lo) / d).round().clamp(0, 15) + m).reshape(n, k)


if QUANT:
    packs = [cpugemm.quant_pack(exact_blocks(torch.randn(n, k) * 0.02, i == len(shapes) - 1)) for i, (n, k) in enumerate(shapes)]
    assert all(q is not None for q in packs)
    ws = [q[1] for q in packs]
    kinds = [q[0] for q in packs]
else:
    ws = [torch.ops.eaglespec.packed_pack(torch.randn(n, k) * 0.02, W) for n, k in shapes]
rows = [int(a) for a in sys.argv[1].split(",")]
xs = {M: {k: torch.randn(M, k) for k in (576, 1536)} for M in rows}
for M in ([] if os.environ.get("NOCHECK") else sorted(set(rows) | {9, 23, 25, 47, 49, 100, 300})):
    for (n, k), w in list(zip(shapes, ws))[:4] + [(shapes[-1], ws[-1])]:
        x = torch.randn(M, k)
        if QUANT:
            kind = 8 if n == shapes[-1][0] else 4
            assert torch.equal(torch.ops.eaglespec.quant_mm(x, w, n, kind), torch.ops.eaglespec_old.quant_mm(x, w, n, kind)), (M, n, k)
        else:
            assert torch.equal(torch.ops.eaglespec.packed_mm(x, w, n), torch.ops.eaglespec_old.packed_mm(x, w, n)), (M, n, k)
print("bit-identical to the old kernel", flush=True)
if QUANT:
    ops = {v: (lambda ns: (lambda x, w, n: ns.quant_mm(x, w, n, 8 if n == shapes[-1][0] else 4)))(ns)
           for v, ns in (("old", torch.ops.eaglespec_old), ("new", torch.ops.eaglespec))}
else:
    ops = {"old": torch.ops.eaglespec_old.packed_mm, "new": torch.ops.eaglespec.packed_mm}
res = {(v, M): [] for v in ops for M in rows}
for rep in range(int(sys.argv[2])):
    for M in rows:
        for v, op in ops.items():
            t = time.perf_counter()
            for (n, k), w in zip(shapes, ws):
                op(xs[M][k], w, n)
            res[(v, M)].append((time.perf_counter() - t) * 1e3)
print("rows | " + " | ".join(map(str, rows)))
for v in ops:
    med = {M: statistics.median(res[(v, M)]) for M in rows}
    print(v, "ms | " + " | ".join(f"{med[M]:.1f}" for M in rows), "| ratio to 1 row:", " ".join(f"{med[M] / med[rows[0]]:.2f}" for M in rows), flush=True)
