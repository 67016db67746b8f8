"""How big a tree pays: the measured cost of verifying n tokens and of drafting, and the per-round
choice of tree size and depth that maximises expected tokens per second.

    rate(n, depth) = (1 + sum of P(node accepted) over the n-1 best nodes) / (T_draft(depth) + T_verify(n))

P(node accepted) is the product of draft probabilities along the node's path (exp of its cumulative
log-probability), calibrated online per depth against the acceptance actually observed. T comes
from a calibration table measured once per (model, device, dtype, torch version, threads, mode) and
cached under ~/.cache/eaglespec/calibration. On a CPU T(n) grows quickly with n, so the rule picks
small trees; on a GPU T(n) is nearly flat, so the same rule picks large ones.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# Verification sizes (root included) the auto policy picks from. 2 and 3 are there because on a CPU
# verifying 2-3 tokens costs about a plain step (T(2)/T(1) 1.01 measured) while 4 costs 1.15-1.3: with a
# head whose drafts rarely survive past depth 1, root + best candidate(s) is often the best rate. Measured
# interleaved on 40 MT-bench turns (T = 0, quiet, 2026-12-03): 1.153x -> 1.186x and 1.183x -> 1.200x;
# finer sizes (5, 7, 10) gained nothing. One dynamic verification graph serves them all: no compile cost.
AUTO_BUCKETS = (2, 3, 4, 6, 8, 12, 16)


@dataclass
class CostTable:
    verify_ms: dict[int, float]        # n tokens verified (root included) -> ms; n = 1 is a plain step
    draft_first_ms: float              # head catch-up on the accepted tokens + depth 1's top-k
    draft_step_ms: float               # one further depth of the frontier
    key: dict = field(default_factory=dict)
    context: int = 256                 # cached prefix length the calls were timed after
    # n tokens verified with the head's catch-up and depth 1 inside the same call (greedy rounds, engine's
    # fused verification) -> ms; empty in tables from before it, or without a head
    fused_verify_ms: dict[int, float] = field(default_factory=dict)
    # the same for sampled rounds, whose call also runs the rejection sampling (Engine._fused_sampled_fn)
    sampled_fused_ms: dict[int, float] = field(default_factory=dict)

    def t_verify(self, n: int, fused: bool = False, sampled: bool = False) -> float:
        """Verifying n tokens; fused: with the head's catch-up and depth 1 in the same call (sampled: the sampled
        rounds' call, which also runs the rejection sampling; the greedy one's time where it was not timed)."""
        if fused:
            if sampled and self.sampled_fused_ms:
                return _interpolate(self.sampled_fused_ms, n)
            if self.fused_verify_ms:
                return _interpolate(self.fused_verify_ms, n)
            return _interpolate(self.verify_ms, n) + self.draft_first_ms  # not measured: the two calls' sum
        return _interpolate(self.verify_ms, n)

    def t_draft(self, depth: int, fused: bool = False) -> float:
        """Drafting `depth` levels; fused: depth 1 came with the last verification, so only deeper ones cost."""
        return (0.0 if fused else self.draft_first_ms) + max(0, depth - 1) * self.draft_step_ms

    def ratios(self) -> dict[int, float]:
        base = self.verify_ms.get(1) or self.t_verify(1)
        return {n: t / base for n, t in sorted(self.verify_ms.items())}

    def to_json(self) -> dict:
        d = asdict(self)
        d["verify_ms"] = {str(k): v for k, v in self.verify_ms.items()}
        d["ratios"] = {str(k): round(v, 3) for k, v in self.ratios().items()}
        d["fused_verify_ms"] = {str(k): v for k, v in self.fused_verify_ms.items()}
        d["sampled_fused_ms"] = {str(k): v for k, v in self.sampled_fused_ms.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CostTable":
        return cls({int(k): float(v) for k, v in d["verify_ms"].items()}, float(d["draft_first_ms"]),
                   float(d["draft_step_ms"]), d.get("key", {}), int(d.get("context", 256)),
                   {int(k): float(v) for k, v in d.get("fused_verify_ms", {}).items()},
                   {int(k): float(v) for k, v in d.get("sampled_fused_ms", {}).items()})


def _interpolate(table: dict[int, float], n: int) -> float:
    """Linear between the measured sizes; beyond the largest, in proportion to n."""
    if n in table:
        return table[n]
    xs = sorted(table)
    lo = max((x for x in xs if x <= n), default=xs[0])
    hi = min((x for x in xs if x >= n), default=xs[-1])
    if lo == hi:
        return table[lo] * (n / lo if n > lo else 1.0)
    w = (n - lo) / (hi - lo)
    return table[lo] * (1 - w) + table[hi] * w


# ---- measuring ----------------------------------------------------------------------------------

def gemm_name(engine) -> str:
    if not getattr(engine, "packed_gemm", False):
        return "torch"
    from .model import Attention
    from .cpugemm import panel_width
    name = "packed" if panel_width() == 8 else f"packed{panel_width()}"  # "packed": the AVX2 kernel, as before
    if any(isinstance(m, Attention) and m.small_attention for m in engine.model.modules()):
        name += "+attn"  # cpugemm's attention kernel too
    if any(getattr(m, "kind", 0) for m in engine.model.modules()):
        name += "+gguf"  # weights kept as their GGUF blocks (cpugemm.quant_mm): other costs
        if any(getattr(m, "kind", 0) > 10 for m in engine.model.modules()):
            name += "-int8"  # ... times int8 activations (EAGLESPEC_CPU_QUANT=int8): other costs again
    if any(getattr(m, "on_huge_pages", False) for m in engine.model.modules()):
        name += "+huge"  # the packed weights on 2 MiB pages (cpugemm.onto_huge_pages): a faster step
    if engine.head is not None and any(getattr(m, "kind", 0) for m in engine.head.modules()):
        name += "+q8draft"  # the head's linears rounded to Q8_0 blocks (cpugemm.packed_copy): other draft costs
    return name


def table_key(engine) -> dict:
    w = engine.model.embed_tokens.weight
    h = engine.head
    return {
        "model": getattr(engine, "model_source", "unknown"),
        "model_shape": [engine.model.args.num_hidden_layers, engine.model.args.hidden_size,
                        engine.model.args.vocab_size],
        "draft_vocab": None if engine._draft_ids is None else int(engine._draft_ids.numel()),
        "head_shape": None if h is None else [h.args.hidden_size, h.args.intermediate_size],
        "head_arch": None if h is None else type(h).__name__,  # EAGLE-3 drafts with its own LM head: other costs
        "top_k": engine.tree.draft_top_k,
        "device": str(w.device.type) + ("" if w.device.type != "cuda" else ":" + torch.cuda.get_device_name(w.device)),
        "dtype": str(w.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "mode": engine.compile_mode or "eager",
        "gemm": gemm_name(engine),  # cpugemm.py, and which of its kernels: other costs
        # the kernels' own version: a table timed on older kernels (T(16) was 16 % slower before the
        # transposed-x pass) must not size trees for newer ones
        "kernels": cpugemm_version() if getattr(engine, "packed_gemm", False) else None,
    }


def cpugemm_version() -> str:
    from .cpugemm import _SOURCE
    return hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]


def cache_path(key: dict) -> Path:
    from .loading import cache_root
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "calibration" / f"{digest}.json"


def _median_ms(fn, reps: int) -> float:
    fn()  # compile / warm caches
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


# the fused calls a table times, by needed_calls' key -> (CostTable field, time_verify_call's `sampled`)
FUSED_CALLS = {"fused": ("fused_verify_ms", False), "sampled-fused": ("sampled_fused_ms", True)}


def needed_calls(engine, sizes, greedy: bool | None) -> dict[str, list]:
    """What the tree policies of generations at this temperature read (greedy True / False; None: both), by
    call: "verify" sizes, "fused" and "sampled-fused" sizes and the "draft" calls (Engine.calls_for). Rounds
    of an engine that fuses the catch-up are sized by their fused call and never run the separate
    verification sizes or catch-up. Timing only what is used spares a first run compiling graphs it never
    calls (each of the target's takes ~80 s to compile here)."""
    separate, fused, sampled = engine.calls_for(greedy)
    need = {"verify": [n for n in sizes if n == 1 or separate], "fused": [], "sampled-fused": [], "draft": []}
    if engine.head is not None:
        need["fused"] = [n for n in sizes if n > 1] if fused else []
        need["sampled-fused"] = [n for n in sizes if n > 1] if sampled else []
        need["draft"] = ["first", "step"] if separate else ["step"]
    return need


def _fused_ms(table: CostTable, call: str) -> dict[int, float]:
    return getattr(table, FUSED_CALLS[call][0])


def covers(table: CostTable, need: dict[str, list]) -> bool:
    return (all(n in table.verify_ms for n in need["verify"])
            and all(n in _fused_ms(table, c) for c in FUSED_CALLS for n in need.get(c, []))
            and ("first" not in need["draft"] or table.draft_first_ms > 0)
            and ("step" not in need["draft"] or table.draft_step_ms > 0))


def measure(engine, sizes=CALIBRATION_SIZES, reps: int = 15, context: int = 256, progress=None,
            need: dict[str, list] | None = None) -> CostTable:
    """Time verification of n tokens (alone, and with the head's catch-up inside where the engine fuses
    them) and the two draft calls at a `context`-token prefix; `need` (needed_calls) narrows it to what
    the engine uses (default: what generations at either temperature use).

    The calls are timed round-robin (every size once per repetition), not one size after another:
    this CPU's speed drifts by tens of percent within minutes (memory bandwidth shared with other
    tenants), and timed in sequence such a drift lands on some sizes only and skews T(n)/T(1)."""
    if need is None:
        need = needed_calls(engine, sizes, None)
    calls = {("verify", n): (lambda n=n: engine.time_verify_call(n, context)) for n in need["verify"]}
    calls.update({("draft", which): (lambda which=which: engine.time_draft_call(which, context))
                  for which in need["draft"]})
    for c, (_, sampled) in FUSED_CALLS.items():
        calls.update({(c, n): (lambda n=n, sampled=sampled: engine.time_verify_call(n, context, fused=True,
                                                                                     sampled=sampled))
                      for n in need.get(c, [])})
    for name, fn in calls.items():  # compile / warm caches
        if progress:
            progress(f"{name[0]} {name[1]}")
        fn()
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ms = {name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()}
    return CostTable({n: ms[("verify", n)] for n in need["verify"]}, ms.get(("draft", "first"), 0.0),
                     ms.get(("draft", "step"), 0.0), table_key(engine), context,
                     {n: ms[("fused", n)] for n in need.get("fused", [])},
                     {n: ms[("sampled-fused", n)] for n in need.get("sampled-fused", [])})


def load_table(engine) -> CostTable | None:
    path = cache_path(table_key(engine))
    if path.is_file():
        try:
            return CostTable.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            return None  # a damaged cache entry is remeasured, not fatal
    return None


def save_table(table: CostTable) -> Path:
    path = cache_path(table.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.to_json(), indent=2))
    tmp.replace(path)
    return path


STALE_TOLERANCE = 1.3   # a cached T(n) this far off the live one (either way) is remeasured
STALE_SLACK_MS = 0.5    # ...unless the gap is below timer noise (tiny models)


def stale_sizes(engine, table: CostTable, sizes, reps: int = 5) -> dict[int, tuple[float, float]]:
    """Re-time the smallest and largest of `sizes` now; {n: (cached ms, live ms)} for those that are off.

    The key (model, device, dtype, torch, threads, mode) cannot tell a table timed on a loaded machine
    (another job on the cores, a thermal state) from one timed quietly, and such a table skews every
    auto-tree choice: T(1) cached at 115 ms against a live 27 ms step was seen on our CPU. Two timings
    of a few calls each (well under a second on the default model) catch it. The largest size goes through
    the call this engine's rounds make (needed_calls): its warm-up compiled that one, and either tells
    whether the machine is as it was; a size the table lacks is not checked."""
    need = needed_calls(engine, sizes, engine.warmed_for)
    off = {}
    for n in sorted({min(sizes), max(sizes)}):
        call = next((c for c in FUSED_CALLS if n in need[c] and n in _fused_ms(table, c)), None)
        cached = _fused_ms(table, call)[n] if call else table.verify_ms.get(n)
        if cached is None:
            continue
        live = _median_ms(lambda: engine.time_verify_call(n, table.context, fused=call is not None,
                                                          sampled=call == "sampled-fused"), reps)
        if abs(live - cached) > STALE_SLACK_MS and max(live / cached, cached / live) > STALE_TOLERANCE:
            off[n] = (cached, live)
    return off


def load_or_measure(engine, sizes, progress=None, log=None) -> CostTable:
    """The cached table if it covers what this engine reads at `sizes` (needed_calls) and still matches this
    machine's live timings, else a measurement of what it lacks, or of everything it needs if the machine
    changed (then cached). `log` gets a one-line notice when a stale table is replaced."""
    need = needed_calls(engine, sizes, engine.warmed_for)
    table = load_table(engine)
    context = 256 if table is None else table.context
    if table is not None and 1 in table.verify_ms:
        off = stale_sizes(engine, table, sizes)
        if off:
            if log:
                log("cached calibration does not match this machine now (" +
                    ", ".join(f"T({n}) {c:.1f} ms cached, {v:.1f} ms live" for n, (c, v) in off.items()) +
                    "); re-measuring: run `eaglespec calibrate` on a quiet machine for a full table")
            table = None  # its other sizes were timed under the same conditions: drop them too
        elif covers(table, need):
            return table
    if table is not None:  # it matches the machine but lacks some calls (say, a greedy run's table, now sampling)
        need = {"verify": [n for n in need["verify"] if n not in table.verify_ms],
                **{c: [n for n in need[c] if n not in _fused_ms(table, c)] for c in FUSED_CALLS},
                "draft": [w for w in need["draft"]
                          if not (table.draft_first_ms if w == "first" else table.draft_step_ms) > 0]}
    fresh = measure(engine, sizes, reps=7, context=context, progress=progress, need=need)
    if table is not None:  # keep what was measured before (a full `calibrate`, or another temperature's run)
        fresh = CostTable({**table.verify_ms, **fresh.verify_ms}, fresh.draft_first_ms or table.draft_first_ms,
                          fresh.draft_step_ms or table.draft_step_ms, fresh.key, context,
                          {**table.fused_verify_ms, **fresh.fused_verify_ms},
                          {**table.sampled_fused_ms, **fresh.sampled_fused_ms})
    save_table(fresh)
    return fresh


# ---- the per-round policy -----------------------------------------------------------------------

class TreePolicy:
    """Chooses each round's draft depth (before drafting) and verified size (after drafting)."""

    def __init__(self, table: CostTable, buckets: tuple[int, ...], max_depth: int, ema: float = 0.05,
                 fused: bool = False, sampled: bool = False, online: bool = True):
        """fused: rounds verify with the head's catch-up and depth 1 in the same call, so depth 1 costs no
        drafting and each size costs the fused call (sampled: the sampled rounds' one). online: correct the
        table's verification times by those the rounds measure (observe_time)."""
        self.table, self.buckets, self.max_depth, self.ema = table, tuple(sorted(buckets)), max_depth, ema
        self.fused, self.sampled = fused, sampled
        # per depth: observed and predicted chance that the accepted path reaches it (calibration);
        # a prior of a few pseudo-rounds at factor 1 keeps early rounds sane
        self.obs = [1.0] * (max_depth + 1)
        self.pred = [1.0] * (max_depth + 1)
        self.depth_estimate = float(max(1, min(max_depth, 4)))
        self.rounds = 0
        # The verification's cost as rounds measure it (observe_time): per size, the measured / table ratio
        # (mean of the first few, then an EMA), and over all sizes one EMA, for the sizes not seen yet. Why: one
        # table is timed once, and this machine's speed swings by tens of percent within minutes, not evenly
        # across sizes (tables taken while other tenants run have T(8)/T(1) 2.0 against 1.6 quiet), so a table
        # taken at a busy moment sized every tree of a whole run wrongly. online False: the table alone.
        self.online = online
        self.time_factor: dict[int, float] = {}
        self.time_seen: dict[int, int] = {}
        self.mean_time_factor = 1.0

    def factor(self, depth: int) -> float:
        return min(2.0, max(0.02, self.obs[depth] / max(self.pred[depth], 1e-6)))

    def depth(self) -> int:
        """Depth to draft this round: the recent best in hindsight, one deeper now and then to look."""
        d = int(round(self.depth_estimate))
        if self.rounds % 8 == 7:
            d += 1
        return max(1, min(self.max_depth, d))

    def _curves(self, scores: list[float], depths: list[int], drafted: int, free=frozenset()) -> list[list[float]]:
        """curves[d][m]: expected tokens from verifying the m best candidates of depth <= d (root's 1 included).
        `free` candidates (the n-gram chain's) need no drafting depth and carry calibrated scores of their own."""
        order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: parents first on ties
        self._order = order
        curves = [[1.0]]
        for dmax in range(1, drafted + 1):
            mass, cum = 1.0, [1.0]
            for i in order:
                if i in free:
                    mass += math.exp(scores[i])
                    cum.append(mass)
                elif depths[i] <= dmax:
                    mass += self.factor(depths[i]) * math.exp(scores[i])
                    cum.append(mass)
            curves.append(cum)
        return curves

    TIME_EMA = 0.05   # weight of one round's measured time
    TIME_SEEN = 8     # rounds of a size before its own ratio is used (before: the mean over all sizes)

    def t_verify(self, n: int) -> float:
        """Verifying n tokens: the table's time, corrected by what rounds measured (observe_time)."""
        t = self.table.t_verify(n, self.fused, self.sampled)
        if not self.online:
            return t
        return t * (self.time_factor[n] if self.time_seen.get(n, 0) >= self.TIME_SEEN else self.mean_time_factor)

    def t_draft(self, depth: int) -> float:
        """Drafting `depth` levels: the table's time, scaled as the verification's is on average (the machine's
        speed of the moment; the draft calls' own times are not fed back)."""
        return self.table.t_draft(depth, self.fused) * (self.mean_time_factor if self.online else 1.0)

    def observe_time(self, n: int, ms: float) -> None:
        """A round verified n tokens in `ms` (the call, acceptance and the cache's compaction: what a round pays)."""
        if not self.online:
            return
        r = ms / self.table.t_verify(n, self.fused, self.sampled)
        seen = self.time_seen.get(n, 0) + 1
        old = self.time_factor.get(n, self.mean_time_factor)
        r = min(2.0 * old, max(0.5 * old, r))  # one preempted call moves an estimate a little; a lasting change, all the way
        self.time_factor[n] = old + max(self.TIME_EMA, 1.0 / seen) * (r - old)
        self.time_seen[n] = seen
        total = sum(self.time_seen.values())
        self.mean_time_factor += max(self.TIME_EMA, 1.0 / (1 + total)) * (r - self.mean_time_factor)

    def _best(self, cum: list[float], t_draft: float) -> tuple[float, int]:
        """(rate, n) of the best bucket that this many candidates can fill."""
        fits = [b for b in self.buckets if b - 1 < len(cum)] or [self.buckets[0]]
        return max((cum[min(b - 1, len(cum) - 1)] / (t_draft + self.t_verify(b)), -b) for b in fits)

    def choose(self, scores: list[float], depths: list[int], drafted: int,
               free=frozenset()) -> tuple[int, list[int]]:
        """Given every candidate's cumulative log-prob and depth (host lists), pick the verified size n
        (a bucket, root included) and the kept candidates (ascending, a connected tree). Also learns,
        in hindsight, which depth would have paid best this round, for the next round's drafting.
        free: candidates that cost no drafting (the n-gram chain's), scored as calibrated log-probs."""
        curves = self._curves(scores, depths, drafted, free)
        # drafting is already paid for: only the verification cost differs between sizes
        _, neg_n = self._best(curves[drafted], self.t_draft(drafted))
        n = -neg_n
        best_d = max(range(1, drafted + 1), key=lambda d: self._best(curves[d], self.t_draft(d))[0])
        self.depth_estimate += 0.25 * (best_d - self.depth_estimate)
        keep = sorted(self._order[:n - 1])
        return len(keep) + 1, keep

    def observe(self, kept_scores: list[float], kept_depths: list[int], accepted_depth: int):
        """Calibrate: predicted vs observed chance of the accepted path reaching each depth."""
        self.rounds += 1
        reach = [0.0] * (self.max_depth + 1)
        for s, d in zip(kept_scores, kept_depths):
            reach[d] += math.exp(s)
        a = self.ema
        for d in range(1, self.max_depth + 1):
            if reach[d] > 0:
                self.pred[d] += a * (min(1.0, reach[d]) - self.pred[d])
                self.obs[d] += a * (float(accepted_depth >= d) - self.obs[d])


class SpecSwitch:
    """Whether a round speculates at all: the measured time per token of speculative rounds against that
    of plain ones (EMAs over rounds, catch-up and drafting included). The tree policy picks the best tree
    by its model, but when even the best tree loses to a plain step (a flat target distribution at T = 1,
    with a cheap one-token step) speculating costs more than it gives. Then rounds verify the root alone,
    `stretch` of them in a row (as many tokens as the head's catch-up takes at once), and one speculative
    round re-measures before the next stretch. Plain rounds give plain decoding's tokens, so this only
    changes speed."""

    def __init__(self, plain_ms_prior: float, stretch: int, ema: float = 0.1):
        self.plain_ms, self.spec_ms, self.stretch, self.ema = plain_ms_prior, None, max(1, stretch), ema
        self.plain_measured = False

    def plain_next(self, pending: int) -> bool:
        """True if the next round should be plain; `pending`: plain rounds since the head last caught up."""
        if self.spec_ms is None or self.spec_ms <= self.plain_ms:
            return False
        return pending < self.stretch

    def record(self, speculative: bool, seconds: float, tokens: int) -> None:
        ms = 1e3 * seconds / max(1, tokens)
        if speculative:
            self.spec_ms = ms if self.spec_ms is None else self.spec_ms + self.ema * (ms - self.spec_ms)
        elif not self.plain_measured:  # the first measured plain round replaces the table's prior
            self.plain_ms, self.plain_measured = ms, True
        else:
            self.plain_ms += self.ema * (ms - self.plain_ms)


class RankAcceptance:
    """What a sampled draft's nodes are worth, for trees whose shape must not look at the drafted tokens.

    With sampled drafts (T > 0; `verify.verify_sampled`), a node's children are a sample without replacement
    from the head's distribution, tried in order. Lossless needs the tree's shape to be chosen without looking
    at those samples: keeping a node because its own token looks likely (as `TreePolicy` does with the
    drafts' scores) would bias the output. So a node is scored by its position alone, learned online:
    a(d, r) = P(the r-th child tried at depth d is accepted | its parent was, and its elder siblings were
    not), counted over the rounds so far with a prior, and a node's score is log of the chance that the
    accepted path runs through it: the sum over its path of log(a(d, r) * prod_{j<r} (1 - a(d, j)))."""

    PRIOR_FIRST, PRIOR_LATER, PRIOR_WEIGHT = 0.4, 0.2, 20.0
    HALF_LIFE = 2000.0   # the counts are halved past this many trials a cell: the estimate follows a drift

    def __init__(self, max_depth: int, k: int):
        self.k = k
        prior = [self.PRIOR_FIRST] + [self.PRIOR_LATER] * (k - 1)
        self.hits = [[p * self.PRIOR_WEIGHT for p in prior] for _ in range(max_depth + 1)]
        self.tries = [[self.PRIOR_WEIGHT] * k for _ in range(max_depth + 1)]

    def accept(self, depth: int, rank: int) -> float:
        return min(0.99, max(0.01, self.hits[depth][rank] / self.tries[depth][rank]))

    def log_scores(self, depth: int) -> list[float]:
        """log P(the path runs through the rank-r child | it reaches the parent), r = 0..k-1, made
        strictly decreasing in r so that the kept children of any node are always its first ones."""
        out, left, prev = [], 1.0, float("inf")
        for r in range(self.k):
            a = self.accept(depth, r)
            s = math.log(max(a * left, 1e-9))
            s = min(s, prev - 1e-6)
            out.append(s)
            prev, left = s, left * (1.0 - a)
        return out

    def observe(self, trials: list[tuple[int, int, bool]]) -> None:
        """trials: (depth, rank, accepted) of every child the verification tried, in order."""
        for d, r, ok in trials:
            if d < len(self.tries) and r < self.k:
                self.tries[d][r] += 1.0
                self.hits[d][r] += float(ok)
                if self.tries[d][r] > self.HALF_LIFE:
                    self.tries[d][r] *= 0.5
                    self.hits[d][r] *= 0.5
