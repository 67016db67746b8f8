"""cpugemm's attention kernel of a git revision (built as eaglespec_old) against the working tree's, interleaved:
one layer of the default model's shape (9 query heads on 3 KV heads, head_dim 64) at the calls that decoding,
verification and batched regeneration make. Agreement with the old kernel is printed (max abs difference).

    python scripts/attention-kernel-ab.py REPS [REV]
"""
import hashlib, re, statistics, subprocess, sys, time
import torch
from torch.utils import cpp_extension
from eaglespec import cpugemm
from eaglespec.loading import cache_root

rev = sys.argv[2] if len(sys.argv) > 2 else "HEAD"
old_py = subprocess.run(["git", "show", f"{rev}:eaglespec/cpugemm.py"], capture_output=True, text=True, check=True).stdout
src = re.search(r'_SOURCE = r"""(.*?)"""', old_py, re.S).group(1)
src = src.replace("TORCH_LIBRARY(eaglespec,", "TORCH_LIBRARY(eaglespec_old,").replace("TORCH_LIBRARY_IMPL(eaglespec,", "TORCH_LIBRARY_IMPL(eaglespec_old,")
tag = hashlib.sha256(src.encode()).hexdigest()[:10]
b = cache_root() / "ext" / f"ab_old_{tag}"
b.mkdir(parents=True, exist_ok=True)
(b / "x.cpp").write_text(src)
cpp_extension.load(f"ab_old_{tag}", [str(b / "x.cpp")], build_directory=str(b), extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                   extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
assert cpugemm.why_unavailable() is None
torch.manual_seed(0)


def case(bsz, t, cache, ctx):
    """bsz sequences, t query rows each (a tree: prefix + random ancestors), a cache of `cache` slots, ctx shown."""
    k = torch.randn(bsz, 3, cache, 64)
    v = torch.randn(bsz, 3, cache, 64)
    q = torch.randn(bsz, t, 9, 64).transpose(1, 2)
    mask = torch.zeros(bsz, 1, t, cache, dtype=torch.bool)
    for i in range(bsz):
        c = ctx if bsz == 1 else int(torch.randint(ctx // 2, ctx + 1, ()))
        mask[i, 0, :, :c] = True
        mask[i, 0, :, c:c + t] = (torch.rand(t, t) < 0.5).tril() | torch.eye(t, dtype=torch.bool)
    return q, k, v, mask


cases = {"decode ctx 256": case(1, 1, 1024, 256), "verify 4, ctx 256": case(1, 4, 1024, 256),
         "verify 16, ctx 256": case(1, 16, 1024, 256), "decode ctx 900": case(1, 1, 1024, 900),
         "verify 16, ctx 900": case(1, 16, 1024, 900), "regenerate 32 x 1, ctx <= 600": case(32, 1, 1024, 600)}
ops = {"old": torch.ops.eaglespec_old.small_attention, "new": torch.ops.eaglespec.small_attention}
for name, (q, k, v, m) in cases.items():
    d = (ops["old"](q, k, v, m, 0.125) - ops["new"](q, k, v, m, 0.125)).abs().max().item()
    print(f"{name}: max |old - new| = {d:.2e}", flush=True)
res = {(o, c): [] for o in ops for c in cases}
for _ in range(int(sys.argv[1])):
    for c, (q, k, v, m) in cases.items():
        for o, op in ops.items():
            t0 = time.perf_counter()
            for _ in range(30):  # one call a layer
                op(q, k, v, m, 0.125)
            res[(o, c)].append((time.perf_counter() - t0) * 1e3)
print("case | old ms (30 layers, fastest repetition) | new ms | new / old")
for c in cases:
    a, n = min(res[("old", c)]), min(res[("new", c)])  # the fastest repetition: this host stalls a whole call now and then (4-8 ms, seen for either kernel)
    print(f"{c} | {a:.2f} | {n:.2f} | {n / a:.2f}")
