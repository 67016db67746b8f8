"""`eaglespec regenerate`: the target writes the training answers itself.

A draft head must predict what the *target* writes, not what ChatGPT wrote in ShareGPT. This replays
each conversation's user turns (and its system message) and lets the target answer every one through
its chat template, as `Engine.generate(messages=...)` would (plain decoding, stopping at EOS or the
token budget), then writes the new conversations in the messages format that `features` and `train`
read: `eaglespec features --data OUT` works on the folder unchanged.

Batched: the conversations in flight share one KV cache of `--batch-size` rows (each row its own
conversation, its own positions, its own length; a row that finishes a turn prefills its next turn,
a row that finishes its conversation takes the next one), so every decoding step runs one forward
for all rows. On a CPU the weights are read once per step whatever the rows, which is what batching buys.

OUT/shard-00000.jsonl.gz ... hold `--shard-size` source records each (gzip JSON lines, one conversation
a line: key, messages, temperature, source_index, new_tokens, ...); OUT/manifest.json the settings and
counts. A shard is written to a temporary file and renamed after the manifest names it, so a run
killed at any moment loses only the shards in flight, and a rerun of the same command continues with
the unfinished ones. A rerun with other settings is refused.

`--data self` writes the questions too: each conversation's user message is sampled from the target itself,
given its chat template up to the start of a user turn (Magpie, arXiv 2406.08464), and then answered as any
other. The training text is then entirely the target's, and as plentiful as the time to write it: a source of
data once a dataset is used up. Left to itself the target asks generic questions ("What should I think about before a
career change?"); `--openings` forces each question's first words, drawn by weight from a list ("Write a", "Extract",
"Solve", ...), so that it asks for tasks instead: a pilot (docs/bench/issue10/magpie-steer-pilot.txt) found forced
first words steer it far better than a system message describing the task.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from .cpugemm import linear_kinds
from .data import Conversation, LoadReport, load_conversations, regenerated_shard
from .model import KVCache, Transformer
from .sampling import SamplingParams, next_token
from .stopping import Stopper

FORMAT = "eaglespec-regenerated"
# Settings that decide what a shard holds: a resume must repeat them. --max-conversations may grow
# (the plan of the first shards stays the same) and --batch-size may change (same outputs, ties aside).
RESUME_KEYS = ("model_fingerprint", "dtype", "data", "temperatures", "max_new_tokens", "max_len", "seed", "shard_size",
               "prompt_temperature", "prompt_tokens", "openings")
SELF = "self"  # --data self: the target writes the questions too
SELF_WRITTEN = {"role": "user", "content": None}  # a turn whose question the target writes (plan_turns, Regenerator)
DEFAULT_BATCH = 32  # a rough check on the shared 2-core CPU (decode steps at 300 tokens of context): 32 rows 4.7x, 16 rows 3.8x one row


# ---- settings --------------------------------------------------------------------------------------

def parse_mix(temperature: float | None, mix: str | None) -> list[list[float]]:
    """[[temperature, share], ...] from --temperature T or --mix "0:0.5,0.7:0.5" (shares sum to 1)."""
    if temperature is not None and mix is not None:
        raise ValueError("--temperature and --mix contradict each other: pass one")
    if mix is None:
        t = 0.0 if temperature is None else temperature
        if not t >= 0 or t == float("inf"):
            raise ValueError(f"--temperature must be a number >= 0, got {t}")
        return [[t, 1.0]]
    out = []
    for part in mix.split(","):
        try:
            t, w = (float(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--mix must look like '0:0.5,0.7:0.5' (temperature:share, ...), got '{mix}'") from None
        if not (t >= 0 and w > 0) or float("inf") in (t, w):
            raise ValueError(f"--mix needs temperatures >= 0 and shares > 0, got '{part}'")
        out.append([t, w])
    total = sum(w for _, w in out)
    return [[t, w / total] for t, w in out]


def unit_hash(*parts) -> float:
    """A number in [0, 1) fixed by `parts`: the same conversation gets the same draw in every run."""
    h = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64


def conversation_temperature(mix: list[list[float]], seed: int, key: str) -> float:
    """The temperature a conversation is answered at, drawn from its key (so all parts of a split chat agree)."""
    return draw_share(mix, unit_hash("temperature", seed, key))


def conversation_seed(seed: int, key: str, index: int) -> int:
    return int(unit_hash("sample", seed, key, index) * 2**62)


def self_conversations(n: int, openings: list[list] | None = None, seed: int = 0) -> list[Conversation]:
    """`--data self`: n conversations of one exchange whose question the target writes (keys self-0000000, ...).
    With openings ([[text, share], ...]) each question starts with one of them, drawn from its key."""
    convs = []
    for i in range(n):
        key, turn = f"self-{i:07d}", dict(SELF_WRITTEN)
        if openings:
            turn["opening"] = draw_share(openings, unit_hash("opening", seed, key))
        convs.append(Conversation(key, [turn], i))
    return convs


# What --openings presets hold: the first words of requests for a task (writing with constraints, code, maths,
# extraction, explanation, reasoning, role play), generic verbs and question words only, never a benchmark's text.
# The weights lean on the openings the pilot found to steer well ("Write a", "Extract", "Solve").
OPENING_PRESETS = {
    "tasks": [["Write a", 4], ["Write a Python function", 2], ["Extract", 2], ["Solve", 2], ["Explain", 2],
              ["Summarize", 1], ["Rewrite", 1], ["Compose", 1], ["Create a", 1], ["Describe", 1], ["Compare", 1],
              ["List", 1], ["Given", 1], ["Imagine you are", 1], ["How", 1], ["What", 1], ["Why", 1],
              ["If", 1], ["Suppose", 1], ["Translate", 1]],
}


def parse_openings(spec: str | None) -> list[list] | None:
    """[[text, share], ...] from --openings: a preset name, a file (one opening a line, optionally 'WEIGHT<TAB>text'),
    or 'text:weight,text,...' inline (weight 1 where none is given). Shares sum to 1."""
    if spec is None:
        return None
    if spec in OPENING_PRESETS:
        pairs = OPENING_PRESETS[spec]
    elif Path(spec).expanduser().is_file():
        pairs = []
        for line in Path(spec).expanduser().read_text(encoding="utf-8").splitlines():
            w, tab, text = line.partition("\t")
            if not line.strip():
                continue
            try:
                pairs.append([text, float(w)] if tab else [line, 1.0])
            except ValueError:
                raise ValueError(f"--openings {spec}: a line must be 'text' or 'WEIGHT<TAB>text', got '{line}'") from None
    else:
        pairs = []
        for part in spec.split(","):
            text, colon, w = part.rpartition(":")
            try:
                pairs.append([text, float(w)] if colon else [part, 1.0])
            except ValueError:
                pairs.append([part, 1.0])  # a colon inside the opening itself
    bad = [t for t, w in pairs if not t.strip() or not w > 0 or w == float("inf")]
    if not pairs or bad:
        raise ValueError(f"--openings needs non-empty openings with weights > 0 (a preset: "
                         f"{', '.join(OPENING_PRESETS)}; a file; or 'Write a:2,Solve'), got '{spec}'")
    total = sum(w for _, w in pairs)
    return [[t, w / total] for t, w in pairs]


def draw_share(choices: list[list], u: float):
    """The choice whose cumulative share first exceeds u in [0, 1)."""
    acc = 0.0
    for c, w in choices:
        acc += w
        if u < acc:
            return c
    return choices[-1][0]  # rounding: shares summing to 0.9999...


def plan_turns(messages: list[dict]) -> list[list[dict]]:
    """The conversation as turns to answer: each the system/user messages that precede one answer.
    The source's own answers are dropped; consecutive user messages get one answer after the last."""
    turns, cur = [], []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            continue
        cur.append(m)
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if m["role"] == "user" and nxt != "user":
            turns.append(cur)
            cur = []
    return turns  # trailing system messages after the last question have nothing to answer


def eos_ids(model: Transformer, tokenizer) -> set[int]:
    """The tokens that end a turn: the same set as Engine's (the model's EOS ids and the tokenizer's)."""
    eos = set(model.args.eos_token_id)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return eos


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# ---- the batch KV cache ------------------------------------------------------------------------------

@dataclass
class RowSlots:
    """What `Transformer.forward(cache_start=...)` gets here instead of one shared slot: the cache rows
    the batch's rows are (a slice where that is a plain range, so the cache is read as a view), and
    each new token's slot, which is also its position: every row is its own contiguous sequence."""
    rows: slice | torch.Tensor
    slots: torch.Tensor            # (b, T)


class RowKVCache(KVCache):
    """A KV cache whose rows hold independent sequences of different lengths. model.py passes
    `cache_start` through to `write` untouched, so per-row slots need no change to the model."""

    def write(self, layer: int, start, k: torch.Tensor, v: torch.Tensor, kv_len: int = 0):
        if not isinstance(start, RowSlots):
            return super().write(layer, start, k, v, kv_len)
        kc, vc = self.layer(layer)
        if isinstance(start.rows, slice):
            kr, vr = kc[start.rows], vc[start.rows]  # views: scatter_ writes into the cache itself
            idx = start.slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            kr.scatter_(2, idx, k)
            vr.scatter_(2, idx, v)
            return kr[:, :, :kv_len], vr[:, :, :kv_len]
        rows = start.rows[:, None]
        kc[rows, :, start.slots] = k.transpose(1, 2)
        vc[rows, :, start.slots] = v.transpose(1, 2)
        return kc[start.rows, :, :kv_len], vc[start.rows, :, :kv_len]


class BatchDecoder:
    """Forwards of the target over rows of a RowKVCache: a prompt into one row, or one token for every row.

    The decoding step has one shape: all `batch` rows (a free row feeds a dummy token into its slot 0,
    which the next prompt overwrites) and a cache prefix rounded up to a bucket that the mask trims, so
    compiled (`--compile`) it is one graph. Prompts (one row, any length) stay eager. Eager is the
    default: on the 2-core CPU, compiled measured 2.9x slower at 32 rows (a dynamic-length graph with
    inductor's M = 32 GEMMs), unlike the engine's one-row steps, where compiling wins.

    The target's linears run on cpugemm's packed GEMM where it works (CPU fp32), as the engine's do:
    a 32-row step measured 176 ms against 266 ms with torch's GEMM (interleaved, quiet), and the
    answers are then computed with the same arithmetic that `eaglespec generate` uses."""

    def __init__(self, model: Transformer, batch: int, max_len: int, compile_mode: str | None = None):
        self.model, self.batch, self.max_len = model, batch, max_len
        from .engine import _pack_target
        self.packed_gemm = _pack_target(model, None)
        w = model.embed_tokens.weight
        a = model.args
        self.device = w.device
        from .compiled import KV_BUCKET
        # One bucket longer than any prefix read: a read of the whole cache would be specialised by the
        # compiler (a slice to the full length) and break the one dynamic-length graph.
        self._cache_len = -(-max_len // KV_BUCKET) * KV_BUCKET + KV_BUCKET
        self.cache = RowKVCache(a.num_hidden_layers, batch, a.num_key_value_heads, self._cache_len, a.head_dim,
                                w.dtype, w.device)
        self.compiled = compile_mode is not None
        if self.compiled:
            from .compiled import configure_inductor
            configure_inductor(self.device, w.dtype)
            self._step = torch.compile(self._step_fn, mode=compile_mode, fullgraph=True)
        else:
            self._step = self._step_fn

    def _run(self, fn, *args, **kw):
        saved, self.model.cache = self.model.cache, self.cache  # the model's own cache is left as it was
        try:
            return fn(*args, **kw)
        finally:
            self.model.cache = saved

    def _forward(self, tokens, positions, rows, mask, logits: bool):
        return self.model(tokens, positions, mask=mask, cache_start=RowSlots(rows, positions), logits=logits)

    def _step_fn(self, tokens, positions, mask):
        _, logits = self._forward(tokens, positions, slice(0, self.batch), mask, logits=True)
        return logits[:, 0]

    def prefill(self, row: int, ids: list[int], keep: int) -> torch.Tensor:
        """Write ids[keep:] into `row` after its first `keep` cached tokens (a previous turn's, when they
        are the same); the logits (V,) after the last one."""
        dev, n = self.device, len(ids)
        keep = min(keep, n - 1)  # at least one token runs, for its logits
        tokens = torch.tensor([ids[keep:]], device=dev)
        positions = torch.arange(keep, n, device=dev)[None]
        mask = (torch.arange(n, device=dev)[None] <= positions[0, :, None])[None, None]  # (1, 1, T, n): causal
        feats, _ = self._run(self._forward, tokens, positions, slice(row, row + 1), mask, logits=False)
        return self.model.lm_head(feats[0, -1])

    def step(self, rows: list[int], tokens: list[int], lengths: list[int]) -> torch.Tensor:
        """Each row rows[i] feeds tokens[i] at its position lengths[i] (its cached length); logits (b, V)."""
        from .compiled import kv_len_for
        dev = self.device
        tok, pos = [0] * self.batch, [0] * self.batch  # free rows: a dummy token at slot 0
        for r, t, n in zip(rows, tokens, lengths):
            tok[r], pos[r] = t, n
        pos_t = torch.tensor(pos, device=dev)[:, None]
        kv_len = kv_len_for(max(lengths) + 1, self._cache_len)  # attention reads only up to the longest row's bucket
        mask = (torch.arange(kv_len, device=dev)[None] <= pos_t)[:, None, None, :]  # (B, 1, 1, kv_len)
        if self.compiled:
            torch._dynamo.mark_dynamic(mask, 3)  # one graph for every context length
        logits = self._run(self._step, torch.tensor(tok, device=dev)[:, None], pos_t, mask)
        return logits if rows == list(range(self.batch)) else logits[torch.tensor(rows, device=dev)]


# ---- one conversation ----------------------------------------------------------------------------------

@dataclass
class Job:
    """One source record being answered, and what the target wrote."""
    shard: int
    slot: int                       # position within its shard
    conv: Conversation
    temperature: float
    seed: int
    turns: list[list[dict]]
    history: list[dict] = field(default_factory=list)
    turn: int = 0
    finishes: list[str] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)   # per answered turn (kept tokens, EOS excluded)
    truncated: bool = False         # questions left unanswered because --max-len was reached
    skipped: str | None = None      # why nothing was written
    gen: torch.Generator | None = None
    written_prompts: list[int] = field(default_factory=list)  # tokens of each question the target wrote itself
    openings: list[str] = field(default_factory=list)  # the first words forced on those questions (--openings)

    @property
    def new_tokens(self) -> int:
        return sum(map(len, self.token_ids))

    def record(self) -> dict:
        rec = {"key": self.conv.key, "messages": self.history, "temperature": self.temperature,
               "source_index": self.conv.index, "new_tokens": self.new_tokens, "prompt_tokens": self.prompt_tokens,
               "finish": self.finishes, "truncated": self.truncated}
        if self.written_prompts:
            rec["written_prompt_tokens"] = self.written_prompts
        if self.openings:
            rec["openings"] = self.openings
        return rec


@dataclass
class _Row:
    job: Job
    cached: list[int]               # the ids whose keys/values the row holds, in order
    stopper: Stopper
    params: SamplingParams
    gen: torch.Generator
    pending: int                    # sampled, not yet fed
    writes_question: bool = False   # the row writes the turn's user message (--data self), not an answer


class Regenerator:
    """Answers Jobs with continuous batching over a BatchDecoder; yields each Job when it is finished."""

    def __init__(self, model: Transformer, tokenizer, batch: int, max_len: int, max_new_tokens: int,
                 compile_mode: str | None = None, prompt_temperature: float = 1.0, prompt_tokens: int = 128):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the target's tokenizer has no chat template: conversations cannot be rendered")
        self.model, self.tokenizer = model, tokenizer
        self.decoder = BatchDecoder(model, batch, max_len, compile_mode)
        self.max_len, self.max_new_tokens = max_len, max_new_tokens
        self.prompt_temperature, self.prompt_tokens = prompt_temperature, prompt_tokens
        self.eos = eos_ids(model, tokenizer)
        from .engine import _longest_token_chars
        self._max_chars = max_len * _longest_token_chars(tokenizer)
        self.new_tokens = 0             # kept tokens written, over the Regenerator's life
        self.steps = 0                  # batched decoding forwards
        self.row_steps = 0              # rows summed over those forwards
        self.prefills = 0
        self.sampled = 0                # tokens sampled, EOS included, finished turns or not (for live rates)
        self.progress: Callable[[], None] | None = None  # called every few steps: a live progress display

    def encode(self, history: list[dict]) -> tuple[list[int] | None, str]:
        """The ids Engine.encode(messages=history) gives, or None and why they cannot be used."""
        try:
            text = self.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        except Exception:  # jinja's TemplateError (e.g. roles must alternate) and the like
            return None, "rejected by the chat template"
        if len(text) > self._max_chars:  # too long for any tokenization to fit: do not tokenize it all
            return None, "prompt longer than max-len"
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return (ids, "") if len(ids) < self.max_len else (None, "prompt longer than max-len")

    def encode_question(self, history: list[dict], opening: str = "") -> list[int] | None:
        """The ids of `history` rendered by the chat template up to where a user message's text starts (the
        template's own system message included), then the question's forced first words: what the target
        continues to write a question. None if the template cannot be cut there."""
        mark = "\x00question\x00"
        try:
            text = self.tokenizer.apply_chat_template(history + [{"role": "user", "content": mark}], tokenize=False)
        except Exception:
            return None
        if text.count(mark) != 1:
            return None
        ids = self.tokenizer(text[:text.index(mark)] + opening, add_special_tokens=False).input_ids
        return ids if len(ids) < self.max_len else None

    def _begin_question(self, r: int, job: Job, cached: list[int]) -> _Row | None:
        """Prefill the start of a user turn into row r: the row then writes the question (_take fills the turn)."""
        opening = job.turns[job.turn][-1].get("opening", "")
        ids = self.encode_question(job.history + job.turns[job.turn][:-1], opening)
        if ids is None:
            job.skipped = "no place for a question in the chat template"
            return None
        logits = self.decoder.prefill(r, ids, common_prefix(cached, ids))
        self.prefills += 1
        row = _Row(job, list(ids), Stopper(None, self.eos, False, [], min(self.prompt_tokens, self.max_len - len(ids))),
                   SamplingParams(self.prompt_temperature), self._generator(job), 0, writes_question=True)
        return None if self._take(row, next_token(logits, row.params, row.gen)) else row

    def _begin(self, r: int, job: Job, cached: list[int]) -> _Row | None:
        """Prefill the job's next turn into row r and take its first token, going on through turns that
        end at once; the row to decode, or None when the job is finished."""
        if not job.turns:
            job.skipped = "no user turn"
        while job.skipped is None and job.turn < len(job.turns):
            if job.turns[job.turn][-1].get("content", "") is None:  # SELF_WRITTEN: the target writes it
                row = self._begin_question(r, job, cached)
                if row is not None or job.skipped is not None:
                    return row
                continue  # the question ended at once (filled or skipped): answer it
            history = job.history + job.turns[job.turn]
            ids, why = self.encode(history)
            if ids is None:
                if job.turn == 0:
                    job.skipped = why
                else:  # the conversation reached --max-len: it ends with the last answer
                    job.truncated = True
                return None
            logits = self.decoder.prefill(r, ids, common_prefix(cached, ids))
            self.prefills += 1
            cached = list(ids)
            job.history = history
            job.prompt_tokens.append(len(ids))
            row = _Row(job, cached, Stopper(None, self.eos, False, [], min(self.max_new_tokens, self.max_len - len(ids))),
                       SamplingParams(job.temperature), self._generator(job), 0)
            if not self._take(row, next_token(logits, row.params, row.gen)):
                return row
        return None

    def _generator(self, job: Job) -> torch.Generator:
        # one generator per conversation, seeded from it: sampled answers do not depend on the batch
        if job.gen is None:
            job.gen = torch.Generator(device=self.decoder.device)
            job.gen.manual_seed(job.seed)
        return job.gen

    def _take(self, row: _Row, tok: int) -> bool:
        """Feed one sampled token to the turn's stop rule; True when the turn is over (answer recorded)."""
        self.sampled += 1
        outcome = row.stopper.feed([tok])
        if not outcome.done:
            row.pending = tok
            return False
        job, out = row.job, row.stopper.out
        text = self.tokenizer.decode(out, skip_special_tokens=True)  # as Engine's result text
        if row.writes_question:  # the turn's question is written: the row's next _begin answers it
            if not text.strip():
                job.skipped = "the target wrote an empty question"
            opening = job.turns[job.turn][-1].get("opening", "")
            if opening:
                job.openings.append(opening)
            job.turns[job.turn] = job.turns[job.turn][:-1] + [{"role": "user", "content": opening + text}]
            job.written_prompts.append(len(out))
            return True
        job.history = job.history + [{"role": "assistant", "content": text}]
        job.finishes.append(row.stopper.finish)
        job.token_ids.append(list(out))
        job.turn += 1
        self.new_tokens += len(out)
        return True

    def run(self, jobs: Iterable[Job]) -> Iterator[Job]:
        """Answer every job; finished jobs (skipped ones too) come out in the order they finish."""
        pending = iter(jobs)
        rows: list[_Row | None] = [None] * self.decoder.batch
        exhausted = False
        with torch.inference_mode():
            while True:
                for r in range(len(rows)):  # refill free rows, so that every step decodes a full batch
                    while rows[r] is None and not exhausted:
                        job = next(pending, None)
                        if job is None:
                            exhausted = True
                            break
                        rows[r] = self._begin(r, job, [])
                        if rows[r] is None:
                            yield job
                active = [r for r, row in enumerate(rows) if row is not None]
                if not active:
                    return
                logits = self.decoder.step(active, [rows[r].pending for r in active],
                                           [len(rows[r].cached) for r in active])
                self.steps += 1
                self.row_steps += len(active)
                if self.progress is not None and self.steps % 16 == 0:
                    self.progress()
                amax = logits.argmax(-1).tolist()  # one read for every greedy row
                for i, r in enumerate(active):
                    row = rows[r]
                    row.cached.append(row.pending)
                    tok = amax[i] if row.params.greedy else next_token(logits[i], row.params, row.gen)
                    if not self._take(row, tok):
                        continue
                    # a written question's tokens are in the cache, EOS aside: its answer's prefill reuses them
                    rows[r] = self._begin(r, row.job, row.cached)
                    if rows[r] is None:
                        yield row.job


# ---- the Python entry point -------------------------------------------------------------------------------

def make_jobs(convs: list[Conversation], mix: list[list[float]], seed: int, shard: int = 0) -> list[Job]:
    return [Job(shard, j, c, conversation_temperature(mix, seed, c.key), conversation_seed(seed, c.key, c.index),
                plan_turns(c.messages)) for j, c in enumerate(convs)]


def regenerate_conversations(model: Transformer, tokenizer, convs: list[Conversation], *, temperature: float = 0.0,
                             mix: str | None = None, seed: int = 0, batch_size: int = DEFAULT_BATCH,
                             max_len: int = 1024, max_new_tokens: int = 512,
                             compile_mode: str | None = None, prompt_temperature: float = 1.0,
                             prompt_tokens: int = 128) -> list[Job]:
    """Answer `convs` in memory (no files); the Jobs in input order, skipped ones included. A conversation of
    self_conversations() gets its question written by the target first (at prompt_temperature)."""
    regen = Regenerator(model, tokenizer, batch_size, max_len, max_new_tokens, compile_mode, prompt_temperature,
                        prompt_tokens)
    jobs = make_jobs(convs, parse_mix(None if mix else temperature, mix), seed)
    list(regen.run(jobs))
    return jobs


# ---- the command ------------------------------------------------------------------------------------------

def add_cli(sub) -> None:
    from .features import add_model_args
    p = sub.add_parser("regenerate", help="let the target write the answers of training conversations (batched, resumable)")
    add_model_args(p)
    g = p.add_argument_group("data")
    g.add_argument("--data", default="sharegpt",
                   help="sharegpt | PATH.json | PATH.jsonl[.gz] | hf:NAME | a regenerate folder | self (the target "
                        "writes the questions too; needs --max-conversations)")
    g.add_argument("--out", required=True, help="output folder (rerun the same command to resume)")
    g.add_argument("--max-conversations", type=int, default=None,
                   help="answer the first N conversations; the records of one split ShareGPT chat count once (default: all)")
    g.add_argument("--shard-size", type=int, default=50, help="source records per shard")
    s = p.add_argument_group("generation")
    s.add_argument("--temperature", type=float, default=None, help="one temperature for all, 0 = greedy (default: 0)")
    s.add_argument("--mix", default=None,
                   help="temperatures by share, e.g. '0:0.5,0.7:0.5': each conversation's is drawn from its key "
                        "(default: --temperature for every conversation)")
    s.add_argument("--max-new-tokens", type=int, default=512, help="tokens per answer, at most")
    s.add_argument("--prompt-temperature", type=float, default=1.0,
                   help="--data self: the temperature the target writes its questions at (default 1)")
    s.add_argument("--prompt-tokens", type=int, default=128, help="--data self: tokens per written question, at most")
    s.add_argument("--openings", default=None,
                   help="--data self: force each question's first words, drawn by weight from a list, so that the target "
                        "asks for tasks rather than generic advice: a preset (" + ", ".join(OPENING_PRESETS) + "), a file "
                        "(one opening a line, optionally 'WEIGHT<TAB>text') or 'Write a:2,Solve,Extract' (default: none)")
    s.add_argument("--max-len", type=int, default=1024,
                   help="tokens per conversation: no answer runs past it, no question is asked after it")
    s.add_argument("--seed", type=int, default=0, help="for the temperature draws and sampling")
    s.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                   help="conversations decoded at once (1 = single-stream, for comparison)")
    s.add_argument("--compile", action="store_true",
                   help="torch.compile the batched decoding step (one graph). Off by default: on the 2-core CPU "
                        "it measured 2.9x slower than eager at 32 rows (1028 vs 359 ms a step, quiet)")
    p.set_defaults(func=run_regenerate)


def plan_signature(convs: list[Conversation]) -> str:
    """Which source records a shard holds: a resumed run keeps a finished shard only if it plans the same."""
    return hashlib.blake2b(json.dumps([[c.index, c.key] for c in convs]).encode(), digest_size=8).hexdigest()


def read_shard(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


def read_manifest(out: Path) -> dict | None:
    path = out / "manifest.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ValueError(f"{path} is not valid JSON: delete {out} or use another --out") from None


def check_resumable(out: Path, old: dict | None, manifest: dict, n_shards: int) -> None:
    """Refuse, in one line, a folder that holds another run (or more of this one than is planned)."""
    existing = sorted(p.name for p in out.glob("shard-*.jsonl.gz"))
    if old is None:
        if existing:
            raise ValueError(f"{out} holds shards but no manifest.json: use an empty --out folder")
        return
    diff = [k for k in RESUME_KEYS if old.get(k) != manifest.get(k)]
    if old.get("format") != FORMAT or diff:
        raise ValueError(f"{out} holds a regeneration with other settings (differs in: {', '.join(diff) or 'format'}): "
                         "use another --out or repeat the original command")
    was, now = old.get("max_conversations"), manifest.get("max_conversations")
    if now is not None and (was is None or now < was):  # growing keeps every shard; shrinking would drop some
        raise ValueError(f"{out} holds a run of {'all' if was is None else f'{was:,}'} conversations: a smaller "
                         "--max-conversations would drop finished shards; repeat the original command or use another --out")
    beyond = [name for name in existing if name >= regenerated_shard(n_shards)]
    if beyond:
        raise ValueError(f"{out} holds {len(existing)} shards but this run plans {n_shards} (a smaller "
                         "--max-conversations?): repeat the original command or use another --out")


def plan_entries(out: Path, old: dict | None, plan: list[list[Conversation]]) -> list[dict]:
    """One manifest entry per planned shard; a finished one is kept if its file is there and it planned
    the same records (a larger --max-conversations changes only the last shard of the old plan)."""
    done = {s["file"]: s for s in (old or {}).get("shards", []) if s.get("done") and (out / s["file"]).is_file()}
    entries = []
    for i, shard in enumerate(plan):
        name, sig = regenerated_shard(i), plan_signature(shard)
        prev = done.get(name)
        entries.append(prev if prev is not None and prev.get("plan") == sig else
                       {"file": name, "plan": sig, "records": len(shard), "done": False})
    return entries


def totals(entries: list[dict]) -> dict:
    skipped: dict[str, int] = {}
    for e in entries:
        for why, n in e.get("skipped", {}).items():
            skipped[why] = skipped.get(why, 0) + n
    return {"records_written": sum(e["written"] for e in entries),
            "conversations_written": sum(e.get("keys", 0) for e in entries),
            "new_tokens": sum(e["new_tokens"] for e in entries), "skipped": skipped}


def finish_shard(out: Path, entry: dict, jobs: list[Job], save: Callable[[], None]) -> None:
    """Write a shard whose records are all done: a temporary file, then the manifest that names it,
    then the rename. A kill between any two leaves either no shard (redone) or a shard the manifest knows."""
    records = [j.record() for j in jobs if j.skipped is None]
    skipped: dict[str, int] = {}
    for j in jobs:
        if j.skipped is not None:
            skipped[j.skipped] = skipped.get(j.skipped, 0) + 1
    path = out / entry["file"]
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    entry.update(done=True, written=len(records), keys=len({r["key"] for r in records}),
                 new_tokens=sum(r["new_tokens"] for r in records), skipped=skipped,
                 truncated=sum(r["truncated"] for r in records))
    save()
    tmp.replace(path)


def check_args(args) -> tuple[list[list[float]], list[list] | None]:
    """The temperature mix and the openings (None without --openings), once every setting is checked."""
    from .features import check_positive
    check_positive(max_conversations=args.max_conversations, shard_size=args.shard_size,
                   max_new_tokens=args.max_new_tokens, max_len=args.max_len, batch_size=args.batch_size)
    if args.max_len < 2:
        raise ValueError(f"--max-len must be >= 2, got {args.max_len}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.data == SELF:
        if args.max_conversations is None:
            raise ValueError("--data self writes its own questions: give --max-conversations N")
        check_positive(prompt_tokens=args.prompt_tokens)
        if not args.prompt_temperature > 0:
            raise ValueError(f"--prompt-temperature must be > 0 (greedy would write one question), got {args.prompt_temperature}")
    elif args.openings is not None:
        raise ValueError("--openings starts the questions the target writes: it needs --data self")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    return parse_mix(args.temperature, args.mix), parse_openings(args.openings)


def new_manifest(args, mix, openings, convs: list[Conversation], report, target, folder) -> dict:
    """What this run is: every setting that decides a shard's contents, and what the source holds."""
    from .features import model_fingerprint, model_spec
    return {
        "format": FORMAT, "version": 1, "eaglespec_version": package_version(),
        "model": model_spec(args.model), "model_folder": str(folder), "model_fingerprint": model_fingerprint(target),
        "dtype": str(target.embed_tokens.weight.dtype).removeprefix("torch."),
        "data": args.data, "max_conversations": args.max_conversations, "temperatures": mix,
        "max_new_tokens": args.max_new_tokens, "max_len": args.max_len, "seed": args.seed,
        "shard_size": args.shard_size, "data_summary": report.summary(len(convs), len({c.key for c in convs})),
        # only where the target writes the questions (runs before --data self have neither)
        "prompt_temperature": args.prompt_temperature if args.data == SELF else None,
        "prompt_tokens": args.prompt_tokens if args.data == SELF else None,
        "openings": openings,  # None without --openings (and in runs from before it)
        "conversations_planned": len({c.key for c in convs}), "records_planned": len(convs),
    }


def session_record(regen: Regenerator, args, elapsed: float, mode) -> dict:
    """One line of the manifest's history: how long this process ran (wall time, pauses included) and how
    fast it wrote."""
    return {
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - elapsed)),
        "seconds": round(elapsed, 1), "new_tokens": regen.new_tokens,
        "tokens_per_s": round(regen.new_tokens / max(elapsed, 1e-9), 2),
        "batch_size": args.batch_size, "rows_per_step": round(regen.row_steps / max(regen.steps, 1), 2),
        "steps": regen.steps, "device": str(regen.decoder.device), "threads": torch.get_num_threads(),
        "compiled": mode or False, "packed_gemm": regen.decoder.packed_gemm,
        "linears": linear_kinds(regen.decoder.model) if regen.decoder.packed_gemm else ["torch"]}


def answer_shards(regen: Regenerator, out: Path, entries: list[dict], plan: list[list[Conversation]], mix, seed: int,
                  total: int, save: Callable[[], None], on_shard: Callable[[int], None] | None) -> None:
    """Answer every unfinished shard in one continuous batch, writing each shard as its last record ends."""
    from tqdm import tqdm
    todo = [i for i, e in enumerate(entries) if not e["done"]]
    results = {i: make_jobs(plan[i], mix, seed, shard=i) for i in todo}
    left = {i: len(plan[i]) for i in todo}
    start = time.perf_counter()
    bar = tqdm(total=total, initial=sum(e["records"] for e in entries if e["done"]), unit="conv",
               desc="regenerate", smoothing=0.05, mininterval=2.0)

    def show():  # between finished conversations too: the first ones take hundreds of steps
        bar.set_postfix_str(f"{regen.sampled / max(time.perf_counter() - start, 1e-9):.1f} tok/s, "
                            f"{regen.row_steps / max(regen.steps, 1):.1f} rows/step", refresh=False)
        bar.update(0)
    regen.progress = show
    for job in regen.run(j for i in todo for j in results[i]):
        left[job.shard] -= 1
        bar.update(1)
        if left[job.shard] == 0:
            finish_shard(out, entries[job.shard], results.pop(job.shard), save)
            if on_shard is not None:
                on_shard(job.shard)
    bar.close()


def run_regenerate(args, on_shard: Callable[[int], None] | None = None) -> int:
    """on_shard(i) is called after shard i is on disk (tests use it to simulate a kill)."""
    from .features import load_model
    mix, openings = check_args(args)
    out = Path(args.out).expanduser()
    if args.data == SELF:
        convs = self_conversations(args.max_conversations, openings, args.seed)
        report = LoadReport(source="the target's own questions" + (" with forced openings" if args.openings else ""))
        report.records = len(convs)
    else:
        convs, report = load_conversations(args.data, args.max_conversations, need_assistant=False)
    target, tokenizer, folder = load_model(args)
    if args.max_len > target.args.max_position_embeddings:
        raise ValueError(f"--max-len {args.max_len} is longer than the model's context "
                         f"({target.args.max_position_embeddings} tokens)")
    from .cli import resolve_compile
    from .compiled import default_mode
    # opt-in here (eager measured faster at 32 rows); resolve_compile gives the no-compiler notice
    mode = default_mode(target.embed_tokens.weight.device) if args.compile and resolve_compile(args) else None
    regen = Regenerator(target, tokenizer, args.batch_size, args.max_len, args.max_new_tokens, mode,
                        args.prompt_temperature, args.prompt_tokens)
    plan = [convs[i:i + args.shard_size] for i in range(0, len(convs), args.shard_size)]
    manifest = new_manifest(args, mix, openings, convs, report, target, folder)
    old = read_manifest(out)
    if old is not None or out.is_dir():
        check_resumable(out, old, manifest, len(plan))
    out.mkdir(parents=True, exist_ok=True)
    entries = plan_entries(out, old, plan)
    manifest["shards"] = entries
    # this process's line is rewritten with every shard, so that a run that is killed (the usual end of
    # a long background run) still records how long it ran and how fast it wrote
    session: dict = {}
    manifest["sessions"] = (old or {}).get("sessions", []) + [session]
    start = time.perf_counter()

    def save(complete: bool = False):
        session.update(session_record(regen, args, time.perf_counter() - start, mode))
        manifest.update(totals([e for e in entries if e["done"]]), complete=complete)
        write_json(out / "manifest.json", manifest)

    save(all(e["done"] for e in entries))
    print(manifest["data_summary"])
    n_done = sum(e["done"] for e in entries)
    if n_done:
        print(f"resuming: {n_done} of {len(entries)} shards already in {out}")
    answer_shards(regen, out, entries, plan, mix, args.seed, len(convs), save, on_shard)
    save(all(e["done"] for e in entries))
    report.skipped.update(manifest["skipped"])
    print(report.summary(manifest["records_written"], manifest["conversations_written"])
          .replace("data:", "regenerated:", 1).replace(" from ", f" in {out} from ", 1))
    print(f"regenerate: this session {regen.new_tokens:,} new tokens in {session['seconds']:,.0f} s = "
          f"{session['tokens_per_s']:,.1f} tok/s aggregate (batch {args.batch_size}, {session['rows_per_step']:.1f} rows "
          f"a step, {regen.prefills:,} prefills); {sum(e['done'] for e in entries)} of {len(entries)} shards done")
    return 0


def package_version() -> str:
    try:
        from importlib.metadata import version
        return version("eaglespec")
    except Exception:
        return "unknown"
