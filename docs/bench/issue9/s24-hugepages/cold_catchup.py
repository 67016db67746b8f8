"""Is a round's catch-up slow because the verification evicted the head's weights from L3?
verify(4) then catch-up, timing the catch-up; with and without touching the head's buffers in between."""
import os, signal, time, statistics, torch
from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig
pause = int(os.environ.get("PAUSE", 0))
if pause: os.kill(pause, signal.SIGSTOP)
try:
    e = Engine.load(compile=True, tree=TreeConfig(auto=True))
    e.warmup()
    ctx = 256
    bufs = [b for m in [e.head, e._draft_lm] for n, b in m.named_buffers() if n.endswith('packed')]
    mb = sum(b.numel() * b.element_size() for b in bufs) / 2**20
    emb = e.model.embed_tokens.weight
    print(f"head + draft LM head buffers: {mb:.1f} MiB ({len(bufs)} tensors)")
    def catch():
        t0 = time.perf_counter(); e.time_draft_call("first", ctx); return time.perf_counter() - t0
    def verify(n=4):
        t0 = time.perf_counter(); e.time_verify_call(n, ctx); return time.perf_counter() - t0
    def touch():
        t0 = time.perf_counter()
        for b in bufs:
            b.view(-1)[:: max(1, 64 // b.element_size())].sum()  # one read per cache line
        return time.perf_counter() - t0
    with torch.inference_mode():
        for _ in range(20): catch(); verify(); touch()
        for rep in range(3):
            cold, warm, hot, tt, vv, t2 = [], [], [], [], [], []
            for _ in range(60):
                vv.append(verify()); cold.append(catch())
                verify(); tt.append(touch()); t2.append(touch()); warm.append(catch())
                hot.append(catch())
            m = lambda x: 1e3 * statistics.median(x)
            print(f"verify(4) {m(vv):.3f} ms | catch-up after verify {m(cold):.3f} ms, after verify + touch {m(warm):.3f} ms "
                  f"(touch {m(tt):.3f} ms, again {m(t2):.3f}), after a catch-up {m(hot):.3f} ms")
finally:
    if pause: os.kill(pause, signal.SIGCONT)
