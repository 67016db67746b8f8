# How fast does the target compute features in the training loop: eager fp32, eager bf16, compiled bf16?
import time, torch
from eaglespec.loading import load_target
from eaglespec.features import target_features
torch.manual_seed(0)
t, _ = load_target(None)
ids = torch.randint(0, 49152, (4, 1000))
def run(fwd, ac, n=3):
    with torch.no_grad(), ac():
        target_features(fwd, ids)
        s = time.perf_counter()
        for _ in range(n):
            f = target_features(fwd, ids)
        return ids.numel() * n / (time.perf_counter() - s), f
import contextlib
bf = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
r32, f32 = run(t, contextlib.nullcontext)
print(f"eager fp32 {r32:.0f} tok/s", flush=True)
r16, f16 = run(t, bf)
print(f"eager bf16 {r16:.0f} tok/s, max diff {(f16.float()-f32).abs().max():.3f}", flush=True)
c = torch.compile(t, dynamic=True)
rc, fc = run(c, bf)
print(f"compiled bf16 {rc:.0f} tok/s, max diff vs eager bf16 {(fc.float()-f16.float()).abs().max():.3f}", flush=True)
