"""Static-shape calls for the decoding hot path, compiled with torch.compile or run eagerly.

On CPUs, eager matmuls with few rows are slow (MKL repacks the weights every call; see
shared cpu-notes): inductor's own GEMMs run a 1-token step ~2x and an 8-16-token verification
~3x faster. Compiled graphs want fixed shapes, so the number of tokens per call is fixed per call
site, the cache is written in place through slot indices, and attention reads a cache prefix whose
length is rounded up to a bucket (the mask hides the rest) and marked dynamic, so a growing
context does not trigger a recompile.

The eager path runs the very same functions with the very same masks, so the two paths differ only
in who executes the graph.
"""
from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

KV_BUCKET = 128
_CONFIGURED = False


def inductor_cache_dir() -> Path:
    from .loading import cache_root
    return cache_root() / "inductor"


def configure_inductor(device: torch.device | None = None, dtype: torch.dtype | None = None):
    """Settings shared by every compiled call, applied once per process (the GEMM backend per engine)."""
    global _CONFIGURED
    # Compiled artifacts persist across runs (see eaglespec/__init__.py, which sets this at import,
    # before torch can fix its default); here again for a caller that changed the environment since.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
    if device is not None:
        import torch._inductor.config as ic
        # On CPU, max-autotune times each GEMM alone, with its weight hot in L3, and then often picks
        # MKL's packed GEMM; inside a whole forward the weights stream from memory, where MKL is 1.5-2x
        # slower than inductor's own C++ micro-GEMM (measured on SmolLM2: one step 41 -> 26 ms, 8 tokens
        # 88 -> 52 ms). fp32 on CPU: inductor's template only. Elsewhere: inductor's defaults.
        if device.type == "cpu" and dtype == torch.float32:
            ic.max_autotune_gemm_backends = "CPP"
            _keep_fp32_linears_unpacked()
    if _CONFIGURED:
        return
    import torch._inductor.config as ic
    import torch._inductor.select_algorithm as sa
    # Each call site has its own fixed shapes (one graph per tree size): a new size must compile a
    # new static graph, not turn the old one into a slower dynamic-shape graph. Only the mask's
    # cache length is dynamic, and only because we mark it so.
    torch._dynamo.config.automatic_dynamic_shapes = False
    # Every engine's calls are compiled versions of the same few functions; a process may build several.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 512)
    ic.freezing = True  # weights become constants: lets inductor pick and prepack its own GEMMs
    ic.autotune_num_choices_displayed = 0
    ic.max_autotune_report_choices_stats = False
    sa.PRINT_AUTOTUNE = False  # its per-kernel tables would drown the generated text
    # inductor's own autotuner trips torch's TypedStorage deprecation; it is not ours to fix, nor the user's
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
    _CONFIGURED = True


def _keep_fp32_linears_unpacked() -> None:
    """Stop freezing from rewriting fp32 CPU linears into MKL-packed ones (`mkl._mkl_linear`), except
    one-row ones (the plain decoding step).

    Why: the packed weight is an mkldnn tensor, and inductor's FX graph cache cannot pickle one, so
    every graph holding it bypassed the cache ("mkldnn tensors unpickleable") and each new process
    recompiled everything (≈ 6 minutes on SmolLM2). Left as plain mm/addmm on a frozen weight, the
    linears are still lowered to inductor's own prepacked C++ GEMM (the only GEMM backend we allow for
    fp32 on CPU, see configure_inductor), and those graphs are cached. One-row GEMVs keep MKL: measured
    interleaved in one process on SmolLM2 (2026-12-02, quiet), the C++ GEMM made T(1) 40.2 ms against
    MKL's 37.2-37.9, while at 4-16 rows it was within ±3 % (8 and 16: 58.4 / 80.5 ms against 59.7 / 83.0
    with MKL everywhere). So only the one-token graph recompiles in a new process, and plain decoding,
    the baseline every speed-up is measured against, stays at its fastest. Must run before the first
    freezing compile of the process: the pattern pass reads the check when it is first built."""
    try:
        from torch._inductor.fx_passes import mkldnn_fusion
    except ImportError:
        return
    check = getattr(mkldnn_fusion, "_is_packable_linear", None)
    if check is None or getattr(check, "_eaglespec", False):
        return

    def packable(match) -> bool:
        node = match.output_node()
        w_idx = 2 if node.target is torch.ops.aten.addmm.default else 1
        weight, x = node.args[w_idx].meta.get("val"), node.args[w_idx - 1].meta.get("val")
        one_row = x is not None and x.dim() == 2 and x.shape[0] == 1
        if weight is not None and weight.dtype == torch.float32 and weight.device.type == "cpu" and not one_row:
            return False
        return check(match)

    packable._eaglespec = True
    mkldnn_fusion._is_packable_linear = packable


def compiler_available() -> str | None:
    """None if torch.compile can build kernels here, else why not (one line)."""
    if sys.platform == "win32":
        return "torch.compile's C++ backend is not supported on Windows here"
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None and shutil.which("c++") is None and shutil.which("clang++") is None:
        return "no C++ compiler found (install g++ or set CXX)"
    return None


def kv_len_for(end: int, max_len: int) -> int:
    return min(-(-end // KV_BUCKET) * KV_BUCKET, max_len)


class StaticCall:
    """`fn(*inputs, slots=, mask=)` as a fixed-shape call on a module with a KV cache.

    The caller gives `cache_start` (the first cache slot written) and, optionally, the visibility
    mask of the last m columns, (t, m) with m <= cache_start + t: every column before those is visible to
    every token (a tree or a frontier sees all committed tokens, so callers pass only the part that
    differs, not a row of cache_start ones each). Without a mask the t tokens are causal after
    `cache_start` cached ones.
    """

    def __init__(self, fn, cache_owner, compile_mode: str | None = None, name: str = "", packed: bool = False,
                 dynamic_t: bool = False, skip_guards: bool = False, state=None):
        """dynamic_t: one graph for every t >= 2 (t = 1 keeps its own static graph), with the inputs' t
        at dim 1. Only where no GEMM needs a static row count, i.e. all run on cpugemm's packed op:
        then one graph replaces a graph per verification size, which a new process must each load.

        skip_guards: once a shape has run, later calls of it check only the guards that tell this
        function's graphs apart (torch's `skip_guard_eval_unsafe` stance). Only for a function whose
        graph depends on nothing but its inputs, modules that stay as they are for the caller's life,
        and `state()`: a hashable summary of whatever else it reads (the draft calls read the engine's
        top-k, which `bench` may change between methods), so that a new state is a new shape."""
        self.cache_owner, self.name = cache_owner, name
        self.compiled = compile_mode is not None
        self.dynamic_t = dynamic_t
        self.skip_guards, self.state = skip_guards, state
        self._fn = compile_fn(fn, compile_mode, packed) if self.compiled else fn
        self._warm: set = set()  # the shapes this call has run (and so compiled) once
        self._tril: dict = {}

    def _causal(self, t: int, device) -> torch.Tensor:
        """(t, t) lower-triangular, kept per size: built once, copied into each call's mask."""
        key = (t, str(device))
        if key not in self._tril:
            self._tril[key] = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        return self._tril[key]

    def __call__(self, *inputs, cache_start: int, t: int, mask: torch.Tensor | None = None):
        end = cache_start + t
        device = inputs[0].device
        kv_len = kv_len_for(end, self.cache_owner.cache.max_len)
        if mask is None:
            mask = self._causal(t, device)
        seen = end - mask.shape[1]
        if seen < 0 or mask.shape[0] != t:
            raise ValueError(f"{self.name}: mask {tuple(mask.shape)} does not fit {t} tokens after {cache_start}")
        full = torch.zeros(t, kv_len, dtype=torch.bool, device=device)
        full[:, :seen] = True
        full[:, seen:end] = mask
        slots = torch.arange(cache_start, end, device=device)
        if self.compiled:
            shape = (1 if t == 1 else "t" if self.dynamic_t else t, self.state() if self.state else None)
            if self.skip_guards and shape in self._warm:
                # Why: evaluating the guards cost 1.1 ms a call of the target (each of its tensors is
                # checked), 6 % of a decoding step; measured 1167 -> 52 us a call. The first call of each
                # shape runs them all, so a graph that another engine's structure would fail is told
                # apart by a guard that failed, which torch then keeps checking. The inputs are marked
                # dynamic only where a graph may be traced (marking them cost ~80 us a call).
                try:
                    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                        return self._fn(*inputs, slots=slots, mask=full)
                except RuntimeError as e:
                    # A guard that tells graphs apart failed (say, another engine on the same model gave
                    # it a new KV cache): torch refuses, before running anything; so compile with all
                    # guards, as any first call does.
                    if "skip_guard_eval_unsafe" not in str(e):
                        raise
                    self._warm.clear()
            self._mark_dynamic(full, slots, inputs, t)
            self._warm.add(shape)
        return self._fn(*inputs, slots=slots, mask=full)

    def _mark_dynamic(self, full, slots, inputs, t: int) -> None:
        """The sizes a graph is traced with symbolically: the mask's cache length, and with dynamic_t the t
        (dim 1 of every input of two or more dims; a 1-D input is the same size for every t)."""
        torch._dynamo.mark_dynamic(full, 1)
        if self.dynamic_t and t > 1:
            for x in (full, slots):
                torch._dynamo.mark_dynamic(x, 0)
            for x in inputs:
                if x.dim() > 1:
                    torch._dynamo.mark_dynamic(x, 1)


def compile_fn(fn, mode: str, packed: bool = False):
    """torch.compile(fn, mode=mode, fullgraph=True). packed: every GEMM of `fn` runs on cpugemm's op
    (the CPU fp32 path); then inductor's freezing is off for this function and its C++ wrapper on.

    Why no freezing: it is there to let inductor prepack its own GEMMs; with none left it buys nothing,
    and it costs each graph ~6 s more in every new process (the freezing passes run before the FX graph
    cache lookup): warm start ~10 s a graph -> ~4 s."""
    configure_inductor()
    if not packed:
        return torch.compile(fn, mode=mode, fullgraph=True)
    # Why the C++ wrapper: with the GEMMs ours, the per-call cost is no longer the GEMMs alone:
    # inductor's Python wrapper runs ~2,200 allocations, views and launches a call (2.5-3 ms of a
    # 25 ms step). Its C++ wrapper measured 7-12 % faster for every verification size and 6 % for the
    # draft calls (two engines on separate weights, interleaved in one process, outputs identical).
    # CUDA graphs do not apply on CPU; leaving them on only makes inductor warn about the C++ wrapper.
    options = {k: v for k, v in torch._inductor.list_mode_options(mode).items() if k != "triton.cudagraphs"}
    return torch.compile(fn, fullgraph=True, options={**options, "freezing": False, "cpp_wrapper": True})


def default_mode(device: torch.device) -> str:
    return "max-autotune" if device.type == "cpu" else "max-autotune-no-cudagraphs"
