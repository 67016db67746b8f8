"""A few-row fp32 GEMM for x86 CPUs, for verifying a draft tree at close to the cost of one token.

Why: verification multiplies 1-32 rows by every weight of the target. With so few rows the weights
stream from memory once and the arithmetic is small, so n rows should cost about what one row costs
until the FMA units saturate (`../shared/design/cpu-notes.md`). Neither backend we had gets there:
MKL repacks the weight every call, and inductor's C++ GEMM template re-reads each weight panel once
per small block of rows. This kernel packs each weight once into 8-column panels ([N/8, K, 8]). Up to
8 rows run in registers over one streamed pass of each panel, prefetching the next panel meanwhile.
Above 8 rows it works on pairs of panels (6 rows x 16 columns in registers: two FMAs per broadcast)
in passes over a pair that is then in cache; pairs measured 10-17 % faster there and 5 % slower at 8.

It is a torch custom op (`torch.ops.eaglespec.packed_mm`), so torch.compile treats it as one opaque
call and it works eagerly the same. Built once per machine with torch's C++ extension loader into the
eaglespec cache (about 20 s); where it cannot be built (no compiler, no AVX2/FMA, not x86) the engine
keeps nn.Linear, with one line saying so. The engine runs its target, its draft head and the draft
LM-head rows on it (CPU, fp32). With every GEMM ours, its compiled graphs skip inductor's freezing,
which was there to prepack inductor's own GEMMs: a new process then loads each graph from the FX
graph cache in ~4 s instead of ~10 s.
"""
from __future__ import annotations

import hashlib
import os
import platform

import torch
from torch import nn

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>

namespace {
constexpr int NR = 8;  // columns per panel: one ymm register

at::Tensor pack(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat && w_in.device().is_cpu(),
              "packed_pack: a 2-D fp32 CPU weight");
  auto w = w_in.contiguous();
  int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  auto out = at::zeros({P, K, NR}, w.options());
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) op[(p * K + k) * NR + j] = wp[(p * NR + j) * K + k];
  });
  return out;
}

// y[MR, <=8] = x[MR, K] @ panel[K, 8], prefetching lines [pf_lo, pf_hi) of the next panel while at it.
// Accumulators are named variables so that they stay in registers (an array was spilled to the stack
// every iteration); with MR <= 4 a second set takes every other k, to hide the FMA latency.
#define FMA_ROWS(acc, wv, kk)                                                                            \
  if constexpr (MR > 0) acc##0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + 0 * ldx + (kk)), wv, acc##0); \
  if constexpr (MR > 1) acc##1 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + 1 * ldx + (kk)), wv, acc##1); \
  if constexpr (MR > 2) acc##2 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + 2 * ldx + (kk)), wv, acc##2); \
  if constexpr (MR > 3) acc##3 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + 3 * ldx + (kk)), wv, acc##3); \
  if constexpr (MR > 4) acc##4 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + 4 * ldx + (kk)), wv, acc##4); \
  if constexpr (MR > 5) acc##5 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + 5 * ldx + (kk)), wv, acc##5); \
  if constexpr (MR > 6) acc##6 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + 6 * ldx + (kk)), wv, acc##6); \
  if constexpr (MR > 7) acc##7 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + 7 * ldx + (kk)), wv, acc##7);

template <int MR>
void micro(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K,
           float* __restrict y, int64_t ldy, int ncols, const char* next, int64_t pf_lo, int64_t pf_hi) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;  // b4-b7 unused, but named
  constexpr bool TWO = MR <= 4;
  int64_t lines = pf_hi - pf_lo;
  int64_t step = lines > 0 ? std::max<int64_t>(2, K / lines) : K + 1;
  int64_t count = 0, pf = pf_lo;
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    if (next && pf < pf_hi && (count -= 2) <= 0) { _mm_prefetch(next + pf * 64, _MM_HINT_T0); ++pf; count += step; }
    __m256 w0 = _mm256_loadu_ps(w + k * NR), w1 = _mm256_loadu_ps(w + (k + 1) * NR);
    FMA_ROWS(a, w0, k)
    if constexpr (TWO) { FMA_ROWS(b, w1, k + 1) } else { FMA_ROWS(a, w1, k + 1) }
  }
  for (; k < K; ++k) {
    __m256 w0 = _mm256_loadu_ps(w + k * NR);
    FMA_ROWS(a, w0, k)
  }
  for (; next && pf < pf_hi; ++pf) _mm_prefetch(next + pf * 64, _MM_HINT_T0);
  __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
  if constexpr (TWO) {
    __m256 bb[4] = {b0, b1, b2, b3};
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_add_ps(acc[m], bb[m]);
  }
  if (ncols == NR) {
    for (int m = 0; m < MR; ++m) _mm256_storeu_ps(y + m * ldy, acc[m]);
  } else {
    alignas(32) float tmp[NR];
    for (int m = 0; m < MR; ++m) {
      _mm256_store_ps(tmp, acc[m]);
      for (int j = 0; j < ncols; ++j) y[m * ldy + j] = tmp[j];
    }
  }
}

using Micro = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int, const char*, int64_t, int64_t);
const Micro kernels[9] = {nullptr, micro<1>, micro<2>, micro<3>, micro<4>, micro<5>, micro<6>, micro<7>, micro<8>};

#define FMA2(m)                                                                                   \
  if constexpr (MR > m) {                                                                         \
    __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);                                             \
    c##m##0 = _mm256_fmadd_ps(xb, w0, c##m##0); c##m##1 = _mm256_fmadd_ps(xb, w1, c##m##1);       \
  }
// y[MR, 16] = x[MR, K] @ [panel0 | panel1]: 2*MR accumulators (12 at MR = 6), two weight registers and
// one broadcast; 2 FMAs per broadcast load instead of 1 (the 8-column kernel) leaves the FMA units,
// not the load ports and FMA latency, as the limit at 5-16 rows.
template <int MR>
void micro2(const float* __restrict x, int64_t ldx, const float* __restrict p0, const float* __restrict p1,
            int64_t K, float* __restrict y, int64_t ldy, int ncols, const char* next, int64_t pf_lo, int64_t pf_hi) {
  __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
  int64_t lines = pf_hi - pf_lo;
  int64_t step = lines > 0 ? std::max<int64_t>(1, K / lines) : K + 1;
  int64_t count = 0, pf = pf_lo;
  for (int64_t k = 0; k < K; ++k) {
    if (next && pf < pf_hi && --count <= 0) { _mm_prefetch(next + pf * 64, _MM_HINT_T0); ++pf; count += step; }
    __m256 w0 = _mm256_loadu_ps(p0 + k * NR), w1 = _mm256_loadu_ps(p1 + k * NR);
    FMA2(0) FMA2(1) FMA2(2) FMA2(3) FMA2(4) FMA2(5)
  }
  for (; next && pf < pf_hi; ++pf) _mm_prefetch(next + pf * 64, _MM_HINT_T0);
  __m256 acc[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  if (ncols == 2 * NR) {
    for (int m = 0; m < MR; ++m) { _mm256_storeu_ps(y + m * ldy, acc[2 * m]); _mm256_storeu_ps(y + m * ldy + NR, acc[2 * m + 1]); }
  } else {
    alignas(32) float tmp[2 * NR];
    for (int m = 0; m < MR; ++m) {
      _mm256_store_ps(tmp, acc[2 * m]); _mm256_store_ps(tmp + NR, acc[2 * m + 1]);
      for (int j = 0; j < ncols; ++j) y[m * ldy + j] = tmp[j];
    }
  }
}
using Micro2 = void (*)(const float*, int64_t, const float*, const float*, int64_t, float*, int64_t, int, const char*, int64_t, int64_t);
const Micro2 kernels2[7] = {nullptr, micro2<1>, micro2<2>, micro2<3>, micro2<4>, micro2<5>, micro2<6>};

at::Tensor packed_mm(const at::Tensor& x_in, const at::Tensor& wp_in, int64_t N) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && wp_in.scalar_type() == at::kFloat, "packed_mm: fp32 only");
  TORCH_CHECK(wp_in.dim() == 3 && wp_in.size(2) == NR && wp_in.size(0) * NR >= N && wp_in.size(0) * NR < N + NR,
              "packed_mm: weight is not packed for ", N, " outputs");
  int64_t K = wp_in.size(1);
  TORCH_CHECK(x_in.size(-1) == K, "packed_mm: input has ", x_in.size(-1), " features, weight ", K);
  auto x = x_in.reshape({-1, K}).contiguous();
  auto wp = wp_in.contiguous();
  int64_t M = x.size(0), P = wp.size(0);
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(sizes);
  const float* xp = x.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M > 8) {
    // 9+ rows: pairs of panels (16 columns) in passes of at most 6 rows (balanced). The first pass
    // streams the pair from memory, the others read it from cache, and each prefetches its share of
    // the next pair, so that memory stays busy while the later passes compute.
    int64_t Q = (P + 1) / 2;
    int64_t J = (M + 5) / 6;
    int64_t lines = (2 * K * NR * 4 + 63) / 64;
    int64_t grain = std::max<int64_t>(1, 65536 / (2 * K * NR * 4 * J));
    at::parallel_for(0, Q, grain, [&](int64_t q0, int64_t q1) {
      for (int64_t q = q0; q < q1; ++q) {
        int64_t p = 2 * q;
        const float* pa = w + p * K * NR;
        int nc = (int)std::min<int64_t>(2 * NR, N - p * NR);
        if (nc <= NR) {  // a last, single panel
          int64_t m = 0;
          for (int64_t j = 0; j < (M + 7) / 8; ++j) {
            int64_t r = (M - m) / ((M + 7) / 8 - j);
            kernels[r](xp + m * K, K, pa, K, yp + m * N + p * NR, N, nc, nullptr, 0, 0);
            m += r;
          }
          continue;
        }
        const char* next = q + 1 < q1 ? (const char*)(pa + 2 * K * NR) : nullptr;
        int64_t m = 0;
        for (int64_t j = 0; j < J; ++j) {
          int64_t r = (M - m) / (J - j);
          kernels2[r](xp + m * K, K, pa, pa + K * NR, K, yp + m * N + p * NR, N, nc, next, lines * j / J, lines * (j + 1) / J);
          m += r;
        }
      }
    });
    return y.view(sizes);
  }
  // Up to 8 rows: one pass over each 8-column panel, streamed from memory while the next is prefetched.
  // Threads only for work worth waking them: at least ~64 KiB of weight per chunk (a parallel region
  // costs microseconds, and hundreds when the other core is busy).
  int64_t lines = (K * NR * 4 + 63) / 64;
  int64_t grain = std::max<int64_t>(1, 65536 / (K * NR * 4));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = w + p * K * NR;
      const char* next = p + 1 < p1 ? (const char*)(panel + K * NR) : nullptr;
      kernels[M](xp, K, panel, K, yp + p * NR, N, (int)std::min<int64_t>(NR, N - p * NR), next, 0, lines);
    }
  });
  return y.view(sizes);
}
}  // namespace

TORCH_LIBRARY(eaglespec, m) {
  m.def("packed_pack(Tensor w) -> Tensor");
  m.def("packed_mm(Tensor x, Tensor packed, int n) -> Tensor");
}
TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  m.impl("packed_pack", pack);
  m.impl("packed_mm", packed_mm);
}
"""

_STATE: dict = {}


def why_unavailable() -> str | None:
    """None if the kernel is (or can be) loaded here, else why not (one line). Builds it on first call."""
    if "why" not in _STATE:
        _STATE["why"] = _load()
    return _STATE["why"]


def _load() -> str | None:
    if os.environ.get("EAGLESPEC_CPU_GEMM", "1") == "0":
        return "disabled by EAGLESPEC_CPU_GEMM=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the few-row GEMM is written for x86 AVX2, not {platform.machine()}"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return f"the few-row GEMM needs AVX2 and FMA; this CPU offers {cap}"
    from .compiled import compiler_available
    why = compiler_available()
    if why is not None:
        return why
    from torch.utils import cpp_extension
    from .loading import cache_root
    tag = hashlib.sha256((_SOURCE + torch.__version__).encode()).hexdigest()[:12]
    name = f"eaglespec_cpugemm_{tag}"
    build = cache_root() / "ext" / name
    build.mkdir(parents=True, exist_ok=True)
    source = build / "cpugemm.cpp"
    if not source.is_file():  # the name carries the source's hash, so an existing file is this source
        source.write_text(_SOURCE)
    try:
        cpp_extension.load(name, [str(source)], build_directory=str(build),
                           extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    except Exception as e:  # a failed build must not stop generation: nn.Linear still works
        lines = str(e).strip().splitlines() or [type(e).__name__]
        first = next((ln for ln in lines if "error" in ln.lower()), lines[-1]).strip()
        return f"building the few-row GEMM failed ({first[:200]}); see {build}"

    @torch.library.register_fake("eaglespec::packed_mm")
    def _(x, packed, n):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("eaglespec::packed_pack")
    def _(w):
        return w.new_empty((-(-w.shape[0] // 8), w.shape[1], 8))

    return None


class PackedLinear(nn.Module):
    """nn.Linear's forward over a once-packed weight (inference only; the weight is a buffer). Given
    several linears of the same input, it computes them as one, their outputs concatenated."""

    def __init__(self, *linears: nn.Linear):
        super().__init__()
        self.in_features = linears[0].weight.shape[1]
        self.out_features = sum(lin.weight.shape[0] for lin in linears)
        with torch.no_grad():
            w = torch.cat([lin.weight.detach() for lin in linears]) if len(linears) > 1 else linears[0].weight.detach()
            self.register_buffer("packed", torch.ops.eaglespec.packed_pack(w))
            bias = None
            if any(lin.bias is not None for lin in linears):
                bias = torch.cat([lin.bias.detach() if lin.bias is not None else w.new_zeros(lin.weight.shape[0])
                                  for lin in linears])
            self.register_buffer("bias", bias)

    @property
    def weight(self) -> torch.Tensor:
        """The (out, in) weight, unpacked: a new tensor on each access (an engine built later on the
        same target takes its draft LM-head rows from here)."""
        p = self.packed
        return p.permute(0, 2, 1).reshape(-1, p.shape[1])[: self.out_features]

    def forward(self, x):
        y = torch.ops.eaglespec.packed_mm(x, self.packed, self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packed_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` (a draft head) whose linears are PackedLinears and whose other parameters and
    buffers are the same tensors; `module` itself is left as it was. Why a copy, when the target is
    packed in place: a head is saved, copied and reloaded by its state dict (bench, serve, training
    code, tests), and a packed one would hand over `*.packed` keys that a fresh head silently ignores."""
    import copy
    memo = {id(t): t for t in (*module.parameters(), *module.buffers())}
    clone = copy.deepcopy(module, memo)
    pack_linears(clone, fuse=False)
    return clone


def usable_for(model: nn.Module) -> str | None:
    """None if `model`'s linears can run on the packed kernel, else why not."""
    w = model.embed_tokens.weight
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return "only CPU fp32 uses the few-row GEMM"
    return why_unavailable()


# Linears that read the same input and that model.py knows to run as one (attribute names fixed there).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _linear(m) -> bool:
    return isinstance(m, nn.Linear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"


def pack_linears(model: nn.Module, fuse: bool = True) -> int:
    """Swap every nn.Linear of `model` (the target's layers and LM head, or a draft head) for a
    PackedLinear, in place; with `fuse`, q/k/v and gate/up become one linear each (model.py runs them
    so; a head's training code reads q_proj & co. by name, so heads keep them apart). Returns how many
    linears were swapped. The embedding (which an LM head may be tied to) stays as it is."""
    swapped = 0
    for parent in list(model.modules()) if fuse else ():
        for fused, names in _FUSED.items():
            parts = [getattr(parent, n, None) for n in names]
            if all(_linear(p) for p in parts):
                setattr(parent, fused, PackedLinear(*parts))
                for n in names:
                    delattr(parent, n)
                swapped += len(names)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _linear(child):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
