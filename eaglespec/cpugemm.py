"""CPU kernels for decoding with few rows: a few-row fp32 GEMM for x86 CPUs, for verifying a draft tree
at close to the cost of one token, and (AVX-512) the attention of a few query rows over a KV cache.

Why: verification multiplies 1-32 rows by every weight of the target. With so few rows the weights
stream from memory once and the arithmetic is small, so n rows should cost about what one row costs
until the FMA units saturate (`../shared/design/cpu-notes.md`). Neither backend we had gets there:
MKL repacks the weight every call, and inductor's C++ GEMM template re-reads each weight panel once
per small block of rows. This kernel packs each weight once into column panels ([N/w, K, w]).

- AVX-512 (w = 16, one zmm): 32 registers hold 24 accumulators, so every row up to 24 is done in one
  streamed pass of each panel, the broadcast folded into the FMA. Measured interleaved on our Zen 4
  over the default model's weights: 1 / 8 / 16 rows 19.3 / 24.0 / 34.2 ms, against 23.5 / 33.1 /
  43.6 ms with the 8-column kernel. Above 8 rows x is transposed first ([K, rows]: one k's rows in
  one line), which cut 12 / 16 / 24 rows from 27.7 / 31.2 / 40.9 ms to 23.3 / 26.3 / 33.4 (interleaved,
  bit-identical results).
- AVX2 (w = 8, one ymm), elsewhere: up to 8 rows in registers over one streamed pass of each panel,
  prefetching the next panel meanwhile; above 8 rows, pairs of panels (6 rows x 16 columns in
  registers: two FMAs per broadcast) in passes over a pair that is then in cache.

- Weights that are exactly GGUF blocks (a GGUF target's Q4_1 layers and Q8_0 LM head, as converted to
  fp32) are found when packing and kept as those blocks, 6 / 9 bits a weight in our panels
  (`quant_mm`): one decoded token then streams 106 MiB instead of 513 MiB. They are dequantized in
  registers exactly as gguf-py does, and summed as the fp32 kernel sums, so every result is bit for bit
  the fp32 kernel's. On the default model: plain decoding 2.4x, EAGLE 2.9x the fp32 panels' plain
  decoding (interleaved, compiled, identical outputs; `scripts/gguf-gemm-ab.py`). EAGLESPEC_CPU_QUANT=0
  keeps fp32 panels. On AVX2 (`quant_mm8`, 8-column panels) a linear keeps both: the blocks for up to
  EAGLESPEC_CPU_QUANT_ROWS rows (default 3), the fp32 panels above, where dequantizing costs more
  arithmetic than the bytes it saves (a 42-GFLOP/s AVX2-only CPU; `scripts/avx2-blocks-ab.py`).
- The default where the CPU has AVX-512 VNNI (`quant_mm_i8`): those blocks times activations rounded to
  int8 blocks of 32, as llama.cpp computes: 1.4x faster plain decoding and 2.3x cheaper 16-row
  verification than the exact blocks, every row's result its own (so EAGLE still equals plain decoding
  token for token), but no longer the fp32 weights' bits. EAGLESPEC_CPU_QUANT=1 keeps the exact blocks.

It is a torch custom op (`torch.ops.eaglespec.packed_mm`), so torch.compile treats it as one opaque
call and it works eagerly the same. Built once per machine with torch's C++ extension loader into the
eaglespec cache (about 20 s); where it cannot be built (no compiler, no AVX2/FMA, not x86) the engine
keeps nn.Linear, with one line saying so. The engine runs its target, its draft head and the draft
LM-head rows on it (CPU, fp32), and their attention on `small_attention` where the CPU has AVX-512
(see the comment above its source: torch's CPU flash attention is built for long queries). With every
GEMM ours, its compiled graphs skip inductor's freezing, which was there to prepack inductor's own
GEMMs: a new process then loads each graph from the FX graph cache in ~4 s instead of ~10 s.
"""
from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import platform
import sys

import torch
from torch import nn

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {
constexpr int NR = 8;  // columns per panel: one ymm register

constexpr int NR16 = 16;  // columns per panel on AVX-512: one zmm register

at::Tensor pack(const at::Tensor& w_in, int64_t nr) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat && w_in.device().is_cpu(),
              "packed_pack: a 2-D fp32 CPU weight");
  TORCH_CHECK(nr == NR || nr == NR16, "packed_pack: panels are 8 or 16 columns wide");
  auto w = w_in.contiguous();
  int64_t N = w.size(0), K = w.size(1), P = (N + nr - 1) / nr;
  auto out = at::zeros({P, K, nr}, w.options());
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < nr && p * nr + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) op[(p * K + k) * nr + j] = wp[(p * nr + j) * K + k];
  });
  return out;
}

int64_t best_width() { return __builtin_cpu_supports("avx512f") ? NR16 : NR; }
bool has_vnni() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"); }

// ---- AVX-512: 16-column panels, every row of up to 24 in one pass -------------------------------
// 32 vector registers hold 24 accumulators (24 rows x 16 columns), and the broadcast of x folds into
// the FMA's memory operand. So each 64-byte line of a panel (one k) is read from memory once for all
// rows: at 8 rows the work per line is below what memory delivers (memory-bound, like one row), at
// 16 it is about equal. The panels are one contiguous stream; a software prefetch runs PF lines ahead.
// Above 8 rows x is read transposed (XT: [K, MR], the MR values of one k in one or two lines), which
// cut 16 / 24 rows by 12-16 % (interleaved, all 121 linears of the default model): read row by row,
// the MR broadcasts of one k touch MR lines, and at K = 1536 the rows no longer fit in L1 beside the
// weight stream. The prefetch then runs further ahead, since a line is consumed more slowly.
// Each accumulator sums over k in the same order in both layouts, so the result is bit for bit the same.
#define FMA16(m) if constexpr (MR > m) a##m = _mm512_fmadd_ps(_mm512_set1_ps(XT ? xk[m] : x[m * ldx + k]), wv, a##m);

template <int MR, bool XT>
__attribute__((target("avx512f"))) void micro16(const float* __restrict x, int64_t ldx, const float* __restrict w,
                                                int64_t K, float* __restrict y, int64_t ldy, int ncols) {
  constexpr int64_t PF = XT ? 48 : 24;
  __m512 z = _mm512_setzero_ps();
  __m512 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z, a8 = z, a9 = z, a10 = z, a11 = z;
  __m512 a12 = z, a13 = z, a14 = z, a15 = z, a16 = z, a17 = z, a18 = z, a19 = z, a20 = z, a21 = z, a22 = z, a23 = z;
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch((const char*)(w + (k + PF) * NR16), _MM_HINT_T0);
    __m512 wv = _mm512_loadu_ps(w + k * NR16);
    [[maybe_unused]] const float* xk = x + k * MR;
    FMA16(0) FMA16(1) FMA16(2) FMA16(3) FMA16(4) FMA16(5) FMA16(6) FMA16(7) FMA16(8) FMA16(9) FMA16(10) FMA16(11)
    FMA16(12) FMA16(13) FMA16(14) FMA16(15) FMA16(16) FMA16(17) FMA16(18) FMA16(19) FMA16(20) FMA16(21) FMA16(22) FMA16(23)
  }
  __m512 acc[24] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21, a22, a23};
  __mmask16 mask = ncols >= NR16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ldy, mask, acc[m]);
}

using Micro16 = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int);
#define MICRO16_TABLE(XT) {nullptr, micro16<1, XT>, micro16<2, XT>, micro16<3, XT>, micro16<4, XT>, micro16<5, XT>, \
    micro16<6, XT>, micro16<7, XT>, micro16<8, XT>, micro16<9, XT>, micro16<10, XT>, micro16<11, XT>, micro16<12, XT>, \
    micro16<13, XT>, micro16<14, XT>, micro16<15, XT>, micro16<16, XT>, micro16<17, XT>, micro16<18, XT>, \
    micro16<19, XT>, micro16<20, XT>, micro16<21, XT>, micro16<22, XT>, micro16<23, XT>, micro16<24, XT>}
const Micro16 kernels16[25] = MICRO16_TABLE(false);
const Micro16 kernels16t[25] = MICRO16_TABLE(true);

// Rows in balanced passes of at most 24 (above 24 rows the later passes read the panel from L2); pass j
// covers rows [start[j], start[j + 1]). Above 8 rows each pass's rows are transposed first (see micro16).
struct Passes {
  std::vector<int64_t> start;
  at::Tensor buf;  // 64-byte aligned: 16 rows of one k in one line
  const float* x;  // what the kernels read: the rows as given, or transposed
  bool xt;
};

Passes row_passes(const float* xp, int64_t M, int64_t K) {
  Passes ps;
  int64_t J = (M + 23) / 24;
  ps.start.assign(J + 1, M);
  for (int64_t j = 0, m = 0; j < J; ++j) { ps.start[j] = m; m += (M - m) / (J - j); }
  ps.xt = M > 8;
  ps.buf = at::empty({ps.xt ? M * K : 0}, at::kFloat);
  float* xb = ps.buf.data_ptr<float>();
  if (ps.xt) {
    at::parallel_for(0, J, 1, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        int64_t m0 = ps.start[j], r = ps.start[j + 1] - m0;
        float* dst = xb + m0 * K;
        for (int64_t i = 0; i < r; ++i)
          for (int64_t k = 0; k < K; ++k) dst[k * r + i] = xp[(m0 + i) * K + k];
      }
    });
  }
  ps.x = ps.xt ? xb : xp;
  return ps;
}

void mm16(const float* xp, const float* w, float* yp, int64_t M, int64_t K, int64_t N, int64_t P) {
  Passes ps = row_passes(xp, M, K);
  const Micro16* table = ps.xt ? kernels16t : kernels16;
  int64_t J = (int64_t)ps.start.size() - 1;
  int64_t grain = std::max<int64_t>(1, 65536 / (K * NR16 * 4));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = w + p * K * NR16;
      int nc = (int)std::min<int64_t>(NR16, N - p * NR16);
      for (int64_t j = 0; j < J; ++j) {
        int64_t m0 = ps.start[j];
        table[ps.start[j + 1] - m0](ps.x + m0 * K, K, panel, K, yp + m0 * N + p * NR16, N, nc);
      }
    }
  });
}

// y[MR, <=8] = x[MR, K] @ panel[K, 8], prefetching lines [pf_lo, pf_hi) of the next panel while at it.
// Accumulators are named variables so that they stay in registers (an array was spilled to the stack
// every iteration). Each sums over k in order, one chain, whatever MR is, so a row's result does not
// depend on how many rows come with it (plain decoding's 1 row and verification's n rows agree bit for
// bit). Two chains for MR <= 4 (every other k) used to hide the FMA latency; measured without them,
// 1-4 rows cost 0-2 % more (interleaved, the default model's 121 linears), within noise.
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
  int64_t lines = pf_hi - pf_lo;
  int64_t step = lines > 0 ? std::max<int64_t>(2, K / lines) : K + 1;
  int64_t count = 0, pf = pf_lo;
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    if (next && pf < pf_hi && (count -= 2) <= 0) { _mm_prefetch(next + pf * 64, _MM_HINT_T0); ++pf; count += step; }
    __m256 w0 = _mm256_loadu_ps(w + k * NR), w1 = _mm256_loadu_ps(w + (k + 1) * NR);
    FMA_ROWS(a, w0, k)
    FMA_ROWS(a, w1, k + 1)
  }
  for (; k < K; ++k) {
    __m256 w0 = _mm256_loadu_ps(w + k * NR);
    FMA_ROWS(a, w0, k)
  }
  for (; next && pf < pf_hi; ++pf) _mm_prefetch(next + pf * 64, _MM_HINT_T0);
  __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
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
  int64_t nr = wp_in.dim() == 3 ? wp_in.size(2) : 0;
  TORCH_CHECK((nr == NR || (nr == NR16 && best_width() == NR16)) && wp_in.size(0) * nr >= N && wp_in.size(0) * nr < N + nr,
              "packed_mm: weight is not packed for ", N, " outputs on this CPU");
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
  if (nr == NR16) {
    mm16(xp, w, yp, M, K, N, P);
    return y.view(sizes);
  }
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

// ---- AVX-512, weights kept as GGUF's Q4_1 / Q8_0 blocks (4.5-8.5 bits a weight instead of 32) ----------
// Why: one decoded token streams every weight once, so fp32 weights (0.54 GB for the default model)
// cap plain decoding at memory bandwidth; its GGUF file holds them as Q4_1 (layers) and Q8_0 (the tied
// embedding / LM head). These kernels read the blocks and dequantize in registers exactly as
// gguf-py does (Q4_1: d * q + m, Q8_0: q * d, each product and sum rounded to fp32 separately: the
// _round_ intrinsics are never fused into an FMA by the compiler), then accumulate over k in order as
// micro16 does. So the result is bit for bit that of the fp32 weights the file dequantizes to.
// Panel layout, per 16 outputs and block of 32 k (QB bytes, contiguous): d[16] fp32, m[16] fp32 (Q4_1
// only), then Q4_1: 16 k-pairs of 16 bytes (byte i: q[k][i] | q[k + 1][i] << 4); Q8_0: 32 k of 16 int8.
constexpr int64_t Q4B = 64 + 64 + 256, Q8B = 64 + 512;
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define QFMA(m, wv, kk) if constexpr (MR > m) a##m = _mm512_fmadd_ps(_mm512_set1_ps(XT ? x[(kk) * MR + m] : x[m * ldx + (kk)]), wv, a##m);
#define QFMA_ALL(wv, kk) QFMA(0, wv, kk) QFMA(1, wv, kk) QFMA(2, wv, kk) QFMA(3, wv, kk) QFMA(4, wv, kk) QFMA(5, wv, kk) \
  QFMA(6, wv, kk) QFMA(7, wv, kk) QFMA(8, wv, kk) QFMA(9, wv, kk) QFMA(10, wv, kk) QFMA(11, wv, kk) QFMA(12, wv, kk) \
  QFMA(13, wv, kk) QFMA(14, wv, kk) QFMA(15, wv, kk) QFMA(16, wv, kk) QFMA(17, wv, kk) QFMA(18, wv, kk) QFMA(19, wv, kk) \
  QFMA(20, wv, kk) QFMA(21, wv, kk) QFMA(22, wv, kk) QFMA(23, wv, kk)

// The exact dequantization of one 16-byte row of a panel block, shared by microq and dequant_panel.
// Q4_1: the k-pair (k, k + 1) of 16 outputs; Q8_0: one k of 16 outputs.
__attribute__((target("avx512f"))) static inline void q4_pair(const uint8_t* q16, __m512 d, __m512 m, __m512& w0, __m512& w1) {
  const __m128i lo4 = _mm_set1_epi8(0x0F);
  __m128i v = _mm_loadu_si128((const __m128i*)q16);
  __m128i q0 = _mm_and_si128(v, lo4), q1 = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
  w0 = _mm512_add_round_ps(_mm512_mul_round_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q0)), RN), m, RN);
  w1 = _mm512_add_round_ps(_mm512_mul_round_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q1)), RN), m, RN);
}

__attribute__((target("avx512f"))) static inline __m512 q8_one(const uint8_t* q16, __m512 d) {
  __m128i v = _mm_loadu_si128((const __m128i*)q16);
  return _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), d, RN);
}

template <int MR, bool XT, bool Q4>
__attribute__((target("avx512f"))) void microq(const float* __restrict x, int64_t ldx, const uint8_t* __restrict w,
                                               int64_t K, float* __restrict y, int64_t ldy, int ncols) {
  constexpr int64_t QB = Q4 ? Q4B : Q8B;
  __m512 z = _mm512_setzero_ps();
  __m512 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z, a8 = z, a9 = z, a10 = z, a11 = z;
  __m512 a12 = z, a13 = z, a14 = z, a15 = z, a16 = z, a17 = z, a18 = z, a19 = z, a20 = z, a21 = z, a22 = z, a23 = z;
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk = w + b * QB;
    for (int64_t l = 0; l < QB; l += 64) _mm_prefetch((const char*)(blk + 2 * QB + l), _MM_HINT_T0);
    const __m512 d = _mm512_loadu_ps((const float*)blk);
    if constexpr (Q4) {
      const __m512 m = _mm512_loadu_ps((const float*)(blk + 64));
      for (int64_t i = 0; i < 16; ++i) {
        __m512 w0, w1;
        q4_pair(blk + 128 + 16 * i, d, m, w0, w1);
        const int64_t k = b * 32 + 2 * i;
        QFMA_ALL(w0, k)
        QFMA_ALL(w1, k + 1)
      }
    } else {
      for (int64_t i = 0; i < 32; ++i) {
        __m512 w0 = q8_one(blk + 64 + 16 * i, d);
        const int64_t k = b * 32 + i;
        QFMA_ALL(w0, k)
      }
    }
  }
  __m512 acc[24] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21, a22, a23};
  __mmask16 mask = ncols >= NR16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
  for (int mm = 0; mm < MR; ++mm) _mm512_mask_storeu_ps(y + mm * ldy, mask, acc[mm]);
}

// A whole panel dequantized to fp32 ([K, 16], as packed_pack lays it out), for inputs of more than 24
// rows (prefill, batched regeneration): dequantized once and then read from L2 by every pass, instead of
// once a pass. The same values as microq's, so the same bits.
template <bool Q4>
__attribute__((target("avx512f"))) void dequant_panel(const uint8_t* __restrict w, int64_t K, float* __restrict out) {
  constexpr int64_t QB = Q4 ? Q4B : Q8B;
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk = w + b * QB;
    const __m512 d = _mm512_loadu_ps((const float*)blk);
    float* o = out + b * 32 * NR16;
    if constexpr (Q4) {
      const __m512 m = _mm512_loadu_ps((const float*)(blk + 64));
      for (int64_t i = 0; i < 16; ++i) {
        __m512 w0, w1;
        q4_pair(blk + 128 + 16 * i, d, m, w0, w1);
        _mm512_storeu_ps(o + (2 * i) * NR16, w0);
        _mm512_storeu_ps(o + (2 * i + 1) * NR16, w1);
      }
    } else {
      for (int64_t i = 0; i < 32; ++i) _mm512_storeu_ps(o + i * NR16, q8_one(blk + 64 + 16 * i, d));
    }
  }
}

using MicroQ = void (*)(const float*, int64_t, const uint8_t*, int64_t, float*, int64_t, int);
#define MICROQ_TABLE(XT, Q4) {nullptr, microq<1, XT, Q4>, microq<2, XT, Q4>, microq<3, XT, Q4>, microq<4, XT, Q4>, \
    microq<5, XT, Q4>, microq<6, XT, Q4>, microq<7, XT, Q4>, microq<8, XT, Q4>, microq<9, XT, Q4>, microq<10, XT, Q4>, \
    microq<11, XT, Q4>, microq<12, XT, Q4>, microq<13, XT, Q4>, microq<14, XT, Q4>, microq<15, XT, Q4>, \
    microq<16, XT, Q4>, microq<17, XT, Q4>, microq<18, XT, Q4>, microq<19, XT, Q4>, microq<20, XT, Q4>, \
    microq<21, XT, Q4>, microq<22, XT, Q4>, microq<23, XT, Q4>, microq<24, XT, Q4>}
const MicroQ kernelsq4[25] = MICROQ_TABLE(false, true);
const MicroQ kernelsq4t[25] = MICROQ_TABLE(true, true);
const MicroQ kernelsq8[25] = MICROQ_TABLE(false, false);
const MicroQ kernelsq8t[25] = MICROQ_TABLE(true, false);

at::Tensor quant_mm_i8(const at::Tensor& x_in, const at::Tensor& wq, int64_t N, int64_t kind);

// x [..., K] fp32 @ a quantized packed weight ([P, K / 32, QB] bytes, from quant_pack) -> [..., N]
at::Tensor quant_mm(const at::Tensor& x_in, const at::Tensor& wq, int64_t N, int64_t kind) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "quant_mm: needs AVX-512");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && wq.scalar_type() == at::kByte && wq.dim() == 3,
              "quant_mm: fp32 input and a packed uint8 weight");
  TORCH_CHECK(kind == 4 || kind == 8 || kind == 14 || kind == 18,
              "quant_mm: kind is 4 (Q4_1) or 8 (Q8_0), or 14 / 18 for those blocks times int8 activations");
  if (kind > 10) return quant_mm_i8(x_in, wq, N, kind);
  const int64_t QB = kind == 4 ? Q4B : Q8B, P = wq.size(0), K = wq.size(1) * 32;
  TORCH_CHECK(wq.size(2) == QB && P * NR16 >= N && P * NR16 < N + NR16, "quant_mm: weight is not packed for ", N, " outputs");
  TORCH_CHECK(x_in.size(-1) == K, "quant_mm: input has ", x_in.size(-1), " features, weight ", K);
  auto x = x_in.reshape({-1, K}).contiguous();
  auto wc = wq.contiguous();
  int64_t M = x.size(0);
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(sizes);
  Passes ps = row_passes(x.data_ptr<float>(), M, K);
  const MicroQ* table = kind == 4 ? (ps.xt ? kernelsq4t : kernelsq4) : (ps.xt ? kernelsq8t : kernelsq8);
  const uint8_t* w = wc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  int64_t J = (int64_t)ps.start.size() - 1;
  int64_t grain = std::max<int64_t>(1, 16384 / (K / 32 * QB));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    std::vector<float> buf(J > 1 ? K * NR16 : 0);
    const Micro16* t16 = ps.xt ? kernels16t : kernels16;
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = w + p * (K / 32) * QB;
      int nc = (int)std::min<int64_t>(NR16, N - p * NR16);
      if (J > 1) {  // several passes: dequantize once, then the fp32 kernel over the panel in L2
        if (kind == 4) dequant_panel<true>(panel, K, buf.data()); else dequant_panel<false>(panel, K, buf.data());
        for (int64_t j = 0; j < J; ++j) {
          int64_t m0 = ps.start[j];
          t16[ps.start[j + 1] - m0](ps.x + m0 * K, K, buf.data(), K, yp + m0 * N + p * NR16, N, nc);
        }
        continue;
      }
      for (int64_t j = 0; j < J; ++j) {
        int64_t m0 = ps.start[j];
        table[ps.start[j + 1] - m0](ps.x + m0 * K, K, panel, K, yp + m0 * N + p * NR16, N, nc);
      }
    }
  });
  return y.view(sizes);
}

// ---- AVX2: the same GGUF blocks on 8-column panels --------------------------------------------------
// Why: on a CPU without AVX-512 the kernels above do not run, and fp32 panels stream 513 MiB a token for
// the default model where its blocks are 106 MiB. Measured on a 2-core AVX2-only EPYC (17.6 GB/s, 42
// GFLOP/s; all 121 linears of the default model, interleaved, ms): 1 / 2 / 3 / 4 / 8 / 16 rows on fp32
// panels 38.5 / 42.1 / 49.6 / 47.7 / 60.6 / 119.3, on blocks 28.9 / 34.5 / 44.1 / 49.2 / 72.3 / 151.1.
// Dequantizing costs arithmetic that such a CPU is short of, so blocks pay only for a few rows: the
// linear keeps both and takes the blocks up to `max_rows` rows (EAGLESPEC_CPU_QUANT_ROWS), the fp32
// panels above. Both give the fp32 weights' bits (the same products, summed over k in the same order as
// micro / micro2 sum them), so which one ran never shows in a result.
// Panel layout, per 8 outputs and block of 32 k (QB bytes, contiguous): d[8] fp32, m[8] fp32 (Q4_1
// only), then Q4_1: 16 k-pairs of 8 bytes (byte i: q[k][i] | q[k + 1][i] << 4); Q8_0: 32 k of 8 int8.
constexpr int64_t Q4B8 = 32 + 32 + 128, Q8B8 = 32 + 256;

// gguf-py rounds d * q, then the sum with m. GCC may contract _mm256_add_ps(_mm256_mul_ps(..), ..) into one
// FMA (its default -ffp-contract=fast), which rounds once. With d an fp16 value and q < 16 the product is
// exact, so both give the same bits (a test that dropped this barrier still passed); the empty asm keeps
// the two roundings anyway, so that the bits do not rest on that argument.
static inline __m256 rounded(__m256 v) { asm("" : "+x"(v)); return v; }

static inline void q4_pair8(const uint8_t* q8, __m256 d, __m256 m, __m256& w0, __m256& w1) {
  const __m128i lo4 = _mm_set1_epi8(0x0F);
  __m128i v = _mm_loadl_epi64((const __m128i*)q8);
  __m128i q0 = _mm_and_si128(v, lo4), q1 = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
  w0 = _mm256_add_ps(rounded(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q0)))), m);
  w1 = _mm256_add_ps(rounded(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q1)))), m);
}

static inline __m256 q8_one8(const uint8_t* q8, __m256 d) {
  __m128i v = _mm_loadl_epi64((const __m128i*)q8);
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
}

// y[MR, 8] = x[MR, K] @ one block panel, as micro<MR> computes it over the fp32 panel (FMA_ROWS, k in order).
template <int MR, bool Q4>
void microq8(const float* __restrict x, int64_t ldx, const uint8_t* __restrict w, int64_t K,
             float* __restrict y, int64_t ldy, int ncols) {
  constexpr int64_t QB = Q4 ? Q4B8 : Q8B8;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk = w + b * QB;
    for (int64_t l = 0; l < QB; l += 64) _mm_prefetch((const char*)(blk + 4 * QB + l), _MM_HINT_T0);
    const __m256 d = _mm256_loadu_ps((const float*)blk);
    if constexpr (Q4) {
      const __m256 m = _mm256_loadu_ps((const float*)(blk + 32));
      for (int64_t i = 0; i < 16; ++i) {
        __m256 w0, w1;
        q4_pair8(blk + 64 + 8 * i, d, m, w0, w1);
        const int64_t k = b * 32 + 2 * i;
        FMA_ROWS(a, w0, k)
        FMA_ROWS(a, w1, k + 1)
      }
    } else {
      for (int64_t i = 0; i < 32; ++i) {
        __m256 w0 = q8_one8(blk + 32 + 8 * i, d);
        const int64_t k = b * 32 + i;
        FMA_ROWS(a, w0, k)
      }
    }
  }
  __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
  if (ncols == NR) {
    for (int mm = 0; mm < MR; ++mm) _mm256_storeu_ps(y + mm * ldy, acc[mm]);
  } else {
    alignas(32) float tmp[NR];
    for (int mm = 0; mm < MR; ++mm) {
      _mm256_store_ps(tmp, acc[mm]);
      for (int j = 0; j < ncols; ++j) y[mm * ldy + j] = tmp[j];
    }
  }
}

#define MICROQ8_TABLE(Q4) {nullptr, microq8<1, Q4>, microq8<2, Q4>, microq8<3, Q4>, microq8<4, Q4>, microq8<5, Q4>, \
    microq8<6, Q4>, microq8<7, Q4>, microq8<8, Q4>}
const MicroQ kernelsq4_8[9] = MICROQ8_TABLE(true);
const MicroQ kernelsq8_8[9] = MICROQ8_TABLE(false);

// x [..., K] fp32 @ a weight kept twice: as blocks on 8-column panels ([P, K / 32, QB] bytes) and as fp32
// panels (packed_pack's, width 8). Up to max_rows rows (at most 8) read the blocks, more the fp32 panels.
at::Tensor quant_mm8(const at::Tensor& x_in, const at::Tensor& wq, const at::Tensor& panels, int64_t N,
                     int64_t kind, int64_t max_rows) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && wq.scalar_type() == at::kByte && wq.dim() == 3,
              "quant_mm8: fp32 input and a packed uint8 weight");
  TORCH_CHECK(kind == 4 || kind == 8, "quant_mm8: kind is 4 (Q4_1) or 8 (Q8_0)");
  TORCH_CHECK(max_rows >= 0 && max_rows <= NR, "quant_mm8: max_rows is 0-8");
  const int64_t QB = kind == 4 ? Q4B8 : Q8B8, P = wq.size(0), K = wq.size(1) * 32;
  TORCH_CHECK(wq.size(2) == QB && P * NR >= N && P * NR < N + NR, "quant_mm8: weight is not packed for ", N, " outputs");
  TORCH_CHECK(x_in.size(-1) == K, "quant_mm8: input has ", x_in.size(-1), " features, weight ", K);
  auto x = x_in.reshape({-1, K}).contiguous();
  int64_t M = x.size(0);
  if (M > max_rows) return packed_mm(x_in, panels, N);
  auto wc = wq.contiguous();
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(sizes);
  const MicroQ fn = (kind == 4 ? kernelsq4_8 : kernelsq8_8)[M];
  const float* xp = x.data_ptr<float>();
  const uint8_t* w = wc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  int64_t grain = std::max<int64_t>(1, 16384 / (K / 32 * QB));  // ~16 KiB of blocks a chunk, as quant_mm
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      fn(xp, K, w + p * (K / 32) * QB, K, yp + p * NR, N, (int)std::min<int64_t>(NR, N - p * NR));
  });
  return y.view(sizes);
}

// ---- AVX-512 VNNI: GGUF blocks times activations quantized to int8 blocks (llama.cpp's way) ---------
// Why: the exact kernel above dequantizes every weight to fp32 (4 instructions per 16 weights) and then
// spends one FMA per weight and row, so it is bound by instructions: 6 ms a token where the 106 MiB
// of blocks stream in ~3.5, and 16 rows cost ~3.5 tokens. llama.cpp instead quantizes each row of x to
// int8 blocks of 32 (a scale per block) and multiplies integers: one vpdpbusd does 64 multiply-adds.
// Per block of 32 k and 16 outputs that is 8 vpdpbusd and 3-4 float operations a row, against 32 FMAs.
// The integer sums are exact and each row's float steps run in a fixed order, so a row's result does not
// depend on the rows computed with it: verification and plain decoding still agree token for token. They
// are no longer the fp32 weights' bits, though (x is rounded to 8 bits a block): EAGLESPEC_CPU_QUANT=1
// keeps the exact kernel above.
// x row r, block b: q[r][b][32] int8, dx[r][b] = max|x| / 127 (fp32), sx[r][b] = sum of q.
// Panel layout, per 16 outputs and block of 32 k (bytes, contiguous):
//   Q4_1 (kind 14): d[16], m[16] fp16 (the file's own scales, so exact; 320 bytes a block instead of 384
//     with fp32 ones: one token streams 12 % fewer bytes), and 4 vectors of 64 bytes; byte 4j + t of vector
//     v holds the nibbles q[4v + t][j] | q[16 + 4v + t][j] << 4 (lane j: output j, 4 consecutive k, as
//     vpdpbusd reads them);
//   Q8_0 (kind 18): d[16] fp32, and 8 vectors of 64 bytes (fp32 d keeps them on 64-byte lines); byte
//     4j + t of vector g is q[4g + t][j] + 128 (vpdpbusd multiplies unsigned by signed bytes; the 128 * sx
//     it adds is subtracted by starting the sum there).
// y[r][j] = sum_b dx * (d[j] * isum + m[j] * sx) (Q4_1), sum_b dx * d[j] * (isum - 128 sx) (Q8_0).
constexpr int64_t I4B = 32 + 32 + 256, I8B = 64 + 512;

// isum += w (unsigned bytes) . the 4 signed bytes at x, in every lane: the broadcast folded into the
// instruction's memory operand ({1to16}), which GCC does not do by itself for vpdpbusd (a separate
// vpbroadcastd per instruction otherwise).
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static inline void dpbusd_bcast(__m512i& isum, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(isum) : "v"(w), "m"(*x));
}

// The rows of one pass, quantized and laid out for the kernel (MR rows, B blocks), so that every value
// it broadcasts is one constant offset from a block's base (no per-row pointers):
//   xq[b][g][r]: int32, the 4 int8 of row r at k = 32b + 4g..; dx[b][r]: the block's scale;
//   aux[b][r]: Q4_1 dx * sx (fp32, for the m term), Q8_0 -128 * sx (int32, where the sum starts).
template <int MR, bool Q4>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void microi(
    const int32_t* __restrict xq, const float* __restrict dx, const int32_t* __restrict aux, int64_t K,
    const uint8_t* __restrict w, float* __restrict y, int64_t ldy, int ncols) {
  constexpr int64_t QB = Q4 ? I4B : I8B;
  constexpr int NA = MR == 1 ? 4 : MR <= 3 ? 2 : 1;
  const int64_t B = K / 32;
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* blk = w + b * QB;
    for (int64_t l = 0; l < QB; l += 64) _mm_prefetch((const char*)(blk + 2 * QB + l), _MM_HINT_T0);
    const int32_t* xb = xq + b * 8 * MR;
    const float* db = dx + b * MR;
    const int32_t* ab = aux + b * MR;
    __m512 d, m = _mm512_setzero_ps();
    __m512i wv[8];
    if constexpr (Q4) {
      d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
      m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32)));
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        __m512i raw = _mm512_loadu_si512((const void*)(blk + 64 + 64 * v));
        wv[v] = _mm512_and_si512(raw, lo4);
        wv[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
      }
    } else {
      d = _mm512_loadu_ps((const float*)blk);
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) wv[g] = _mm512_loadu_si512((const void*)(blk + 64 + 64 * g));
    }
    if constexpr (MR <= 3) {
      // few rows: each row's sum split in NA parts, so that NA * MR sums are in flight (vpdpbusd's latency
      // is ~5 cycles; integers, so any order gives the same sum)
      __m512i isum[MR * NA];
#pragma GCC unroll 8
      for (int i = 0; i < MR * NA; ++i)
        isum[i] = (Q4 || i % NA) ? _mm512_setzero_si512() : _mm512_set1_epi32(ab[i / NA]);
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) dpbusd_bcast(isum[r * NA + g % NA], wv[g], xb + g * MR + r);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        __m512i t = isum[r * NA];
#pragma GCC unroll 4
        for (int a = 1; a < NA; ++a) t = _mm512_add_epi32(t, isum[r * NA + a]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(db[r])), acc[r]);
        if constexpr (Q4) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(((const float*)ab)[r]), acc[r]);
      }
    } else {
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        __m512i isum = Q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(ab[r]);
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g) dpbusd_bcast(isum, wv[g], xb + g * MR + r);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(db[r])), acc[r]);
        if constexpr (Q4) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(((const float*)ab)[r]), acc[r]);
      }
    }
  }
  __mmask16 mask = ncols >= NR16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}

using MicroI = void (*)(const int32_t*, const float*, const int32_t*, int64_t, const uint8_t*, float*, int64_t, int);
#define MICROI_TABLE(Q4) {nullptr, microi<1, Q4>, microi<2, Q4>, microi<3, Q4>, microi<4, Q4>, microi<5, Q4>, \
    microi<6, Q4>, microi<7, Q4>, microi<8, Q4>, microi<9, Q4>, microi<10, Q4>, microi<11, Q4>, microi<12, Q4>, \
    microi<13, Q4>, microi<14, Q4>, microi<15, Q4>, microi<16, Q4>}
constexpr int64_t IR = 16;  // rows a pass: 16 accumulators + 8 weight vectors in registers
const MicroI kernelsi4[IR + 1] = MICROI_TABLE(true);
const MicroI kernelsi8[IR + 1] = MICROI_TABLE(false);

// Row i of a pass of R rows into its int8 blocks, in microi's layout: dx = max|x| / 127, q = x / dx
// rounded to nearest (ties to even), sx = sum q. The same code whatever the row count, so a row's blocks
// never depend on its neighbours. Vectorized (two vectors a block): it runs on one thread before the
// GEMM's parallel part, and as scalar code it cost ~2 ns a value, ~0.2 ms a token and ~1.5 ms for 8 rows
// over the default model's 121 linears. Bit for bit the scalar version: |x| and the max are exact, x * id is
// one rounded product either way, the conversion rounds to nearest even as nearbyint does, and the sum is
// of integers (`scripts/int8-gemm-ab.py ROWS REPS REV` compares it with an older revision's outputs; the tests
// check it against a reference, halves that round to even included).
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void quantize_row_i8(
    const float* x, int64_t K, int64_t R, int64_t i, bool q4, int32_t* xq, float* dx, int32_t* aux) {
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vid = _mm512_set1_ps(id);
    __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q0 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, q0));
    q1 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, q1));
    const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    alignas(16) int8_t q[32];
    _mm_store_si128((__m128i*)q, _mm512_cvtepi32_epi8(q0));
    _mm_store_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(q1));
    for (int g = 0; g < 8; ++g) __builtin_memcpy(xq + (b * 8 + g) * R + i, q + 4 * g, 4);
    dx[b * R + i] = d;
    if (q4) { float f = d * (float)s; __builtin_memcpy(aux + b * R + i, &f, 4); } else aux[b * R + i] = -128 * s;
  }
}

at::Tensor quant_mm_i8(const at::Tensor& x_in, const at::Tensor& wq, int64_t N, int64_t kind) {
  TORCH_CHECK(has_vnni(), "quant_mm: the int8 kernel needs AVX-512 VNNI");
  const bool q4 = kind == 14;
  const int64_t QB = q4 ? I4B : I8B, P = wq.size(0), B = wq.size(1), K = B * 32;
  TORCH_CHECK(wq.size(2) == QB && P * NR16 >= N && P * NR16 < N + NR16, "quant_mm: weight is not packed for ", N, " outputs");
  TORCH_CHECK(x_in.size(-1) == K, "quant_mm: input has ", x_in.size(-1), " features, weight ", K);
  auto x = x_in.reshape({-1, K}).contiguous();
  auto wc = wq.contiguous();
  const int64_t M = x.size(0);
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(sizes);
  // rows in balanced passes of at most IR (after the first pass a panel is read from L1); pass j
  // covers rows [start[j], start[j + 1]) and its quantized rows start at int32 offset 10 * B * start[j]
  const int64_t J = (M + IR - 1) / IR;
  std::vector<int64_t> start(J + 1, M);
  for (int64_t j = 0, m = 0; j < J; ++j) { start[j] = m; m += (M - m) / (J - j); }
  std::vector<int32_t> xbuf(10 * B * M);  // per row: 8 B int32 of q, B scales, B aux
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, J, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t m0 = start[j], R = start[j + 1] - m0;
      int32_t* base = xbuf.data() + 10 * B * m0;
      for (int64_t i = 0; i < R; ++i)
        quantize_row_i8(xp + (m0 + i) * K, K, R, i, q4, base, (float*)(base + 8 * B * R), base + 9 * B * R);
    }
  });
  const MicroI* table = q4 ? kernelsi4 : kernelsi8;
  const uint8_t* w = wc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  int64_t grain = std::max<int64_t>(1, 16384 / (B * QB));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = w + p * B * QB;
      int nc = (int)std::min<int64_t>(NR16, N - p * NR16);
      for (int64_t j = 0; j < J; ++j) {
        const int64_t m0 = start[j], R = start[j + 1] - m0;
        const int32_t* base = xbuf.data() + 10 * B * m0;
        table[R](base, (const float*)(base + 8 * B * R), base + 9 * B * R, K, panel, yp + m0 * N + p * NR16, N, nc);
      }
    }
  });
  return y.view(sizes);
}

// ---- attention of a few query rows over a KV cache (decoding, verification, batched decoding) ------
// Why not torch's CPU flash attention: for 1-32 query rows it spends most of its time on set-up and
// blocking made for long queries (58-143 us a layer at 1 row, 256-640 keys, where reading the keys and
// values takes ~30), and it reads every key of the mask's length for every batch row. Here each query
// row reads only the keys its mask shows, in the cache's own layout, and its result depends only on its
// query, those keys and their order: not on the batch, the other rows or the cache's padded length.
constexpr int64_t ROWS = 16;  // query rows a task aims for: the heads of one KV head times some positions

__attribute__((target("avx512f"))) static inline __m512 exp16(__m512 x) {
  // exp(x) = 2^n e^r, |r| <= ln2 / 2; e^r by Cephes' expf polynomial (about 1 ulp).
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

struct Row {
  const float* q;
  const bool* mask;  // this row's L flags
  float* out;
};

// Sixteen dot products at once: lane j of the result is the sum of a[j]'s 16 lanes. A fixed tree of
// in-register shuffles and adds (46 instructions for 16 sums, where 16 _mm512_reduce_add_ps take about
// three times that); each sum depends on its own vector only, in the same order whatever the others hold.
__attribute__((target("avx512f"))) static inline __m512 sum16(const __m512* a) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // halves: [a2i q0+q2, q1+q3 | a2i+1 q0+q2, q1+q3]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters: quarter Q holds 4 partial sums of a[4i + Q]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
  __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
  __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y0, y1, 0x44), _mm512_shuffle_ps(y0, y1, 0xEE));
  // lane 4Q + i holds a[4i + Q]: back to lane j = a[j]
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, z);
}

// The query rows `rows` (all on one KV head) against keys / values of row stride ks / vs; s: R x L scratch.
// NV = head_dim / 16. Every row's arithmetic is the same whatever the other rows are. Scores go by blocks
// of 16 keys (a block read once for all R rows, from L1 after the first): per row, 16 dot products of NV
// FMAs each, summed by sum16, masked, stored. Keys of a block that a row does not see are multiplied all
// the same (cheaper than skipping them one by one) and then dropped; keys past L are never read.
template <int NV>
__attribute__((target("avx512f"))) void attend_rows(const Row* rows, int64_t R, const float* k, int64_t ks,
                                                    const float* v, int64_t vs, int64_t L, float scale,
                                                    float* s, float* mx, uint16_t* shown, int64_t* end,
                                                    float* packed) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const __m512 vninf = _mm512_set1_ps(ninf), vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < R; ++r) mx[r] = ninf, end[r] = 0;
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    const int nj = (int)std::min<int64_t>(16, L - j0);
    const __mmask16 in = nj == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nj) - 1);
    __mmask16 any = 0;
    for (int64_t r = 0; r < R; ++r) {
      const bool* m = rows[r].mask + j0;
      __mmask16 bits = 0;
      if (nj == 16) {
        bits = _mm512_test_epi32_mask(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)m)),
                                      _mm512_set1_epi32(0xFF));
      } else {
        for (int j = 0; j < nj; ++j) bits |= (__mmask16)((m[j] ? 1u : 0u) << j);
      }
      shown[r] = bits;
      any |= bits;
      if (bits) end[r] = j0 + nj;
    }
    if (!any) {
      for (int64_t r = 0; r < R; ++r) _mm512_mask_storeu_ps(s + r * L + j0, in, vninf);
      continue;
    }
    const float* kb = k + j0 * ks;
    for (int64_t r = 0; r < R; ++r) {
      if (!shown[r]) { _mm512_mask_storeu_ps(s + r * L + j0, in, vninf); continue; }
      const float* qr = rows[r].q;
      __m512 q[NV];
      for (int i = 0; i < NV; ++i) q[i] = _mm512_loadu_ps(qr + 16 * i);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        if (j >= nj) { acc[j] = _mm512_setzero_ps(); continue; }
        const float* kj = kb + j * ks;
        __m512 t = _mm512_mul_ps(_mm512_loadu_ps(kj), q[0]);
        for (int i = 1; i < NV; ++i) t = _mm512_fmadd_ps(_mm512_loadu_ps(kj + 16 * i), q[i], t);
        acc[j] = t;
      }
      __m512 x = _mm512_mask_blend_ps(shown[r], vninf, _mm512_mul_ps(sum16(acc), vscale));
      _mm512_mask_storeu_ps(s + r * L + j0, in, x);
      mx[r] = std::max(mx[r], _mm512_mask_reduce_max_ps(in, x));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float* o = rows[r].out;
    if (mx[r] == ninf) {  // a row that sees no key (a padding row): zeros, not NaN
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(o + 16 * i, _mm512_setzero_ps());
      continue;
    }
    float* sr = s + r * L;
    // Only up to the row's last shown block: past it every weight would be exactly 0 (a batch row
    // shorter than the batch's cache length, a tree node before its siblings' slots).
    const int64_t E = end[r];
    __m512 m = _mm512_set1_ps(mx[r]), sum = _mm512_setzero_ps();
    int64_t cnt = 0;
    for (int64_t j = 0; j < E; j += 16) {  // weights, in place; a masked key's is exactly 0
      __mmask16 in = E - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (E - j)) - 1);
      __m512 x = _mm512_mask_loadu_ps(vninf, in, sr + j);
      __mmask16 seen = _mm512_cmp_ps_mask(x, vninf, _CMP_NEQ_OQ);
      __m512 p = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, m)));
      _mm512_mask_storeu_ps(sr + j, in, p);
      // the shown keys' weights, packed one after another: the sum below then adds the n-th shown key
      // in lane n % 16 wherever its slot is, so a tree node (its ancestors in scattered slots) gets the
      // bits plain decoding gets for the same keys in consecutive slots
      const int c = __builtin_popcount((unsigned)seen);
      _mm512_mask_storeu_ps(packed + cnt, (__mmask16)((1u << c) - 1), _mm512_maskz_compress_ps(seen, p));
      cnt += c;
    }
    for (int64_t j = 0; j < cnt; j += 16) {
      __mmask16 in = cnt - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cnt - j)) - 1);
      sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(in, packed + j));
    }
    __m512 acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < E; ++j) {
      float pj = sr[j];
      if (pj == 0.0f) continue;  // masked (or underflowed): its value row is not read
      __m512 pv = _mm512_set1_ps(pj);
      for (int i = 0; i < NV; ++i) acc[i] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + j * vs + 16 * i), acc[i]);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(o + 16 * i, _mm512_mul_ps(acc[i], inv));
  }
}

using AttendRows = void (*)(const Row*, int64_t, const float*, int64_t, const float*, int64_t, int64_t, float,
                            float*, float*, uint16_t*, int64_t*, float*);

// q (B, H, T, D), k and v (B, KVH, L, D) (any strides but the last), mask bool (T, L) or (B or 1, 1, T, L);
// returns (B, T, H, D): the layout o_proj reads. H a multiple of KVH (grouped-query attention).
at::Tensor small_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                           double scale) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "small_attention: needs AVX-512");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "small_attention: 4-D q, k, v");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              q.device().is_cpu(), "small_attention: fp32 CPU tensors");
  int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KVH = k.size(1), L = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && KVH > 0 && H % KVH == 0,
              "small_attention: k and v (B, KVH, L, D) with H a multiple of KVH");
  TORCH_CHECK(D % 16 == 0 && D / 16 >= 1 && D / 16 <= 16 && (D / 16 & (D / 16 - 1)) == 0,
              "small_attention: head_dim 16, 32, 64, 128 or 256");
  at::Tensor m = mask.dim() == 2 ? mask.unsqueeze(0).unsqueeze(0) : mask;
  TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(1) == 1 && m.size(2) == T && m.size(3) == L &&
              (m.size(0) == 1 || m.size(0) == B), "small_attention: a bool mask (T, L) or (B or 1, 1, T, L)");
  m = m.expand({B, 1, T, L});
  if (m.stride(3) != 1) m = m.contiguous();
  at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  auto out = at::empty({B, T, H, D}, q.options());
  AttendRows fn = nullptr;
  switch (D / 16) {
    case 1: fn = attend_rows<1>; break;
    case 2: fn = attend_rows<2>; break;
    case 4: fn = attend_rows<4>; break;
    case 8: fn = attend_rows<8>; break;
    case 16: fn = attend_rows<16>; break;
  }
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const bool* mp = m.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  // A task is (batch row, KV head, block of positions): the KV head's G query heads at TS positions, so
  // each key is read once for all of them.
  // With few (batch row, KV head) pairs, the positions are split further so that each thread gets about
  // two equal tasks (3 KV heads on 2 threads would otherwise leave one idle a third of the time).
  int64_t G = H / KVH, most = std::max<int64_t>(1, ROWS / G);
  int64_t TB = std::max((T + most - 1) / most,
                        std::min<int64_t>(T, (2 * at::get_num_threads() + B * KVH - 1) / (B * KVH)));
  int64_t TS = (T + TB - 1) / TB;
  TB = (T + TS - 1) / TS;
  at::parallel_for(0, B * KVH * TB, 1, [&](int64_t a, int64_t z) {
    std::vector<float> s(G * TS * L), mx(G * TS);
    std::vector<uint16_t> shown(G * TS);  // each row's mask bits for one block of 16 keys
    std::vector<int64_t> end(G * TS);     // each row's keys end by here
    std::vector<float> packed(L + 16);    // one row's shown weights, packed
    std::vector<Row> rows(G * TS);
    for (int64_t task = a; task < z; ++task) {
      int64_t b = task / (KVH * TB), g = task / TB % KVH, t0 = task % TB * TS, nt = std::min(TS, T - t0);
      int64_t R = 0;
      for (int64_t h = g * G; h < (g + 1) * G; ++h)
        for (int64_t t = t0; t < t0 + nt; ++t)
          rows[R++] = {qp + b * qc.stride(0) + h * qc.stride(1) + t * qc.stride(2),
                       mp + b * m.stride(0) + t * m.stride(2), op + ((b * T + t) * H + h) * D};
      fn(rows.data(), R, kp + b * kc.stride(0) + g * kc.stride(1), kc.stride(2),
         vp + b * vc.stride(0) + g * vc.stride(1), vc.stride(2), L, (float)scale, s.data(), mx.data(), shown.data(), end.data(),
         packed.data());
    }
  });
  return out;
}
// ---- rejection sampling of a draft tree's nodes (eaglespec/verify.py tree_draws, the reference) --------------
// One row per tree node: its children are tried in order, child c taken with min(1, p(c) / q(c)); a rejection
// leaves p's residual normalise(max(0, p - q)) and removes c from q; if none is taken, the node's token is drawn
// from what is left of p. Why a kernel: as tensor operations every trial is several passes over the whole
// vocabulary for every node, inside the verification graph (~1-2 ms a round on the default model); here a
// node without children costs one draw, and a trial touches p only where it is rejected.

double sum_range(const float* p, int64_t a, int64_t b) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = a;
  for (; i + 4 <= b; i += 4) { s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3]; }
  for (; i < b; ++i) s0 += p[i];
  return (s0 + s1) + (s2 + s3);
}

// The first index whose cumulative mass exceeds u times the total (float64 sums, by blocks of 1,024 and then
// within the block), as `sampling.sample`; never a token of probability 0.
int64_t draw_index(const float* p, int64_t V, double u, std::vector<double>& blocks) {
  constexpr int64_t B = 1024;
  int64_t nb = (V + B - 1) / B;
  blocks.resize(nb);
  double total = 0;
  for (int64_t b = 0; b < nb; ++b) { blocks[b] = sum_range(p, b * B, std::min(V, (b + 1) * B)); total += blocks[b]; }
  double target = u * total, acc = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (acc + blocks[b] <= target) { acc += blocks[b]; continue; }
    for (int64_t i = b * B, e = std::min(V, (b + 1) * B); i < e; ++i) {
      acc += p[i];
      if (acc > target) return i;
    }
  }
  for (int64_t i = V - 1; i >= 0; --i)  // u rounded up to the total: the last token with any mass
    if (p[i] > 0) return i;
  return V - 1;
}

at::Tensor tree_draws(const at::Tensor& p, const at::Tensor& q, const at::Tensor& draft_ids, const at::Tensor& draft_of,
                      const at::Tensor& kids, const at::Tensor& kid_ok, const at::Tensor& det, const at::Tensor& u) {
  TORCH_CHECK(p.dim() == 2 && q.dim() == 2 && kids.dim() == 2 && u.dim() == 2 && det.dim() == 1, "tree_draws: 2-D inputs");
  TORCH_CHECK(p.scalar_type() == at::kFloat && q.scalar_type() == at::kFloat && u.scalar_type() == at::kDouble &&
              kids.scalar_type() == at::kLong && kid_ok.scalar_type() == at::kBool && det.scalar_type() == at::kLong,
              "tree_draws: dtypes");
  int64_t n = p.size(0), V = p.size(1), Vq = q.size(1), K = kids.size(1);
  bool reduced = draft_ids.numel() > 0;
  TORCH_CHECK(q.size(0) == n && kids.size(0) == n && kid_ok.sizes() == kids.sizes() && u.size(0) == n &&
              det.size(0) == n && u.size(1) == K + 2 &&
              (reduced ? draft_ids.numel() == Vq && draft_of.numel() == V : Vq == V), "tree_draws: shapes");
  auto pc = p.contiguous(), qc = q.contiguous(), kc = kids.contiguous(), oc = kid_ok.contiguous(), uc = u.contiguous();
  auto ic = draft_ids.contiguous(), fc = draft_of.contiguous(), dc = det.contiguous();
  const float *pp = pc.data_ptr<float>(), *qp = qc.data_ptr<float>();
  const int64_t *kp = kc.data_ptr<int64_t>(), *ids = reduced ? ic.data_ptr<int64_t>() : nullptr,
                *of = reduced ? fc.data_ptr<int64_t>() : nullptr, *dp = dc.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(dp[j] < V, "tree_draws: a chain token outside the vocabulary");
  const bool* okp = oc.data_ptr<bool>();
  const double* up = uc.data_ptr<double>();
  auto out = at::empty({n}, kids.options());
  int64_t* op = out.data_ptr<int64_t>();
  std::atomic<bool> bad{false};
  at::parallel_for(0, n, 1, [&](int64_t a, int64_t z) {
    std::vector<float> pw, qw;
    std::vector<double> blocks;
    for (int64_t j = a; j < z; ++j) {
      const float* P = pp + j * V;  // the input row until a rejection changes it
      const int64_t* kr = kp + j * K;
      const bool* okr = okp + j * K;
      const double* ur = up + j * (K + 2);
      int64_t result = -1;
      // After a rejection p is kept as pw * scale: a residual changes only the draft vocabulary's entries, so
      // it costs a pass over those (not the whole vocabulary), and `outside` (the sum of pw off them) stays.
      float scale = 1.f;
      double outside = -1;
      auto own_copy = [&]() {
        if (P == pw.data()) return;
        pw.assign(P, P + V);
        P = pw.data();
        double inside = 0;
        for (int64_t i = 0; i < Vq; ++i) inside += pw[reduced ? ids[i] : i];
        outside = sum_range(pw.data(), 0, V) - inside;
      };
      bool trying = true;
      if (dp[j] >= 0) {  // the chain's token first: all of its proposal's mass on one token (verify.tree_draws)
        const int64_t x = dp[j];
        if (ur[K + 1] < P[x]) {
          result = x;
          trying = false;
        } else {
          double total = sum_range(P, 0, V) - P[x];
          if (total > 0) {  // the residual: p without x (else p == x's mass up to rounding: draw from p as it is)
            own_copy();
            const int64_t xi = reduced ? of[x] : x;
            if (xi < 0) outside -= pw[x];  // x off the draft vocabulary: its mass leaves `outside`
            pw[x] = 0.f;
            scale = (float)(1.0 / total);
          }
        }
      }
      bool any = false;
      for (int64_t r = 0; r < K; ++r) any = any || okr[r];
      if (any && trying) {
        qw.assign(qp + j * Vq, qp + (j + 1) * Vq);
        double qs = sum_range(qw.data(), 0, Vq);
        for (auto& x : qw) x = qs > 0 ? (float)(x / qs) : 0.f;
        for (int64_t r = 0; r < K; ++r) {
          if (!okr[r]) continue;
          int64_t c = kr[r], ci = reduced ? of[c] : c;
          float pt = P[c] * scale, qt = ci >= 0 ? qw[ci] : 0.f;
          if (!(qt > 0)) { bad = true; break; }  // a token the head could not have drawn: the caller's error
          if (ur[r] * qt < pt) { result = c; break; }
          own_copy();
          double residual = 0;
          for (int64_t i = 0; i < Vq; ++i) residual += std::max(pw[reduced ? ids[i] : i] * scale - qw[i], 0.f);
          double total = outside * scale + residual;
          if (!(total > 0)) break;  // p == q up to rounding: draw from p as it stands
          float inv = 1.f / scale;
          for (int64_t i = 0; i < Vq; ++i) {
            float& x = pw[reduced ? ids[i] : i];
            x = std::max(x * scale - qw[i], 0.f) * inv;  // still pw * scale = the residual, unnormalised
          }
          scale = (float)(scale / total);  // normalising is a scale: the draw below needs pw's proportions only
          qw[ci] = 0.f;
          double rest = sum_range(qw.data(), 0, Vq);
          if (!(rest > 0)) break;  // every token the head could draw was tried
          float qinv = (float)(1.0 / rest);
          for (auto& x : qw) x *= qinv;
        }
      }
      op[j] = result >= 0 ? result : draw_index(P, V, ur[K], blocks);
    }
  });
  TORCH_CHECK(!bad, "tree_draws: a drafted token has no draft probability");
  return out;
}

// Copy KV-cache slots src[i] onto dst[i] in every buffer (B, H, slots, D), all buffers in one call: after a
// verification the accepted tree path is moved next to the committed tokens. As a compiled graph this was ~60
// tiny index copies (one per layer's keys and values, ~0.15 ms alone, ~0.5 ms in a round); here it is ~70 KB of
// memcpy. Each (batch, head) row's slots are gathered first, so src and dst may overlap.
void move_slots(at::TensorList bufs, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(src.dtype() == at::kLong && dst.dtype() == at::kLong && src.numel() == dst.numel(),
              "move_slots: src and dst must be int64 of one length");
  auto s = src.contiguous(), d = dst.contiguous();
  const int64_t n = s.numel(), *sp = s.data_ptr<int64_t>(), *dp = d.data_ptr<int64_t>();
  std::vector<char> tmp;
  for (const auto& b : bufs) {
    TORCH_CHECK(b.dim() == 4 && b.is_contiguous(), "move_slots: buffers must be contiguous (B, H, slots, D)");
    const int64_t slots = b.size(2), rows = b.size(0) * b.size(1), width = b.size(3) * b.element_size();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(sp[i] >= 0 && sp[i] < slots && dp[i] >= 0 && dp[i] < slots, "move_slots: slot out of range");
    tmp.resize(n * width);
    char* base = static_cast<char*>(b.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {
      char* row = base + r * slots * width;
      for (int64_t i = 0; i < n; ++i) std::memcpy(tmp.data() + i * width, row + sp[i] * width, width);
      for (int64_t i = 0; i < n; ++i) std::memcpy(row + dp[i] * width, tmp.data() + i * width, width);
    }
  }
}
}  // namespace

TORCH_LIBRARY(eaglespec, m) {
  m.def("packed_pack(Tensor w, int nr) -> Tensor");
  m.def("packed_best_width() -> int", best_width);  // no tensor to dispatch on: a catch-all kernel
  m.def("cpu_has_vnni() -> bool", has_vnni);
  m.def("packed_mm(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("small_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
  m.def("quant_mm(Tensor x, Tensor packed, int n, int kind) -> Tensor");
  m.def("quant_mm8(Tensor x, Tensor packed, Tensor panels, int n, int kind, int max_rows) -> Tensor");
  m.def("tree_draws(Tensor p, Tensor q, Tensor draft_ids, Tensor draft_of, Tensor kids, Tensor kid_ok, Tensor det, Tensor u) -> Tensor");
  m.def("move_slots(Tensor(a!)[] bufs, Tensor src, Tensor dst) -> ()");
}
TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  m.impl("packed_pack", pack);
  m.impl("packed_mm", packed_mm);
  m.impl("small_attention", small_attention);
  m.impl("quant_mm", quant_mm);
  m.impl("quant_mm8", quant_mm8);
  m.impl("tree_draws", tree_draws);
  m.impl("move_slots", move_slots);
}
"""

_STATE: dict = {}


def panel_width() -> int:
    """Columns per packed panel: 16 where the CPU has AVX-512 (one zmm; all rows up to 24 in one pass),
    else 8. EAGLESPEC_CPU_GEMM_WIDTH=8 forces the AVX2 kernel (for A/B timing)."""
    if "width" not in _STATE:
        best = int(torch.ops.eaglespec.packed_best_width())
        _STATE["width"] = 8 if os.environ.get("EAGLESPEC_CPU_GEMM_WIDTH") == "8" else best
    return _STATE["width"]


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

    @torch.library.register_fake("eaglespec::small_attention")
    def _(q, k, v, mask, scale):
        b, h, t, d = q.shape
        return q.new_empty((b, t, h, d))

    @torch.library.register_fake("eaglespec::packed_pack")
    def _(w, nr):
        return w.new_empty((-(-w.shape[0] // nr), w.shape[1], nr))

    @torch.library.register_fake("eaglespec::quant_mm")
    def _(x, packed, n, kind):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("eaglespec::quant_mm8")
    def _(x, packed, panels, n, kind, max_rows):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("eaglespec::tree_draws")
    def _(p, q, draft_ids, draft_of, kids, kid_ok, det, u):
        return kids.new_empty(kids.shape[:1])

    return None


# ---- weights that are exactly GGUF blocks ------------------------------------------------------------
# A GGUF target's linears are dequantized to fp32 when it is converted, but their values are still
# exactly Q4_1 (d * q + m) or Q8_0 (q * d) blocks of 32. Recognised here, they are packed as those blocks
# (5.3 / 9 bits a weight with our panels, against 32) for quant_mm, whose results are bit for bit those
# of the fp32 weights. Nothing is approximated: a block that does not reproduce its fp32 values exactly
# leaves the whole linear in fp32.
Q4_1, Q8_0 = 4, 8


Q4_1_I8, Q8_0_I8 = 14, 18  # the same blocks, laid out for the int8-activation kernel (quant_mm_i8)
_QUANT_MODES = ("1", "0", "int8")


def quant_mode() -> str:
    """How linears whose weights are exact GGUF blocks run (EAGLESPEC_CPU_QUANT):
    - "int8" (the default): the blocks times activations rounded to int8 blocks of 32, as llama.cpp
      computes; 1.4x faster plain decoding and 2.3x cheaper 16-row verification than "1" on our Zen 4. Not
      the fp32 weights' bits, but plain decoding and EAGLE on it still agree token for token (every row's
      bits are its own, in a tree or alone). A CPU without AVX-512 VNNI takes "1" instead;
    - "1": the blocks dequantized exactly, bit for bit the fp32 weights' results (the fp32 model the
      GGUF file converts to);
    - "0": fp32 panels (for A/B timing)."""
    mode = os.environ.get("EAGLESPEC_CPU_QUANT", "int8")
    if mode not in _QUANT_MODES:
        raise ValueError(f"EAGLESPEC_CPU_QUANT must be one of {', '.join(_QUANT_MODES)}, not {mode!r}")
    if mode == "int8" and (panel_width() != 16 or not bool(torch.ops.eaglespec.cpu_has_vnni())):
        return "1"  # the int8 kernel is AVX-512 VNNI only
    return mode


def quant_enabled() -> bool:
    """Whether linears whose weights are exact GGUF blocks run on the quantized kernels: wherever the
    packed kernel runs (AVX-512: quant_mm; AVX2: quant_mm8, for a few rows), unless EAGLESPEC_CPU_QUANT=0
    (for A/B timing)."""
    return why_unavailable() is None and quant_mode() != "0"


def block_rows() -> int:
    """On 8-column panels (AVX2), the most rows that read a linear's blocks; more read its fp32 panels
    (see quant_mm8's comment for the measurements behind the default, 3). EAGLESPEC_CPU_QUANT_ROWS=0-8."""
    raw = os.environ.get("EAGLESPEC_CPU_QUANT_ROWS", "3")
    if not raw.isdigit() or int(raw) > 8:
        raise ValueError(f"EAGLESPEC_CPU_QUANT_ROWS must be a whole number from 0 to 8, not {raw!r}")
    return int(raw)


def _fp16_neighbours(x: torch.Tensor, spread: int = 2):
    """x rounded to fp16, and the fp16 values up to `spread` steps either side (as fp32)."""
    bits = x.half().view(torch.int16)
    for step in [0] + [s for i in range(1, spread + 1) for s in (i, -i)]:
        yield (bits + step).view(torch.float16).float()


def _solve_blocks(wb, scale_guesses, fit):
    """Per block of 32 (wb: [blocks, 32]), the first fp16 scale near one of `scale_guesses` (tensors
    [blocks]) for which `fit(wb_rows, scale)` returns (q, exact [rows]); (scale, q) or None if a block has
    none. Every guess is tried on the blocks still unsolved only: most blocks take the first."""
    everything = torch.arange(wb.shape[0])
    scale, q, todo = None, None, everything
    for guess in scale_guesses:
        for cand in _fp16_neighbours(guess):
            if scale is None:  # the first try: every block, no gathering
                q, ok = fit(wb, everything, cand)
                if ok.float().mean() < 0.5:  # not such a tensor at all: do not try the other guesses
                    return None
                scale, todo = torch.where(ok, cand, torch.zeros_like(cand)), everything[~ok]
                continue
            if todo.numel() == 0:
                return scale, q
            c = cand[todo]
            qq, ok = fit(wb[todo], todo, c)
            hit = todo[ok]
            scale[hit], q[hit] = c[ok], qq[ok]
            todo = todo[~ok]
    return (scale, q) if todo.numel() == 0 else None


def q4_1_blocks(w: torch.Tensor):
    """(d, m, q) with w == d * q + m exactly (fp32, product and sum each rounded, as gguf-py dequantizes),
    d and m fp16 values [N, K / 32], q in 0..15 [N, K]; None if w is not made of such blocks."""
    n, k = w.shape
    if k % 32 or w.numel() == 0:
        return None
    wb = w.reshape(-1, 32)
    m = wb.amin(-1)
    if not torch.equal(m.half().float(), m):
        return None
    span = wb.amax(-1) - m

    def fit(rows, idx, c):
        c = torch.where(c > 0, c, torch.ones_like(c))[:, None]  # a constant block: q = 0 for any d
        qq = ((rows - m[idx, None]) / c).round().clamp(0, 15)
        return qq.to(torch.uint8), ((c * qq + m[idx, None]) == rows).all(-1)

    # the largest value is usually q = 15 (llama.cpp's d is (max - min) / 15), not always
    solved = _solve_blocks(wb, [span / 15, span / 14, span / 13], fit)
    if solved is None:
        return None
    d, q = solved
    d = torch.where(span > 0, d, torch.zeros_like(d))
    return d.reshape(n, k // 32), m.reshape(n, k // 32), q.reshape(n, k)


def q8_0_blocks(w: torch.Tensor):
    """(d, q) with w == q * d exactly (fp32), d fp16 values [N, K / 32], q int8 [N, K]; None if w is not
    made of such blocks."""
    n, k = w.shape
    if k % 32 or w.numel() == 0:
        return None
    wb = w.reshape(-1, 32)
    amax = wb.abs().amax(-1)

    def fit(rows, idx, c):
        c = torch.where(c > 0, c, torch.ones_like(c))[:, None]
        qq = (rows / c).round().clamp(-128, 127)
        return qq.to(torch.int8), ((qq * c) == rows).all(-1)

    solved = _solve_blocks(wb, [amax / 127], fit)
    if solved is None:
        return None
    d, q = solved
    return torch.where(amax > 0, d, torch.zeros_like(d)).reshape(n, k // 32), q.reshape(n, k)


def q8_0_round(w: torch.Tensor) -> torch.Tensor:
    """w rounded to Q8_0 blocks as llama.cpp's quantizer does (d = max |w| / 127 in fp16, q = round(w / d)),
    in fp32: what a draft head runs on where the target runs on GGUF blocks (see packed_copy)."""
    n, k = w.shape
    b = w.reshape(n, k // 32, 32)
    d = (b.abs().amax(-1, keepdim=True) / 127).half().float()
    q = (b / torch.where(d > 0, d, torch.ones_like(d))).round().clamp(-128, 127)
    return (q * d).reshape(n, k)


def draft_blocks_enabled() -> bool:
    """Whether a draft head's linears run as Q8_0 blocks (rounded) where the target runs on GGUF blocks:
    unless EAGLESPEC_DRAFT_Q8=0."""
    return quant_enabled() and os.environ.get("EAGLESPEC_DRAFT_Q8", "1") != "0"


def _panels(t: torch.Tensor, n_pad: int, width: int = 16) -> torch.Tensor:
    """[N, ...] -> [P, width, ...], zero rows past N."""
    if n_pad:
        t = torch.cat([t, t.new_zeros((n_pad, *t.shape[1:]))])
    return t.reshape(-1, width, *t.shape[1:])



def quant_pack(w: torch.Tensor, int8: bool = False, width: int = 16):
    """(kind, packed uint8 [P, K / 32, bytes per block]) for quant_mm if `w` is exactly Q4_1 or Q8_0 blocks,
    else None. Layout: see the comments above quant_mm's kernel and (`int8`, width 16 only) above
    quant_mm_i8's; with `width` 8 (AVX2), the same exact layout on 8-column panels (quant_mm8's comment)."""
    assert width in (8, 16) and not (int8 and width == 8), "int8 blocks are laid out for 16-column panels"
    n, k = w.shape
    pad = (-n) % width
    blocks = q4_1_blocks(w)
    if blocks is not None:
        d, m, q = blocks
        dp = _panels(d, pad, width).permute(0, 2, 1).contiguous()  # [P, B, width]
        mp = _panels(m, pad, width).permute(0, 2, 1).contiguous()
        if int8:  # byte 4j + t of vector v: q[4v + t][j] | q[16 + 4v + t][j] << 4
            qp = _panels(q.reshape(n, k // 32, 2, 4, 4), pad).permute(0, 2, 3, 4, 1, 5)  # [P, B, half, v, lane, t]
            qb = (qp[:, :, 0] | (qp[:, :, 1] << 4)).reshape(dp.shape[0], k // 32, 256)
            return Q4_1_I8, torch.cat([dp.half().view(torch.uint8), mp.half().view(torch.uint8), qb], -1).contiguous()
        qp = _panels(q.reshape(n, k // 32, 16, 2), pad, width).permute(0, 2, 3, 1, 4)  # [P, B, pair, lane, 2]
        qb = (qp[..., 0] | (qp[..., 1] << 4)).reshape(dp.shape[0], k // 32, 16 * width)
        return Q4_1, torch.cat([dp.view(torch.uint8), mp.view(torch.uint8), qb], -1).contiguous()
    blocks = q8_0_blocks(w)
    if blocks is not None:
        d, q = blocks
        dp = _panels(d, pad, width).permute(0, 2, 1).contiguous()
        if int8:  # byte 4j + t of vector g: q[4g + t][j] + 128
            qp = _panels(q.reshape(n, k // 32, 8, 4), pad).permute(0, 2, 3, 1, 4)  # [P, B, g, lane, t]
            qb = (qp.to(torch.int16) + 128).to(torch.uint8).reshape(dp.shape[0], k // 32, 512)
            return Q8_0_I8, torch.cat([dp.view(torch.uint8), qb], -1).contiguous()
        qp = _panels(q.reshape(n, k // 32, 32), pad, width).permute(0, 2, 3, 1).reshape(dp.shape[0], k // 32, 32 * width)
        return Q8_0, torch.cat([dp.view(torch.uint8), qp.contiguous().view(torch.uint8)], -1).contiguous()
    return None


def quant_unpack(kind: int, packed: torch.Tensor, n: int) -> torch.Tensor:
    """The fp32 (N, K) weight of quant_pack's output, exactly."""
    p, b, _ = packed.shape
    if kind in (Q4_1_I8, Q8_0_I8):
        if kind == Q4_1_I8:  # fp16 scales
            d = packed[..., :32].contiguous().view(torch.float16).float()
            m = packed[..., 32:64].contiguous().view(torch.float16).float()
            qb = packed[..., 64:].reshape(p, b, 4, 16, 4)  # [P, B, v, lane, t]
            q = torch.stack([qb & 15, qb >> 4], 2)  # [P, B, half, v, lane, t]
            q = q.permute(0, 4, 1, 2, 3, 5).reshape(p * 16, b, 32).float()
            w = d.permute(0, 2, 1).reshape(p * 16, b, 1) * q + m.permute(0, 2, 1).reshape(p * 16, b, 1)
        else:
            d = packed[..., :64].contiguous().view(torch.float32)  # [P, B, 16]
            qb = packed[..., 64:].reshape(p, b, 8, 16, 4).to(torch.int16) - 128  # [P, B, g, lane, t]
            q = qb.permute(0, 3, 1, 2, 4).reshape(p * 16, b, 32).float()
            w = q * d.permute(0, 2, 1).reshape(p * 16, b, 1)
        return w.reshape(p * 16, b * 32)[:n]
    # exact blocks: width fp32 d (and m), then the quants; the block's size tells the panel width
    width = packed.shape[2] // (24 if kind == Q4_1 else 36)  # 24 / 36 bytes a column: Q4_1 / Q8_0
    d = packed[..., :4 * width].contiguous().view(torch.float32)  # [P, B, width]
    if kind == Q4_1:
        m = packed[..., 4 * width:8 * width].contiguous().view(torch.float32)
        qb = packed[..., 8 * width:].reshape(p, b, 16, width)
        q = torch.stack([qb & 15, qb >> 4], -1).permute(0, 3, 1, 2, 4).reshape(p * width, b, 32).float()  # [N, B, 32]
        w = d.permute(0, 2, 1).reshape(p * width, b, 1) * q + m.permute(0, 2, 1).reshape(p * width, b, 1)
    else:
        q = packed[..., 4 * width:].contiguous().view(torch.int8).reshape(p, b, 32, width).permute(0, 3, 1, 2)
        w = q.reshape(p * width, b, 32).float() * d.permute(0, 2, 1).reshape(p * width, b, 1)
    return w.reshape(p * width, b * 32)[:n]


class PackedLinear(nn.Module):
    """nn.Linear's forward over a once-packed weight (inference only; the weight is a buffer). Given
    several linears of the same input, it computes them as one, their outputs concatenated. A weight
    made exactly of GGUF Q4_1 / Q8_0 blocks is packed as those blocks (`kind` 4 / 8; 0: fp32 panels). On
    8-column panels (AVX2) such a weight is kept as fp32 panels too (`panels`), for more than `block_rows`
    rows, where the blocks' dequantizing costs more than the fp32 bytes (quant_mm8)."""

    def __init__(self, *linears: nn.Linear, quant: bool | None = None, round_q8: bool = False,
                 width: int | None = None):
        super().__init__()
        self.in_features = linears[0].weight.shape[1]
        self.out_features = sum(lin.weight.shape[0] for lin in linears)
        with torch.no_grad():
            w = torch.cat([lin.weight.detach() for lin in linears]) if len(linears) > 1 else linears[0].weight.detach()
            if round_q8 and self.in_features % 32 == 0:  # a draft head's weights: an approximation is fine there
                w = q8_0_round(w)
            width = width or panel_width()
            use = quant_enabled() if quant is None else quant
            qp = quant_pack(w, int8=width == 16 and quant_mode() == "int8", width=width) if use else None
            self.kind = 0 if qp is None else qp[0]
            panels = torch.ops.eaglespec.packed_pack(w, width) if qp is None or width == 8 else None
            self.register_buffer("packed", panels if qp is None else qp[1])
            self.register_buffer("panels", panels if qp is not None else None)
            self.block_rows = block_rows()
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
        if self.kind:
            return quant_unpack(self.kind, p, self.out_features)
        return p.permute(0, 2, 1).reshape(-1, p.shape[1])[: self.out_features]

    def forward(self, x):
        if self.kind and self.panels is not None:
            y = torch.ops.eaglespec.quant_mm8(x, self.packed, self.panels, self.out_features, self.kind, self.block_rows)
        elif self.kind:
            y = torch.ops.eaglespec.quant_mm(x, self.packed, self.out_features, self.kind)
        else:
            y = torch.ops.eaglespec.packed_mm(x, self.packed, self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        kind = {0: "fp32", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_1_I8: "Q4_1 x int8", Q8_0_I8: "Q8_0 x int8"}[self.kind]
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kind}"


def linear_kinds(model: nn.Module) -> list[str]:
    """How `model`'s packed linears run ("fp32", "Q4_1", "Q8_0 x int8", ...), for records of a run."""
    return sorted({m.extra_repr().rsplit(", ", 1)[-1] for m in model.modules() if isinstance(m, PackedLinear)})


def packed_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` (a draft head) whose linears are PackedLinears and whose other parameters and
    buffers are the same tensors (no KV cache); `module` itself is left as it was. Why a copy, when the
    target is packed in place: a head is saved, copied and reloaded by its state dict (bench, serve,
    training code, tests), and a packed one would hand over `*.packed` keys that a fresh head silently
    ignores."""
    from .model import share_weights
    clone = share_weights(module)
    pack_linears(clone, fuse=False, round_q8=draft_blocks_enabled())
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


def pack_linears(model: nn.Module, fuse: bool = True, round_q8: bool = False) -> int:
    """Swap every nn.Linear of `model` (the target's layers and LM head, or a draft head) for a
    PackedLinear, in place; with `fuse`, q/k/v and gate/up become one linear each (model.py runs them
    so; a head's training code reads q_proj & co. by name, so heads keep them apart). Returns how many
    linears were swapped. The embedding (which an LM head may be tied to) stays as it is. Its attention
    modules switch to this library's attention kernel too, where that runs: the packed path is the
    inference path, and a model's fp32 CPU inference is what both kernels are for. With `round_q8` (a
    draft head, whose output verification checks) the weights are first rounded to Q8_0 blocks: a
    quarter of the bytes a draft step streams, for draft probabilities within 8-bit rounding."""
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
                setattr(parent, name, PackedLinear(child, round_q8=round_q8))
                swapped += 1
    if swapped:
        onto_huge_pages(packed_slots(model))
    if swapped and attention_available():
        from .model import Attention
        for m in model.modules():
            if isinstance(m, Attention) and m.hd % 16 == 0 and m.hd <= 256:
                m.small_attention = True
    return swapped


HUGE_PAGE = 2 << 20


def huge_pages_enabled() -> bool:
    """Whether packed weights go onto transparent huge pages: Linux (madvise), unless EAGLESPEC_HUGEPAGES=0."""
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("EAGLESPEC_HUGEPAGES", "1") != "0")


def onto_huge_pages(slots: list[tuple[nn.Module, str]]) -> bool:
    """Move the CPU tensors `getattr(module, name)` into one anonymous mapping advised for transparent
    huge pages (2 MiB), in place; False (nothing moved) where that is not possible or is turned off.
    The engine puts its packed weights there (`packed_slots`). Its KV caches stay on 4 KiB pages: moved
    too, they measured no faster (6 MT-bench questions, interleaved, quiet: plain 185.6 against 192.0
    tok/s, EAGLE 245.2 against 246.0, within the pairs' noise).

    Why: a decoding step streams ~100 MiB of packed weights, on 4 KiB pages ~25,000 TLB misses a step,
    and the hardware prefetchers stop at every 4 KiB page boundary. Measured on our Zen 4 (all 121
    linears of the default model, int8 kernel, interleaved, quiet, three runs): 1 / 2 / 4 rows 3.61-3.77
    / 3.65-3.86 / 4.30-4.57 ms on 4 KiB pages against 3.29-3.64 / 3.52-3.62 / 3.98-4.24 on 2 MiB ones.
    One mapping for all of them, not one per tensor, so the rounding to 2 MiB is paid once. The values
    are copied unchanged: results are bit for bit the same."""
    moving = [(m, n, getattr(m, n)) for m, n in slots]
    moving = [(m, n, t) for m, n, t in moving if t.device.type == "cpu" and t.is_contiguous()]
    if not moving or not huge_pages_enabled():
        return False
    sizes = [t.numel() * t.element_size() for _, _, t in moving]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // 64) * 64  # every tensor on a cache line of its own, as torch's allocator does
    try:
        arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return False
    # the mapping's start is only 4 KiB-aligned: start the tensors on a 2 MiB boundary
    skip = -ctypes.addressof(ctypes.c_char.from_buffer(arena)) % HUGE_PAGE
    for (m, name, t), size, off in zip(moving, sizes, offsets):
        # frombuffer's tensor keeps the mapping alive (it holds a buffer export of it)
        moved = torch.frombuffer(arena, dtype=torch.uint8, count=size, offset=skip + off).view(t.dtype).view(t.shape)
        moved.copy_(t)
        setattr(m, name, moved)
        m.on_huge_pages = True  # the calibration's key tells the two layouts' tables apart
    return True


def packed_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(m, name) for m in module.modules() if isinstance(m, PackedLinear)
            for name in ("packed", "panels") if getattr(m, name) is not None]


def attention_available() -> bool:
    """Whether the small-row attention kernel runs here: AVX-512 (it has no AVX2 version; elsewhere torch's
    SDPA stays), and not turned off with EAGLESPEC_CPU_ATTENTION=0 (for A/B timing)."""
    return (why_unavailable() is None and int(torch.ops.eaglespec.packed_best_width()) == 16
            and os.environ.get("EAGLESPEC_CPU_ATTENTION", "1") != "0")
