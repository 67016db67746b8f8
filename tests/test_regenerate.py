"""`eaglespec regenerate` on tiny models: batched answers equal one-at-a-time answers and Engine's plain
decoding, sampling does not depend on the batch, resume after a kill, refused settings, bad input, and
`features` reading the output folder."""
from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from eaglespec.cli import build_parser, main
from eaglespec.data import Conversation, load_conversations
from eaglespec.engine import Engine
from eaglespec.features import FeatureStore
from eaglespec.loading import load_target, load_tokenizer
from eaglespec.regenerate import (conversation_temperature, parse_mix, plan_turns, regenerate_conversations,
                                  run_regenerate)

WORDS = "the quick brown fox jumps over a lazy dog while the target model verifies tokens".split()


def chat(i: int, turns: int) -> Conversation:
    msgs = [{"role": "system", "content": "be brief"}] if i % 4 == 0 else []
    for t in range(turns):
        msgs.append({"role": "user", "content": " ".join(WORDS[(i + t + j) % len(WORDS)] for j in range(2 + 3 * ((i + t) % 4)))})
        msgs.append({"role": "assistant", "content": "(ChatGPT's answer, to be replaced)"})
    return Conversation(f"c{i}", msgs, i)


def write_chats(path, n: int) -> str:
    with open(path, "w") as f:
        for i in range(n):
            c = chat(i, 1 + i % 3)
            rec = ({"id": f"c{i}_0", "conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                                         "value": m["content"]} for m in c.messages]}
                   if i % 2 else {"messages": c.messages})
            f.write(json.dumps(rec) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def model_and_tok(tiny):
    model, _ = load_target(str(tiny), device="cpu")
    return model, load_tokenizer(tiny)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_chats(tmp_path_factory.mktemp("regen-data") / "chats.jsonl", 23)


def cli(*argv) -> int:
    return main([str(a) for a in argv])


def read_folder(out) -> list[dict]:
    recs = []
    for p in sorted(out.glob("shard-*.jsonl.gz")):
        with gzip.open(p, "rt") as f:
            recs += [json.loads(x) for x in f if x.strip()]
    return recs


def compare_turns(model, a, b, same_or_tie) -> tuple[int, list[str]]:
    """Turn by turn, the answers of two runs of one conversation: equal, or apart from a tie onwards."""
    compared, ties = 0, []
    for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        assert a.prompt_tokens[k] == b.prompt_tokens[k]
        prompt = tokens_of(model, a, k)
        tie = same_or_tie(model, prompt, x, y)
        compared += 1
        if tie:
            ties.append(f"{a.conv.key} turn {k}: {tie}")
            break  # after a tie the conversations differ: nothing more to compare
    return compared, ties


def tokens_of(model, job, k):
    tok = model._test_tokenizer
    history = []
    for t in range(k + 1):
        history = history + job.turns[t]
        if t < k:
            history = history + [job.history[len(history)]]
    text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


# ---- the answers ------------------------------------------------------------------------------------------

def test_plan_turns_and_mix():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "b"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "y"},
            {"role": "user", "content": "d"}]
    assert [[m["content"] for m in t] for t in plan_turns(msgs)] == [["s", "a"], ["b", "c"], ["d"]]
    assert parse_mix(None, None) == [[0.0, 1.0]] and parse_mix(0.7, None) == [[0.7, 1.0]]
    mix = parse_mix(None, "0:1,0.7:3")
    assert mix == [[0.0, 0.25], [0.7, 0.75]]
    draws = Counter(conversation_temperature(mix, 0, f"key{i}") for i in range(4000))
    assert abs(draws[0.7] / 4000 - 0.75) < 0.03 and set(draws) == {0.0, 0.7}
    assert conversation_temperature(mix, 0, "abc") == conversation_temperature(mix, 0, "abc")
    for bad in ("0.5", "a:b", "0:-1", "-1:1"):
        with pytest.raises(ValueError):
            parse_mix(None, bad)
    with pytest.raises(ValueError):
        parse_mix(0.0, "0:1")


def test_batched_greedy_equals_one_at_a_time(model_and_tok, same_or_tie):
    model, tok = model_and_tok
    model._test_tokenizer = tok
    convs = [chat(i, 1 + i % 3) for i in range(11)]
    kw = dict(max_len=160, max_new_tokens=24)
    one = regenerate_conversations(model, tok, convs, batch_size=1, **kw)
    # batch 4 over 11 conversations of 1-3 turns: rows refill at different times and lengths
    many = regenerate_conversations(model, tok, convs, batch_size=4, **kw)
    compared, ties = 0, []
    for a, b in zip(many, one):
        assert a.skipped is None and b.skipped is None
        n, t = compare_turns(model, a, b, same_or_tie)
        compared, ties = compared + n, ties + t
        if not t:
            assert a.history == b.history and a.finishes == b.finishes and a.truncated == b.truncated
    assert compared >= 18, f"only {compared} turns compared"
    print("ties:", ties or "none")
    assert any(j.truncated for j in one), "max-len should cut some conversation short"


def test_compiled_batched_step_equals_eager(model_and_tok, same_or_tie):
    """The compiled decoding step (one graph: all rows, a bucketed cache prefix) writes what eager does,
    ties aside, with rows refilling at different times so that free rows run their dummy tokens."""
    model, tok = model_and_tok
    model._test_tokenizer = tok
    convs = [chat(i, 1 + i % 3) for i in range(7)]
    kw = dict(max_len=160, max_new_tokens=24, batch_size=3)
    eager = regenerate_conversations(model, tok, convs, **kw)
    compiled = regenerate_conversations(model, tok, convs, compile_mode="default", **kw)
    compared, ties = 0, []
    for a, b in zip(compiled, eager):
        n, t = compare_turns(model, a, b, same_or_tie)
        compared, ties = compared + n, ties + t
        if not t:
            assert a.history == b.history and a.finishes == b.finishes
    assert compared >= 10, f"only {compared} turns compared"
    print("ties:", ties or "none")


def test_greedy_regeneration_equals_engine_generate(tiny, same_or_tie):
    model, _ = load_target(str(tiny), device="cpu")
    tok = load_tokenizer(tiny)
    model._test_tokenizer = tok
    convs = [chat(i, 1 + i % 3) for i in range(8)]
    # let a token the model often writes end a turn, so that answers stop at EOS as well as at the budget
    probe = regenerate_conversations(model, tok, convs[:4], batch_size=4, max_len=200, max_new_tokens=40)
    eos = Counter(t for j in probe for ids in j.token_ids for t in ids[5:]).most_common(1)[0][0]
    model.args.eos_token_id = [eos]
    jobs = regenerate_conversations(model, tok, convs, batch_size=3, max_len=200, max_new_tokens=40)
    ref_model, _ = load_target(str(tiny), device="cpu")
    ref_model.args.eos_token_id = [eos]
    engine = Engine(ref_model, tok, None, None, max_context=200)
    finishes = Counter()
    for job in jobs:
        history = []
        for k, ids in enumerate(job.token_ids):
            history = history + job.turns[k]
            r = engine.generate(messages=history, method="vanilla", temperature=0, max_new_tokens=40)
            assert r.prompt_tokens == job.prompt_tokens[k]
            if same_or_tie(model, engine.encode(messages=history), ids, r.token_ids):
                break
            assert r.finish_reason == job.finishes[k] and r.text == job.history[len(history)]["content"]
            finishes[r.finish_reason] += 1
            history = history + [{"role": "assistant", "content": r.text}]
    assert finishes["stop"] and finishes["length"], finishes


def test_sampled_answers_do_not_depend_on_the_batch(model_and_tok):
    model, tok = model_and_tok
    convs = [chat(i, 1 + i % 2) for i in range(10)]
    kw = dict(mix="0:0.5,1.0:0.5", seed=3, max_len=160, max_new_tokens=20)
    a = regenerate_conversations(model, tok, convs, batch_size=1, **kw)
    b = regenerate_conversations(model, tok, convs, batch_size=5, **kw)
    assert {j.temperature for j in a} == {0.0, 1.0}
    assert [j.temperature for j in a] == [j.temperature for j in b]
    assert [j.token_ids for j in a] == [j.token_ids for j in b]
    c = regenerate_conversations(model, tok, convs, batch_size=5, **{**kw, "seed": 4})
    sampled = [i for i, j in enumerate(a) if j.temperature > 0 and c[i].temperature > 0]
    assert sampled and any(a[i].token_ids != c[i].token_ids for i in sampled)  # the seed matters


# ---- the command: files, resume, refusals, bad input ---------------------------------------------------------

def argv(tiny, data, out, *extra):
    return ["regenerate", "--model", tiny, "--data", data, "--out", out, "--shard-size", 4, "--max-len", 128,
            "--max-new-tokens", 16, "--batch-size", 3, *extra]


class Killed(Exception):
    pass


def test_resume_after_a_kill_loses_and_duplicates_nothing(tiny, chats, tmp_path):
    ref = tmp_path / "ref"
    assert cli(*argv(tiny, chats, ref)) == 0
    want = read_folder(ref)
    manifest = json.loads((ref / "manifest.json").read_text())
    assert manifest["complete"] and manifest["records_written"] == len(want) == 23 and len(manifest["shards"]) == 6
    assert manifest["new_tokens"] == sum(r["new_tokens"] for r in want) > 0
    assert [r["source_index"] for r in want] == list(range(23))
    assert [r["key"] for r in want] == [c.key for c in load_conversations(chats, need_assistant=False)[0]]
    assert {r["key"] for r in want if r["source_index"] % 2} == {f"c{i}" for i in range(1, 23, 2)}  # ShareGPT ids
    assert all(r["messages"][-1]["role"] == "assistant" and "ChatGPT" not in json.dumps(r["messages"]) for r in want)

    out = tmp_path / "killed"
    def kill_after_two(i, seen=[]):
        seen.append(i)
        if len(seen) == 2:
            raise Killed
    with pytest.raises(Killed):
        run_regenerate(build_parser().parse_args([str(a) for a in argv(tiny, chats, out)]), on_shard=kill_after_two)
    assert len(list(out.glob("shard-*.jsonl.gz"))) == 2
    killed = json.loads((out / "manifest.json").read_text())["sessions"]  # the killed process's line is kept
    assert len(killed) == 1 and killed[0]["new_tokens"] > 0 and killed[0]["seconds"] > 0
    (out / "shard-00005.jsonl.gz.tmp").write_bytes(b"half a shard")  # what a kill mid-write leaves
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.jsonl.gz")}
    assert cli(*argv(tiny, chats, out)) == 0
    assert all((out / n).stat().st_mtime_ns == s for n, s in stamps.items())  # finished shards were kept
    assert read_folder(out) == want
    resumed = json.loads((out / "manifest.json").read_text())
    assert resumed["records_written"] == 23
    assert len(resumed["sessions"]) == 2 and resumed["sessions"][0] == killed[0]
    assert sum(s["new_tokens"] for s in resumed["sessions"]) >= resumed["new_tokens"]  # the lost shard was redone

    # a larger --max-conversations continues the run: only the old plan's last shard is redone
    small, big = tmp_path / "grow", tmp_path / "big"
    assert cli(*argv(tiny, chats, small, "--max-conversations", 10)) == 0
    stamps = {p.name: p.stat().st_mtime_ns for p in small.glob("shard-*.jsonl.gz")}
    assert sorted(stamps) == [f"shard-0000{i}.jsonl.gz" for i in range(3)]
    assert cli(*argv(tiny, chats, small)) == 0
    assert (small / "shard-00001.jsonl.gz").stat().st_mtime_ns == stamps["shard-00001.jsonl.gz"]
    assert (small / "shard-00002.jsonl.gz").stat().st_mtime_ns != stamps["shard-00002.jsonl.gz"]
    assert read_folder(small) == want
    del big


def test_a_killed_process_resumes_without_loss_or_duplicates(tiny, chats, tmp_path):
    """SIGKILL at an arbitrary moment (here: soon after the first shard lands), then the same command."""
    out = tmp_path / "sigkill"
    args = [str(a) for a in argv(tiny, chats, out, "--batch-size", 1, "--max-new-tokens", 48)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "eaglespec.cli", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (out / "shard-00000.jsonl.gz").is_file() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "finished before it could be killed: nothing tested"
    assert cli(*args) == 0
    got = read_folder(out)
    assert [r["source_index"] for r in got] == list(range(23))
    ref = tmp_path / "sigkill-ref"
    assert cli(*argv(tiny, chats, ref, "--batch-size", 1, "--max-new-tokens", 48)) == 0
    assert got == read_folder(ref)


def one_line_error(capsys, *args) -> str:
    rc = cli(*args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err and err[-1].startswith("eaglespec: error:") and "Traceback" not in "\n".join(err), err
    return err[-1]


def test_other_settings_are_refused(tiny, chats, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli(*argv(tiny, chats, out, "--max-conversations", 4)) == 0
    before = read_folder(out)
    msg = one_line_error(capsys, *argv(tiny, chats, out, "--max-conversations", 4, "--temperature", 0.5))
    assert "other settings" in msg and "temperatures" in msg
    assert "max_new_tokens" in one_line_error(capsys, *argv(tiny, chats, out, "--max-conversations", 4)[:-6],
                                              "--max-new-tokens", 9, "--batch-size", 3, "--max-conversations", 4)
    assert "smaller" in one_line_error(capsys, *argv(tiny, chats, out, "--max-conversations", 2))
    assert read_folder(out) == before
    # the batch size may change on a resume: it does not change what is written
    assert cli(*argv(tiny, chats, out, "--max-conversations", 4, "--batch-size", 2)) == 0


def test_bad_input_is_a_one_line_error_or_a_counted_skip(tiny, tmp_path, capsys):
    assert "not found" in one_line_error(capsys, *argv(tiny, tmp_path / "nope.jsonl", tmp_path / "o1"))
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    assert "cannot read" in one_line_error(capsys, *argv(tiny, tmp_path / "bad.jsonl.gz", tmp_path / "o2"))
    (tmp_path / "bin.json").write_bytes(b"\x00\x01garbage")
    assert "no usable conversations" in one_line_error(capsys, *argv(tiny, tmp_path / "bin.json", tmp_path / "o3"))
    assert "--mix" in one_line_error(capsys, *argv(tiny, tmp_path / "bin.json", tmp_path / "o4", "--mix", "hot"))
    assert "--max-len" in one_line_error(capsys, *argv(tiny, tmp_path / "bin.json", tmp_path / "o5"), "--max-len", 0)

    data = tmp_path / "mixed.jsonl"
    long_question = " ".join(WORDS * 30)  # far over --max-len 128
    recs = [{"messages": [{"role": "user", "content": "hi there"}]},            # no answer yet: fine here
            {"messages": [{"role": "assistant", "content": "no question"}]},    # no user turn
            {"messages": [{"role": "user", "content": long_question}]},         # prompt longer than the context
            {"messages": [{"role": "user", "content": "short"}, {"role": "assistant", "content": "x"},
                          {"role": "user", "content": long_question}]},         # the second turn does not fit
            "{broken"]
    data.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    out = tmp_path / "skips"
    assert cli(*argv(tiny, data, out)) == 0
    printed = capsys.readouterr().out
    got = read_folder(out)
    assert [r["source_index"] for r in got] == [0, 3]
    assert got[1]["truncated"] and [m["role"] for m in got[1]["messages"]] == ["user", "assistant"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped"] == {"prompt longer than max-len": 1}
    summary = [line for line in printed.splitlines() if line.startswith("regenerated:")]
    assert summary and "3 skipped" in summary[0] and "1 no user turn" in summary[0] and "1 invalid JSON" in summary[0]
    assert "1 prompt longer than max-len" in summary[0] and "tok/s aggregate" in printed


def test_features_and_data_read_the_output_folder(tiny, chats, tmp_path):
    out = tmp_path / "regen"
    assert cli(*argv(tiny, chats, out)) == 0
    recs = read_folder(out)
    convs, report = load_conversations(str(out))
    assert [c.key for c in convs] == [r["key"] for r in recs] and [c.messages for c in convs] == [r["messages"] for r in recs]
    assert not report.skipped
    # a .jsonl.gz file is a source too
    with gzip.open(tmp_path / "one.jsonl.gz", "wt") as f:
        f.write(json.dumps(recs[0]) + "\n")
    assert load_conversations(str(tmp_path / "one.jsonl.gz"))[0][0].messages == recs[0]["messages"]
    feats = tmp_path / "feats"
    assert cli("features", "--model", tiny, "--data", out, "--out", feats, "--shard-size", 10, "--max-len", 128) == 0
    store = FeatureStore(feats)
    assert len(store) == 23 and store.keys == [r["key"] for r in recs]
    ids, mask = store.tokens(5)
    assert mask.any()


def test_the_target_writes_its_own_questions(tiny, model_and_tok, same_or_tie):
    """--data self: each conversation's question is sampled from the target (its chat template up to a user
    message's text), then answered as any other. The questions and answers do not depend on the batch; each
    greedy answer is Engine's plain decoding of that question (the answer's prefill reuses the question's cache);
    a question is at most --prompt-tokens long."""
    from eaglespec.regenerate import self_conversations
    model, tok = model_and_tok
    convs = self_conversations(8)
    kw = dict(temperature=0.0, seed=5, max_len=128, max_new_tokens=16, prompt_tokens=12)
    a = regenerate_conversations(model, tok, convs, batch_size=1, **kw)
    b = regenerate_conversations(model, tok, convs, batch_size=3, **kw)
    assert [j.history for j in a] == [j.history for j in b]
    written = [j for j in a if j.skipped is None]
    assert len(written) >= 6 and len({j.history[0]["content"] for j in written}) == len(written)  # all different
    engine = Engine(load_target(str(tiny), device="cpu")[0], tok, None, None, max_context=128)
    for job in written:
        assert [m["role"] for m in job.history] == ["user", "assistant"] and 0 < job.written_prompts[0] <= 12
        assert job.record()["written_prompt_tokens"] == job.written_prompts
        r = engine.generate(messages=job.history[:1], method="vanilla", temperature=0, max_new_tokens=16)
        if not same_or_tie(model, engine.encode(messages=job.history[:1]), job.token_ids[0], r.token_ids):
            assert r.text == job.history[1]["content"]
    c = regenerate_conversations(model, tok, convs, batch_size=3, **{**kw, "seed": 6})
    assert [j.history[:1] for j in c] != [j.history[:1] for j in a]  # the seed draws other questions


def test_self_questions_from_the_command(tiny, tmp_path, capsys):
    """`regenerate --data self` writes resumable shards of target-written exchanges, and needs a count."""
    assert "--max-conversations" in one_line_error(capsys, *argv(tiny, "self", tmp_path / "o1"))
    assert "--prompt-temperature" in one_line_error(capsys, *argv(tiny, "self", tmp_path / "o2"), "--max-conversations",
                                                    4, "--prompt-temperature", 0)
    out = tmp_path / "self"
    assert cli(*argv(tiny, "self", out), "--max-conversations", 6, "--prompt-tokens", 10) == 0
    got = read_folder(out)
    assert [r["key"] for r in got] == [f"self-{i:07d}" for i in range(6) if i in {int(r["key"][5:]) for r in got}]
    assert got and all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in got)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prompt_tokens"] == 10 and manifest["prompt_temperature"] == 1.0 and manifest["complete"]
    assert "regenerated:" in capsys.readouterr().out
    convs, _ = load_conversations(str(out))  # features and train read it as any regenerated folder
    assert [c.key for c in convs] == [r["key"] for r in got]


def test_openings_start_the_written_questions(tiny, model_and_tok, tmp_path, capsys):
    """--openings forces each written question's first words, drawn by weight from the conversation's key (the same
    in every run, whatever the batch); the target writes the rest, and the answer answers the whole question. The
    list comes from a preset, a file or inline; a bad one, or one without --data self, is a one-line error; a resume
    with other openings is refused."""
    from eaglespec.regenerate import OPENING_PRESETS, parse_openings, self_conversations
    assert parse_openings("Write a:3,Solve") == [["Write a", 0.75], ["Solve", 0.25]]
    assert parse_openings("Note: be brief") == [["Note: be brief", 1.0]]  # a colon that is not a weight
    f = tmp_path / "openings.txt"
    f.write_text("2\tWrite a\nExtract\n\n")
    assert parse_openings(str(f)) == [["Write a", 2 / 3], ["Extract", 1 / 3]]
    assert len(parse_openings("tasks")) == len(OPENING_PRESETS["tasks"])
    for bad in ("Solve:0", ",", "Write a:-1"):
        with pytest.raises(ValueError, match="--openings"):
            parse_openings(bad)
    drawn = [c.messages[0]["opening"] for c in self_conversations(2000, parse_openings("A:3,B"), seed=1)]
    assert 0.72 < drawn.count("A") / 2000 < 0.78  # the shares (binomial sd 0.01)
    assert drawn[:50] == [c.messages[0]["opening"] for c in self_conversations(50, parse_openings("A:3,B"), seed=1)]
    assert drawn[:50] != [c.messages[0]["opening"] for c in self_conversations(50, parse_openings("A:3,B"), seed=2)]

    model, tok = model_and_tok
    convs = self_conversations(6, parse_openings("Write a,Solve"), seed=0)
    kw = dict(temperature=0.0, seed=3, max_len=128, max_new_tokens=12, prompt_tokens=10)
    a = regenerate_conversations(model, tok, convs, batch_size=1, **kw)
    b = regenerate_conversations(model, tok, convs, batch_size=4, **kw)
    assert [j.history for j in a] == [j.history for j in b]
    plain = regenerate_conversations(model, tok, self_conversations(6), batch_size=4, **kw)
    written = [(c, j) for c, j in zip(convs, a) if j.skipped is None]
    assert len(written) >= 4
    for c, job in written:
        opening = c.messages[0]["opening"]
        assert job.history[0]["content"].startswith(opening) and job.record()["openings"] == [opening]
    assert [j.history[:1] for j in plain] != [j.history[:1] for j in a]
    assert all("openings" not in j.record() for j in plain if j.skipped is None)

    assert "--openings" in one_line_error(capsys, *argv(tiny, "self", tmp_path / "o1"), "--max-conversations", 4,
                                          "--openings", "Solve:0")
    assert "--data self" in one_line_error(capsys, *argv(tiny, "sharegpt", tmp_path / "o2"), "--openings", "Solve")
    out = tmp_path / "self"
    assert cli(*argv(tiny, "self", out), "--max-conversations", 4, "--prompt-tokens", 8, "--openings", "Write a") == 0
    got = read_folder(out)
    assert got and all(r["messages"][0]["content"].startswith("Write a") and r["openings"] == ["Write a"] for r in got)
    assert json.loads((out / "manifest.json").read_text())["openings"] == [["Write a", 1.0]]
    assert "openings" in one_line_error(capsys, *argv(tiny, "self", out), "--max-conversations", 4, "--prompt-tokens", 8,
                                        "--openings", "Solve")


def test_repeated_written_questions_are_read_once(tmp_path):
    """A folder of target-written exchanges keeps one copy of each question (case and spacing aside) and counts the
    rest; questions that came from a dataset are left as they are."""
    recs = [{"key": "self-0", "messages": [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "a"}],
             "written_prompt_tokens": [3]},
            {"key": "self-1", "messages": [{"role": "user", "content": "hi  THERE!"}, {"role": "assistant", "content": "b"}],
             "written_prompt_tokens": [4]},
            {"key": "c2", "messages": [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "c"}]},
            {"key": "c3", "messages": [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "d"}]}]
    path = tmp_path / "written.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    convs, report = load_conversations(str(path))
    assert [c.key for c in convs] == ["self-0", "c2", "c3"] and report.skipped == {"repeated written question": 1}


def test_written_questions_that_are_a_benchmarks_are_dropped(tmp_path, monkeypatch):
    """A written question sharing a run of 13 words with a benchmark question, or equal to a short one (case and
    punctuation aside), is left out and counted; 12 shared words are not enough; a dataset's own questions are
    not checked. Without a guard given, the sets found on the machine are read (here: one planted folder)."""
    from eaglespec import bench
    from eaglespec.data import QuestionGuard
    long_q = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."
    folder = tmp_path / "sets"
    folder.mkdir()
    (folder / "mt_bench.jsonl").write_text(json.dumps({"question_id": 1, "category": "writing",
                                                       "turns": [long_q, "Rewrite it."]}) + "\n")
    monkeypatch.setattr(bench, "package_file", lambda *a: None)
    monkeypatch.setattr(bench, "humaneval_from_wheel", lambda: None)
    monkeypatch.setattr(bench, "default_questions_dir", lambda: folder)
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path / "cache"))

    def rec(key, question, written=True):
        r = {"key": key, "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "a"}]}
        return r | ({"written_prompt_tokens": [5]} if written else {})
    words = long_q.split()
    recs = [rec("self-0", "Please: " + " ".join(words[2:15]).upper() + " and more"),  # 13 words of it
            rec("self-1", "Please " + " ".join(words[2:14]) + " and more"),             # 12 words: kept
            rec("self-2", "rewrite IT"),                                               # the short turn, copied
            rec("self-3", "Rewrite it in French."),                                    # more than the short turn
            rec("c4", long_q, written=False)]                                          # a dataset's: not checked
    path = tmp_path / "written.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    convs, report = load_conversations(str(path))
    assert [c.key for c in convs] == ["self-1", "self-3", "c4"]
    assert report.skipped == {"benchmark question": 2}
    assert "checked against mt_bench" in report.summary(len(convs))
    guard = QuestionGuard([])  # an explicit guard replaces the machine's sets
    convs, report = load_conversations(str(path), guard=guard)
    assert len(convs) == 5 and not report.skipped
    monkeypatch.setattr(bench, "default_questions_dir", lambda: None)
    _, report = load_conversations(str(path))
    assert "not checked" in report.summary(5)
