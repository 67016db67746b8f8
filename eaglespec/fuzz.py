"""`eaglespec fuzz`: differential fuzzing of EAGLE against plain decoding.

Lossless means more than equal text on a benchmark: every field of EAGLE's result must be plain
greedy decoding's — `token_ids`, `text`, `finish_reason`, `new_tokens`, `prompt_tokens` — and so
must the streamed chunks put together, and the server's answers and `usage`. Each random case picks:
a chat or raw prompt; `max_new_tokens` in 1..64; stop strings (none, cut from plain decoding's own
output so they really hit, several overlapping ones, ones that span an EAGLE round boundary, ones
that never match); `ignore_eos`; sometimes an extra EOS token taken from plain decoding's own output
(also just past the budget), since a tiny random model never emits its real one; a tree (dynamic with
random top-k/depth/size, fixed or chosen each round by the cost
model, EAGLE-1 static, chain); the head's full or reduced draft vocabulary; eager
or compiled (sparsely: compiling costs seconds per shape); and, now and then, the HTTP API
(chat or completions, streamed and not).

A case whose tokens differ only where the target itself is tied (top-2 logits within 1e-4 by a plain
full forward) is counted as a tie, not a divergence: tree verification and one-token steps round
differently, and either token is then plain decoding's. Every divergence prints one line that
reproduces it: `eaglespec fuzz ... --case '<json>'`.
"""
from __future__ import annotations

import collections
import contextlib
import json
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

FIELDS = ("token_ids", "text", "finish_reason", "new_tokens", "prompt_tokens")
TIE_GAP = 1e-4
NEVER = "\x00never\x00"  # a stop string that cannot match
MAX_STOPS = 4            # the server's limit (OpenAI's)
# compiled engines are few and fixed: each costs a compile (seconds on a tiny model, minutes on a real one)
COMPILED_TREES = ({"kind": "dynamic", "top_k": 4, "depth": 5, "total_tokens": 8},
                  {"kind": "chain", "top_k": 1, "depth": 4, "total_tokens": 16})
AUTO_SHARE = 0.3         # dynamic trees whose size and depth the cost model picks each round


def fuzz_cost_table():
    """A fixed, CPU-like cost table for auto trees (verifying more tokens costs more), so that the
    policy picks different sizes and depths as the drafts' scores vary, and no case waits for a
    calibration measurement (which would also make a case's tree depend on the machine's load)."""
    from .costmodel import CostTable
    return CostTable({1: 10.0, 4: 11.0, 8: 13.0, 12: 16.0, 16: 20.0}, draft_first_ms=1.5, draft_step_ms=1.0)


RAW_PROMPTS = [
    "Once upon a time", "The quick brown fox", "Question: what is", "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5,", "Q: What is 12 times 7?\nA:", "The sky is blue because", "import numpy as np\n",
    "<html>\n  <body>\n", "SELECT name FROM users WHERE", "Les élèves ont répondu: « où ça ? »",
    "Emoji: 🦅 🚀 ✨", "In 1905, Albert Einstein", "Dear Sir or Madam,\n\n", "- item one\n- item two\n-",
    "x = [i * i for i in range(10)]\nprint(", "Speculative decoding drafts tokens", "N2 N2 N2",
]
CHAT_PROMPTS = [
    "Why is the sky blue?", "Write a haiku about speculative decoding.", "What is 12 times 7?",
    "List three prime numbers.", "Explain recursion in one sentence.", "Count from 1 to 30.",
    "Write a Python function that adds two numbers.", "Résume en français : le chat dort sur le tapis.",
    "Tell me a joke about a snake 🐍.", "Repeat after me: timas timas ma ma", "Hi!",
    "Give me a JSON object with keys a and b.", "What is the capital of France? Answer in one word.",
    "Write a limerick about a GPU.", "Translate 'good morning' into German, Spanish and Italian.",
]
SYSTEMS = [None, "You are a helpful assistant.", "Answer briefly."]


@dataclass
class Case:
    """One fuzz case, complete: replaying its JSON reruns exactly it."""
    prompt: str | None = None
    messages: list[dict] | None = None
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    extra_eos: int | None = None        # a token made an EOS for this case (plain decoding's own output)
    tree: dict = field(default_factory=lambda: {"kind": "dynamic"})
    vocab: str = "head"                 # "head": the head's own draft vocabulary; "other": full <-> reduced
    compiled: bool = False
    server: str | None = None           # None, "chat" or "completions": also through the HTTP API

    def prompt_kwargs(self) -> dict:
        return {"messages": self.messages} if self.messages is not None else {"prompt": self.prompt}

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Case":
        try:
            data = json.loads(text)
            return cls(**data)
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"--case must be a case's JSON as printed by a divergence: {e}") from None


@dataclass
class Outcome:
    status: str                          # "ok" | "tie" | "diverged"
    problems: list[str]
    tau: float = 1.0
    note: str = ""


# ---- engines ---------------------------------------------------------------------------------------

def head_variant(head, draft_ids):
    """A head over the same weights drafting from `draft_ids` (None: the whole vocabulary). An EAGLE-3
    head drafts with its own LM head, whose rows are its draft vocabulary: `draft_ids` must be a subset
    of it, and the variant keeps those rows."""
    import torch

    from .head import Eagle3Head, EagleHead
    w = head.fc.weight
    state = {k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    if isinstance(head, Eagle3Head):
        own = head.draft_ids if head.draft_ids is not None else torch.arange(head.args.vocab_size, device=w.device)
        rows = (own[:, None] == draft_ids.to(own.device)[None]).any(-1)
        variant = Eagle3Head(head.args, head.aux_layers, draft_vocab=own[rows].cpu(),
                             norm_before_residual=head.midlayer.norm_before_residual)
        state["lm_head.weight"] = state["lm_head.weight"][rows]
    else:
        variant = EagleHead(head.args, bias=head.bias, draft_vocab=draft_ids)
    variant.load_state_dict(state, strict=False)
    return variant.to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)


def other_vocab(head, seed: int = 0):
    """The head with the other kind of draft vocabulary: full if it has a reduced one, else a reduced
    one (a fixed random half of the tokens, so drafts often fall outside it). An EAGLE-3 head cannot
    draft outside its own LM head's rows, so its other vocabulary is always a random half of those."""
    import torch

    from .head import Eagle3Head
    if head.draft_ids is not None and not isinstance(head, Eagle3Head):
        return head_variant(head, None)
    own = torch.arange(head.args.vocab_size) if head.draft_ids is None else head.draft_ids.cpu()
    g = torch.Generator().manual_seed(seed)
    ids = own[torch.randperm(own.numel(), generator=g)[: max(8, own.numel() // 2)]].sort().values
    return head_variant(head, ids)


EAGER_ENGINES_KEPT = 8  # eager EAGLE engines kept built; trees are random, so most serve one case
OWN_TOKENS = 68         # plain decoding's own continuation: the longest budget (64) and a little past it


class Engines:
    """The reference (plain decoding, eager) and the EAGLE engines each case needs, built on first use.

    The reference has a model shell of its own over the shared weights, and so has each compiled
    engine: a compiled graph must never see its cache replaced or written by another engine. The
    eager EAGLE engines of one draft vocabulary share one model shell and one head shell, so one KV
    cache, and only the last few are kept: each of hundreds of random trees holding a cache of the
    whole context (400 MB on SmolLM2-135M) ran a 1,000-case run out of memory. Sharing is safe because
    cases run one at a time and a generation reads only cache slots it has written itself, exactly as
    consecutive generations on one engine do."""

    def __init__(self, model, tokenizer, head, compile_mode: str | bool = "default"):
        from .engine import Engine
        from .model import share_weights
        self.model, self.tokenizer, self.compile_mode = model, tokenizer, compile_mode
        self.heads = {"head": head}
        self._other_head = lambda: other_vocab(head)
        self.plain = Engine(share_weights(model), tokenizer, compile=False)  # the reference: plain and eager
        self.base_eos = set(self.plain.eos_ids)
        self._eagle: collections.OrderedDict = collections.OrderedDict()  # least recently used first
        self._apps: dict = {}       # engine key -> open TestClient
        self._shells: dict = {}     # draft vocabulary -> (model shell, head shell) of the eager engines
        self._own: dict = {}

    def head(self, vocab: str):
        if vocab not in self.heads:
            self.heads[vocab] = self._other_head()
        return self.heads[vocab]

    @staticmethod
    def _key(case: Case) -> tuple:
        return json.dumps(case.tree, sort_keys=True), case.vocab, case.compiled

    def eagle(self, case: Case):
        from .engine import Engine
        from .model import share_weights
        from .tree import TreeConfig
        key = self._key(case)
        if key in self._eagle:
            self._eagle.move_to_end(key)
            return self._eagle[key]
        if case.compiled:
            _room_for_compiled_engines()
            model, head = share_weights(self.model), share_weights(self.head(case.vocab))
        else:
            if case.vocab not in self._shells:
                self._shells[case.vocab] = (share_weights(self.model), share_weights(self.head(case.vocab)))
            model, head = self._shells[case.vocab]
        self._eagle[key] = Engine(model, self.tokenizer, head, TreeConfig(**case.tree),
                                  compile=self.compile_mode if case.compiled else False, cost_table=fuzz_cost_table())
        eager = [k for k in self._eagle if not k[2]]
        for old in eager[:max(0, len(eager) - EAGER_ENGINES_KEPT)]:
            del self._eagle[old]
            if old in self._apps:
                self._apps.pop(old).__exit__(None, None, None)
        return self._eagle[key]

    def client(self, case: Case):
        """An in-process HTTP client of a server over this case's EAGLE engine (closed with it)."""
        engine, key = self.eagle(case), self._key(case)
        if key not in self._apps:
            from fastapi.testclient import TestClient

            from .serve import create_app
            client = TestClient(create_app(engine, "fuzz", method="eagle"))
            client.__enter__()
            self._apps[key] = client
        return self._apps[key]

    def own(self, case: Case) -> tuple[list[int], str]:
        """Plain decoding's own continuation of the case's prompt, up to its budget and 4 tokens past
        it, without stop strings: what the case's stop strings and extra EOS are cut from. Generated
        once per prompt (a case's own is a prefix of the longest: greedy decoding's first n tokens do
        not depend on how many follow); it only chooses the case, it is never what a case is checked
        against."""
        key = (json.dumps(case.prompt_kwargs(), sort_keys=True), case.ignore_eos)
        if key not in self._own:
            self._own[key] = self.plain.generate(**case.prompt_kwargs(), method="vanilla", max_new_tokens=OWN_TOKENS,
                                                 ignore_eos=case.ignore_eos).token_ids
        ids = self._own[key][:case.max_new_tokens + 4]
        return ids, self.tokenizer.decode(ids, skip_special_tokens=True)

    @contextlib.contextmanager
    def prepared(self, case: Case):
        """The case's EOS set on the reference and the case's EAGLE engine (and back afterwards), and
        a fresh tree policy: an auto tree's policy learns from every round it sees, so without the
        reset a case's trees would depend on the cases before it and its JSON would not replay it."""
        eos = self.base_eos | ({case.extra_eos} if case.extra_eos is not None else set())
        engines = [self.plain, self.eagle(case)]
        engines[1].reset_learning()
        for e in engines:
            e.eos_ids = eos
        try:
            yield
        finally:
            for e in engines:
                e.eos_ids = set(self.base_eos)

    def close(self):
        for client in self._apps.values():
            client.__exit__(None, None, None)
        self._apps.clear()


def _room_for_compiled_engines(limit: int = 64) -> None:
    """Every compiled engine's target and head steps are compiled versions of one code object
    (CompiledForward._run); Dynamo's default of 8 versions per code object is spent by about two
    engines, after which it refuses to compile. The fuzzer builds several in one process."""
    import torch._dynamo
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)


# ---- making cases -----------------------------------------------------------------------------------

def random_prompt(rng: random.Random, chat: bool) -> dict:
    if not chat:
        text = rng.choice(RAW_PROMPTS)
        if rng.random() < 0.4:
            text += f" {rng.randint(0, 9999)}"
        return {"prompt": text}
    messages = []
    system = rng.choice(SYSTEMS)
    if system:
        messages.append({"role": "system", "content": system})
    if rng.random() < 0.25:  # a second turn, answering an earlier one
        messages += [{"role": "user", "content": rng.choice(CHAT_PROMPTS)},
                     {"role": "assistant", "content": rng.choice(RAW_PROMPTS)}]
    messages.append({"role": "user", "content": rng.choice(CHAT_PROMPTS)})
    return {"messages": messages}


def random_tree(rng: random.Random, candidates: int) -> dict:
    """A tree whose per-node top-k fits a draft vocabulary of `candidates` tokens."""
    kind = rng.choice(("dynamic", "dynamic", "static", "chain"))
    if kind == "static" and candidates < 4:
        kind = "chain"
    if kind == "dynamic":
        tree = {"kind": kind, "top_k": rng.randint(1, min(5, candidates)), "depth": rng.randint(1, 6),
                "total_tokens": rng.randint(1, 20), "ngram": rng.choice((0, 1, 2, 4, 8))}
        if rng.random() < AUTO_SHARE:
            tree["auto"] = True
        return tree
    return {"kind": kind, "top_k": 1, "depth": rng.randint(1, 6), "total_tokens": 16}


def piece(rng: random.Random, text: str, start: int | None = None, length: int | None = None) -> str | None:
    """A substring of `text` (a stop string that really occurs), preferring printable ones."""
    if not text:
        return None
    for _ in range(8):
        n = length or rng.randint(1, 6)
        at = rng.randrange(len(text)) if start is None else max(0, min(start, len(text) - 1))
        s = text[at:at + n]
        if s and (s.isprintable() or rng.random() < 0.2):
            return s
        start = None
    return text[:1] or None


def overlapping(rng: random.Random, text: str) -> list[str]:
    """Two or three stop strings that overlap in the text, in a random order. Plain decoding stops at
    the match that *completes* first, so the telling case is one string inside another: it starts
    later but ends sooner."""
    a = piece(rng, text, length=rng.randint(3, 8))
    if a is None:
        return []
    out = [a]
    for _ in range(rng.randint(1, 2)):
        if len(a) > 2 and rng.random() < 0.6:  # strictly inside a
            off = rng.randint(1, len(a) - 2)
            out.append(a[off: rng.randint(off + 1, len(a) - 1)])
        else:  # starting inside a, ending anywhere
            at = text.find(a) + rng.randint(0, len(a))
            out.append(text[at: at + rng.randint(1, 5)])
    out = [s for s in out if s]
    rng.shuffle(out)
    return out


def boundary_stop(rng: random.Random, tokenizer, rounds: list[list[int]], text: str) -> str | None:
    """A stop string that spans the boundary between two EAGLE rounds."""
    cuts, at = [], 0
    for r in rounds[:-1]:
        at += len(r)
        cuts.append(at)
    out = [t for r in rounds for t in r]
    rng.shuffle(cuts)
    for cut in cuts:
        c = len(tokenizer.decode(out[:cut], skip_special_tokens=True))
        if 0 < c < len(text) and text[:c] == tokenizer.decode(out[:cut], skip_special_tokens=True):
            s = text[max(0, c - rng.randint(1, 4)): c + rng.randint(1, 4)]
            if s:
                return s
    return None


def make_case(rng: random.Random, engines: Engines, compiled_share: float, server_share: float,
              compiled_trees=COMPILED_TREES) -> Case:
    case = Case(**random_prompt(rng, chat=rng.random() < 0.5 and _has_template(engines.tokenizer)))
    case.max_new_tokens = rng.randint(1, 64)
    case.ignore_eos = rng.random() < 0.3
    case.compiled = rng.random() < compiled_share
    # compiled engines stay few: a fixed tree over the head's own vocabulary (full for --tiny, reduced
    # for the shipped head), so a run compiles at most len(compiled_trees) engines
    case.vocab = "head" if case.compiled else rng.choice(("head", "other"))
    head = engines.head(case.vocab)
    candidates = head.args.vocab_size if head.draft_ids is None else head.draft_ids.numel()
    case.tree = dict(rng.choice(compiled_trees)) if case.compiled else random_tree(rng, candidates)
    if rng.random() < server_share:
        case.server = "chat" if case.messages is not None else "completions"
    # plain decoding's own output (a little past the budget) is where stop strings and EOS come from
    ids, text = engines.own(case)
    if not case.ignore_eos and ids and rng.random() < 0.4:
        past = case.max_new_tokens
        if past < len(ids) and ids[past] not in ids[:past] and rng.random() < 0.6:
            i = past  # the token just past the budget: that EOS must not turn "length" into "stop"
        else:
            i = rng.randrange(len(ids))
        case.extra_eos = ids[i]
    style = rng.choice(("none", "own", "own", "overlap", "boundary", "mixed"))
    stops: list[str] = []
    if style == "own":
        stops = [s for s in (piece(rng, text) for _ in range(rng.randint(1, 2))) if s]
    elif style == "overlap":
        stops = overlapping(rng, text)
    elif style == "boundary":
        with engines.prepared(case):
            chunks = list(engines.eagle(case).stream(**case.prompt_kwargs(), method="eagle",
                                                     max_new_tokens=case.max_new_tokens + 4,
                                                     ignore_eos=case.ignore_eos))
        s = boundary_stop(rng, engines.tokenizer, [c.token_ids for c in chunks], chunks[-1].result.text)
        stops = [s] if s else []
    elif style == "mixed":
        stops = overlapping(rng, text) + [NEVER]
    case.stop = list(dict.fromkeys(stops))[:MAX_STOPS]
    return case


def _has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


# ---- checking a case --------------------------------------------------------------------------------

def tie_at(model, prompt_ids: list[int], got: list[int], want: list[int]) -> str | None:
    """If `got` and `want` first differ where the target is tied (top-2 logits within TIE_GAP by a
    plain full forward, both tokens among the tied), describe it; else None."""
    import torch
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return None  # one is a prefix of the other: a stopping difference, never a tie
    seq = torch.tensor([prompt_ids + want[:i]], device=model.embed_tokens.weight.device)
    with torch.inference_mode():
        _, logits = model(seq, torch.arange(seq.shape[1], device=seq.device)[None])
    row = logits[0, -1].float()
    top = float(row.max())
    if top - float(row[got[i]]) < TIE_GAP and top - float(row[want[i]]) < TIE_GAP:
        return f"tie at new token {i}"
    return None


def compare(got: dict, want: dict, where: str) -> list[str]:
    return [f"{where}.{k}: {_short(got[k])} != plain {_short(want[k])}" for k in want if got.get(k) != want[k]]


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def tau_problems(r, stop_strings: bool) -> list[str]:
    """tau counts what each round produced up to where the generation stopped: the tokens kept and an
    EOS that ended it, never the rest of a cut round (the prefill's token costs no round)."""
    produced = sum(r.accept_lengths) + 1
    if r.finish_reason == "length":
        want = {r.new_tokens}
    elif not stop_strings:
        want = {r.new_tokens + 1}  # an EOS ended it
    else:
        want = {r.new_tokens, r.new_tokens + 1}  # a stop string or an EOS
    problems = [] if produced in want else [
        f"tau: rounds produced {produced} tokens for {r.new_tokens} new ({r.finish_reason}): {r.accept_lengths}"]
    tau = (produced - 1) / r.target_forwards if r.target_forwards else 1.0
    if len(r.accept_lengths) != r.target_forwards or abs(r.tau - tau) > 1e-9:
        problems.append(f"tau: {r.tau} is not {produced - 1} tokens over {r.target_forwards} forwards")
    return problems


def run_case(engines: Engines, case: Case) -> Outcome:
    kw = dict(case.prompt_kwargs(), max_new_tokens=case.max_new_tokens, stop=case.stop or None,
              ignore_eos=case.ignore_eos)
    with engines.prepared(case):
        want = engines.plain.generate(method="vanilla", **kw)
        chunks = list(engines.eagle(case).stream(method="eagle", **kw))
        got = chunks[-1].result
        want_fields = {f: getattr(want, f) for f in FIELDS}
        problems = compare({f: getattr(got, f) for f in FIELDS}, want_fields, "result")
        problems += compare({"text": "".join(c.text for c in chunks),
                             "token_ids": [t for c in chunks for t in c.token_ids]},
                            {"text": want.text, "token_ids": want.token_ids}, "stream")
        problems += tau_problems(got, bool(case.stop))
        if case.server:
            problems += check_server(engines.client(case), case, want)
    outcome = Outcome("ok" if not problems else "diverged", problems, got.tau)
    if problems and got.token_ids != want.token_ids:
        tie = tie_at(engines.model, engines.plain.encode(**case.prompt_kwargs()), got.token_ids, want.token_ids)
        if tie:
            outcome.status, outcome.note = "tie", tie
    return outcome


def check_server(client, case: Case, want) -> list[str]:
    """The same request through the HTTP API, whole and streamed: text, finish reason and usage."""
    body = {"model": "fuzz", "max_tokens": case.max_new_tokens, "temperature": 0, "ignore_eos": case.ignore_eos,
            "method": "eagle", **({"stop": case.stop} if case.stop else {})}
    chat = case.server == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body.update({"messages": case.messages} if chat else {"prompt": case.prompt})
    expected = {"text": want.text, "finish_reason": want.finish_reason, "prompt_tokens": want.prompt_tokens,
                "completion_tokens": want.new_tokens}
    r = client.post(path, json=body)
    if r.status_code != 200:
        return [f"server: HTTP {r.status_code}: {r.text[:200]}"]
    data = r.json()
    choice = data["choices"][0]
    got = {"text": choice["message"]["content"] if chat else choice["text"], "finish_reason": choice["finish_reason"],
           "prompt_tokens": data["usage"]["prompt_tokens"], "completion_tokens": data["usage"]["completion_tokens"]}
    problems = compare(got, expected, "server")
    r = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    if r.status_code != 200 or not events or events[-1] != "[DONE]":
        return problems + [f"server stream: HTTP {r.status_code}, did not end with [DONE]"]
    objs = [json.loads(e) for e in events[:-1]]
    text, finish, use = "", None, {}
    for o in objs:
        for c in o.get("choices", []):
            text += (c.get("delta", {}).get("content") or "") if chat else c.get("text", "")
            finish = c.get("finish_reason") or finish
        use = o.get("usage") or use
    got = {"text": text, "finish_reason": finish, "prompt_tokens": use.get("prompt_tokens"),
           "completion_tokens": use.get("completion_tokens")}
    return problems + compare(got, expected, "server stream")


# ---- the run -----------------------------------------------------------------------------------------

@dataclass
class Summary:
    cases: int = 0
    ok: int = 0
    ties: int = 0
    diverged: int = 0
    accepted: int = 0                       # EAGLE runs with tau > 1 (drafts were accepted)
    tau_sum: float = 0.0
    coverage: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    time_s: float = 0.0
    interrupted: bool = False               # stopped (Ctrl-C, SIGTERM) before all cases ran

    def add(self, case: Case, outcome: Outcome):
        self.cases += 1
        self.ok += outcome.status == "ok"
        self.ties += outcome.status == "tie"
        self.diverged += outcome.status == "diverged"
        self.accepted += outcome.tau > 1
        self.tau_sum += outcome.tau
        for key in _coverage_keys(case):
            self.coverage[key] = self.coverage.get(key, 0) + 1

    def line(self) -> str:
        return (f"{self.cases} cases: {self.ok} identical, {self.ties} target ties, {self.diverged} diverged; "
                f"drafts accepted in {self.accepted}, mean tau {self.tau_sum / max(self.cases, 1):.2f}; "
                f"{self.time_s:.1f} s" + (" (stopped early)" if self.interrupted else ""))


def _coverage_keys(case: Case) -> list[str]:
    keys = ["chat" if case.messages is not None else "raw", f"tree:{case.tree['kind']}", f"vocab:{case.vocab}",
            "compiled" if case.compiled else "eager"] + (["tree:auto"] if case.tree.get("auto") else [])
    keys += ["stop" if case.stop else "no-stop"] + (["extra-eos"] if case.extra_eos is not None else [])
    keys += ["ignore-eos"] if case.ignore_eos else []
    keys += [f"server:{case.server}"] if case.server else []
    return keys


def _log(line: str) -> None:
    print(line, flush=True)  # a long run's log is read while it runs


def fuzz(engines: Engines, cases: int, seed: int = 0, compiled_share: float = 0.0, server_share: float = 0.1,
         repro: Callable[[Case], str] = lambda c: c.to_json(), log=_log, every: int = 50,
         compiled_trees=COMPILED_TREES) -> Summary:
    """Run `cases` random cases; return the summary. Each divergence is logged with its reproduction."""
    rng = random.Random(seed)
    summary = Summary()
    t0 = time.perf_counter()
    for n in range(1, cases + 1):
        try:
            case = make_case(rng, engines, compiled_share, server_share, compiled_trees)
            outcome = run_case(engines, case)
        except KeyboardInterrupt:  # a long run stopped on purpose still reports the cases it finished
            summary.interrupted = True
            break
        summary.add(case, outcome)
        if outcome.status == "diverged":
            summary.failures.append((case, outcome))
            log(f"DIVERGED case {n}: " + "; ".join(outcome.problems[:3]))
            log(f"  reproduce: {repro(case)}")
        elif outcome.status == "tie":  # shown, not hidden: either token is plain decoding's there
            log(f"tie case {n}: {outcome.note}; " + "; ".join(outcome.problems[:2]))
            log(f"  replay: {repro(case)}")
        if every and n % every == 0:
            summary.time_s = time.perf_counter() - t0
            log(f"fuzz: {summary.line()}")
    summary.time_s = time.perf_counter() - t0
    return summary


# ---- command line ---------------------------------------------------------------------------------------

def add_cli(sub) -> None:
    p = sub.add_parser("fuzz", help="differential fuzzing: EAGLE's results against plain decoding's, field by field",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=200, help="random cases to run")
    p.add_argument("--seed", type=int, default=0, help="seed of the case generator")
    p.add_argument("--tiny", nargs="?", const="eagle", default=None, choices=["eagle", "eagle3"],
                   help="a tiny random target with a head that copies it (seconds; what CI runs) instead of --model: "
                        "an EAGLE-1 head, or with `--tiny eagle3` an EAGLE-3 one (default: off, --model)")
    p.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", default=None, help="EAGLE head folder (default: the model's shipped head)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="float32 compares bit-exactly; in bf16 a tree and one-token steps round differently")
    p.add_argument("--compiled-share", type=float, default=0.02,
                   help="share of cases run compiled (inductor's default mode; each compiled tree costs a compile)")
    p.add_argument("--server-share", type=float, default=0.1, help="share of cases also sent through the HTTP API")
    p.add_argument("--case", default=None, metavar="JSON",
                   help="replay one case (as printed by a divergence) (default: random cases)")
    p.add_argument("--log-every", type=int, default=50, help="cases between progress lines (0: none)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 with --tiny, whose every op is overhead that a second "
                        "OpenMP thread only slows down; else torch's default)")
    p.set_defaults(func=run)


def build(args) -> tuple[Engines, list[str]]:
    """The engines and the flags that rebuild them (for reproduction lines)."""
    import torch
    if args.tiny:
        from .testing import eagle3_oracle_pair, oracle_pair, tiny_tokenizer
        pair = eagle3_oracle_pair if args.tiny == "eagle3" else oracle_pair
        model, head = pair(noise=0.3, logit_scale=3.0)
        return Engines(model, tiny_tokenizer(), head), ["--tiny"] + (["eagle3"] if args.tiny == "eagle3" else [])
    from .engine import RANDOM_HEADS, Engine
    engine = Engine.load(args.model, args.head, device=args.device, dtype=getattr(torch, args.dtype))
    if engine.head_source in RANDOM_HEADS:
        print("eaglespec fuzz: the head is random: drafts are rarely accepted, so acceptance paths are barely "
              "exercised (give --head)", file=sys.stderr)
    flags = [f for name in ("model", "head", "device") if getattr(args, name)
             for f in (f"--{name}", str(getattr(args, name)))]
    flags += ["--dtype", args.dtype] if args.dtype != "float32" else []
    return Engines(engine.model, engine.tokenizer, engine.head), flags


def run(args) -> int:
    if args.cases < 1:
        raise ValueError(f"--cases must be >= 1, got {args.cases}")
    for name in ("compiled_share", "server_share"):
        if not 0 <= getattr(args, name) <= 1:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    import importlib.util
    if args.server_share > 0 and importlib.util.find_spec("httpx") is None:  # FastAPI's TestClient needs it
        raise ValueError("server cases need httpx (pip install httpx==0.28.1, as in requirements.lock), "
                         "or pass --server-share 0")
    if args.log_every < 0:
        raise ValueError(f"--log-every must be >= 0, got {args.log_every}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    replay = Case.from_json(args.case) if args.case else None
    threads = args.threads or (1 if args.tiny else None)
    if threads:
        import torch
        torch.set_num_threads(threads)
    engines, flags = build(args)
    try:
        if replay is not None:
            outcome = run_case(engines, replay)
            print(f"{outcome.status}{': ' + outcome.note if outcome.note else ''}, tau {outcome.tau:.2f}")
            for p in outcome.problems:
                print("  " + p)
            return 0 if outcome.status != "diverged" else 1

        def repro(case: Case) -> str:
            return shlex.join(["eaglespec", "fuzz", *flags, "--case", case.to_json()])

        import signal

        def stop(*_):
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, stop)  # `kill PID` ends a long run with its summary, as Ctrl-C does
        summary = fuzz(engines, args.cases, args.seed, args.compiled_share, args.server_share, repro,
                       every=args.log_every)
    finally:
        engines.close()
    print(f"eaglespec fuzz: {summary.line()}")
    print("coverage: " + ", ".join(f"{k} {v}" for k, v in sorted(summary.coverage.items())))
    return 1 if summary.diverged else 130 if summary.interrupted else 0
