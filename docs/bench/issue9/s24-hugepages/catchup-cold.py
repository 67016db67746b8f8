"""Why a round's catch-up costs twice what it costs hot: the catch-up call timed after each of several things
(a verification, a 64 MiB fill, sleeping, spinning, the head's weights read back into L3, another catch-up).

    PAUSE=PID python catchup-cold.py       (with OMP_WAIT_POLICY=ACTIVE for the spinning-workers variant)
"""
import os, signal, time, statistics, torch
from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig
pause = int(os.environ.get("PAUSE", 0))
if pause: os.kill(pause, signal.SIGSTOP)
try:
    e = Engine.load(compile=True, tree=TreeConfig(auto=True))
    e.warmup()
    ctx = 256
    big = torch.zeros(64 << 20, dtype=torch.uint8)
    weights = [b for m in [e.head, e._draft_lm] for n, b in m.named_buffers() if n.endswith("packed")]
    def catch():
        t0 = time.perf_counter(); e.time_draft_call("first", ctx); return time.perf_counter() - t0
    def sleep(): time.sleep(0.005)
    def spin():
        t = time.perf_counter() + 0.005
        while time.perf_counter() < t: pass
    def touch():  # one read per cache line of the head's and the draft LM head's packed weights
        for b in weights:
            b.view(-1)[::64].sum()
    prev = {"verify(4)": lambda: e.time_verify_call(4, ctx), "verify(1)": lambda: e.time_verify_call(1, ctx),
            "64 MiB fill (1 thread)": lambda: big.fill_(1), "sleep 5 ms": sleep, "spin 5 ms": spin, "catch-up": catch,
            "verify(4) + sleep 5 ms": lambda: (e.time_verify_call(4, ctx), sleep()),
            "verify(4) + the head's weights read back": lambda: (e.time_verify_call(4, ctx), touch())}
    with torch.inference_mode():
        for f in prev.values(): f(); catch()
        res = {k: [] for k in prev}
        for _ in range(40):
            for k, f in prev.items():
                f(); res[k].append(catch())
        print(f"head + draft LM head weights: {sum(b.numel() for b in weights) / 2**20:.1f} MiB")
        for k, v in res.items():
            print(f"catch-up after {k}: {1e3 * statistics.median(v):.3f} ms")
finally:
    if pause: os.kill(pause, signal.SIGCONT)
