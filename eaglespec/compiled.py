"""Compiled forwards for the decoding hot path.

On CPUs, eager matmuls with few rows are slow (MKL repacks the weights every call; see
shared cpu-notes): inductor's own GEMMs run a 1-token step ~2x and an 8-16-token verification
~3x faster. Compiled graphs want fixed shapes, so the number of tokens per call is fixed per call
site, the cache is written in place through slot indices, and attention reads a cache prefix whose
length is rounded up to a bucket (the mask hides the rest) and marked dynamic, so a growing
context does not trigger a recompile.
"""
from __future__ import annotations

import torch

KV_BUCKET = 128


def _configure_inductor():
    import torch._inductor.config as ic
    import torch._inductor.select_algorithm as sa
    ic.freezing = True  # weights become constants: lets inductor pick and prepack its own GEMMs
    ic.autotune_num_choices_displayed = 0
    ic.max_autotune_report_choices_stats = False
    sa.PRINT_AUTOTUNE = False  # its per-kernel tables would drown the generated text


class CompiledForward:
    """Wraps `module(x, ..., mask=, cache_start=)` (target or head) with a compiled static-shape call."""

    def __init__(self, module, cache_owner, mode: str | None = None):
        _configure_inductor()
        self.module, self.cache_owner = module, cache_owner
        device = next(module.parameters()).device
        mode = mode or ("max-autotune" if device.type == "cpu" else "max-autotune-no-cudagraphs")
        self._fn = torch.compile(self._run, mode=mode, fullgraph=True)

    def _run(self, *inputs, slots, mask):
        return self.module(*inputs, mask=mask, cache_start=slots)

    def __call__(self, *inputs, cache_start: int, mask: torch.Tensor | None = None):
        t = inputs[0].shape[1]
        end = cache_start + t
        device = inputs[0].device
        max_len = self.cache_owner.cache.max_len
        kv_len = min(-(-end // KV_BUCKET) * KV_BUCKET, max_len)
        full = torch.zeros(t, kv_len, dtype=torch.bool, device=device)
        if mask is None:
            full[:, :end] = torch.ones(t, end, dtype=torch.bool, device=device).tril(cache_start)
        else:
            full[:, :end] = mask
        torch._dynamo.mark_dynamic(full, 1)
        slots = torch.arange(cache_start, end, device=device)
        return self._fn(*inputs, slots=slots, mask=full)
