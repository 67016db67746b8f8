"""EAGLE's result equals plain decoding's in every field where a round is cut short: by a stop string,
by overlapping stop strings, by an EOS just past the budget. Plain decoding checks the stopping rules
after each token, so EAGLE must too. Also: an Engine refuses a second open stream, a tree that asks
for more draft candidates than the head's vocabulary holds, and keeps rotary frequencies in fp32."""
from __future__ import annotations

import json

import pytest
import torch

from eaglespec.engine import Engine
from eaglespec.head import EagleHead
from eaglespec.loading import load_target
from eaglespec.model import rope_inv_freq
from eaglespec.testing import tiny_tokenizer
from eaglespec.stopping import stream_delta
from eaglespec.tree import TreeConfig

FIELDS = ("token_ids", "text", "finish_reason", "new_tokens", "prompt_tokens")


@pytest.fixture(scope="module")
def pair(make_oracle_pair):
    return make_oracle_pair(noise=0.3, logit_scale=3.0)


@pytest.fixture(scope="module")
def engine(pair):
    model, head = pair
    return Engine(model, tokenizer=tiny_tokenizer(), head=head)


def fields(r) -> dict:
    return {f: getattr(r, f) for f in FIELDS}


def streamed(engine, **kw):
    chunks = list(engine.stream(**kw))
    r = chunks[-1].result
    assert "".join(c.text for c in chunks) == r.text
    assert sum((c.token_ids for c in chunks), []) == r.token_ids
    return r


def both(engine, **kw):
    return [streamed(engine, method=m, **kw) for m in ("eagle", "vanilla")]


def test_a_stop_string_cuts_the_round_where_plain_decoding_stops(engine):
    """The issue's pair: plain decoding stops after 9 tokens; EAGLE kept the rest of its round (11)."""
    e, v = both(engine, prompt="Once upon a time", max_new_tokens=40, stop="N2")
    assert v.finish_reason == "stop" and v.new_tokens == 9
    assert fields(e) == fields(v)
    assert max(e.accept_lengths) > 1  # rounds of several tokens were accepted
    # the cut round counts the tokens kept, so tau is what those tokens cost
    assert sum(e.accept_lengths) + 1 == e.new_tokens


def test_the_servers_usage_counts_the_tokens_plain_decoding_counts(engine):
    """usage.completion_tokens, whole and streamed, for the same cut round: 9 tokens, not 11."""
    from fastapi.testclient import TestClient

    from eaglespec.serve import create_app
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 40, "stop": "N2", "temperature": 0}
    with TestClient(create_app(engine, "tiny")) as client:
        for method in ("eagle", "vanilla"):
            r = client.post("/v1/completions", json={**body, "method": method})
            assert r.status_code == 200, r.text
            data = r.json()
            assert data["usage"]["completion_tokens"] == 9, (method, data["usage"])
            assert data["choices"][0]["finish_reason"] == "stop"
            r = client.post("/v1/completions", json={**body, "method": method, "stream": True,
                                                     "stream_options": {"include_usage": True}})
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            assert [e["usage"]["completion_tokens"] for e in events if e.get("usage")] == [9], method


def test_the_server_answers_once_the_engine_is_free_again(engine, monkeypatch):
    """Whoever has the server's answer may use the engine at once: the result is handed over after the stream
    has let go of it. Its letting go is slowed here, so a result sent before it (as it was) fails every time."""
    import contextlib
    import time

    import eaglespec.engine as engine_module
    from fastapi.testclient import TestClient

    from eaglespec.serve import create_app
    real = engine_module._exclusive

    @contextlib.contextmanager
    def slow_release(e):
        with real(e):
            try:
                yield
            finally:
                time.sleep(0.3)
    monkeypatch.setattr(engine_module, "_exclusive", slow_release)
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    with TestClient(create_app(engine, "tiny")) as client:
        for stream in (False, True):
            r = client.post("/v1/completions", json={**body, "stream": stream})
            assert r.status_code == 200, r.text
            assert engine.generate("Hello", max_new_tokens=2).new_tokens >= 1, stream


def test_overlapping_stops_end_at_the_match_that_completes_first(engine):
    e, v = both(engine, prompt="Question: what is", max_new_tokens=40, stop=["timas ", "ma"])
    assert v.text == " ti"
    assert fields(e) == fields(v)


def rounds_of(engine, **kw) -> list[list[int]]:
    """The tokens of each EAGLE round (prefill's token first), before the stopping rules apply."""
    seen, real = [], engine._eagle

    def spy(*args):
        for new in real(*args):
            seen.append(list(new))
            yield new

    engine._eagle = spy
    try:
        engine.generate(method="eagle", **kw)
    finally:
        del engine._eagle
    return seen


def test_an_eos_just_past_the_budget_is_length_as_in_plain_decoding(engine):
    """A round [.., a, EOS] with the budget ending at a: plain decoding never sees the EOS."""
    for seed in range(30):
        prompt = torch.randint(3, 320, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        rounds = rounds_of(engine, input_ids=prompt, max_new_tokens=48, ignore_eos=True)
        out = [t for r in rounds for t in r]
        at = len(rounds[0])
        for r in rounds[1:]:
            for i in range(1, len(r)):  # r[i] follows r[i-1] within the round
                if r[i] not in out[:at + i]:
                    budget, eos = at + i, r[i]
                    break
            else:
                at += len(r)
                continue
            break
        else:
            continue
        break
    else:
        pytest.fail("no round had a fresh token after its first")
    base = engine.eos_ids
    engine.eos_ids = {eos}
    try:
        e, v = both(engine, input_ids=prompt, max_new_tokens=budget)
    finally:
        engine.eos_ids = base
    assert v.finish_reason == "length" and v.new_tokens == budget
    assert fields(e) == fields(v)


def test_a_second_stream_on_one_engine_is_refused(engine):
    first = engine.stream("Once upon a time", max_new_tokens=30, ignore_eos=True)
    next(first)
    second = engine.stream("Hello", max_new_tokens=5)
    with pytest.raises(RuntimeError, match="already"):
        next(second)
    with pytest.raises(RuntimeError, match="already"):
        engine.generate("Hello", max_new_tokens=5)
    rest = list(first)
    assert rest[-1].result.new_tokens == 30  # the first stream was not disturbed
    assert engine.generate("Hello", max_new_tokens=5).new_tokens >= 1  # free again once it ended
    abandoned = engine.stream("Hello", max_new_tokens=5)
    next(abandoned)
    abandoned.close()
    assert engine.generate("Hello", max_new_tokens=5).new_tokens >= 1


def with_draft_vocab(head: EagleHead, ids) -> EagleHead:
    reduced = EagleHead(head.args, bias=head.bias, draft_vocab=torch.tensor(ids))
    reduced.load_state_dict(head.state_dict(), strict=False)
    return reduced.eval().requires_grad_(False)


def test_a_draft_vocabulary_smaller_than_the_trees_top_k_is_refused_at_load(pair):
    model, head = pair
    small = with_draft_vocab(head, [3, 5, 7])
    with pytest.raises(ValueError, match="draft vocabulary"):
        Engine(model, head=small, tree=TreeConfig(top_k=4))
    with pytest.raises(ValueError, match="draft vocabulary"):
        Engine(model, head=small, tree=TreeConfig(kind="static"))  # EAGLE-1's tree takes 4 per node
    ok = Engine(model, head=small, tree=TreeConfig(kind="chain"))
    assert ok.generate(input_ids=[5, 6], max_new_tokens=8, ignore_eos=True).new_tokens == 8
    ok.tree = TreeConfig(top_k=4)  # a tree swapped in later is checked too, before decoding starts
    with pytest.raises(ValueError, match="draft vocabulary"):
        ok.generate(input_ids=[5, 6], max_new_tokens=8)


def test_bf16_keeps_rotary_frequencies_in_fp32(tiny_checkpoint):
    folder = tiny_checkpoint("llama")
    engine = Engine.load(str(folder), head="random", device="cpu", dtype=torch.bfloat16)
    want = rope_inv_freq(engine.model.args)
    for module in (engine.model, engine.head):
        assert module.fc.weight.dtype == torch.bfloat16 if module is engine.head else \
            module.embed_tokens.weight.dtype == torch.bfloat16
        assert module.rotary.inv_freq.dtype == torch.float32
        assert torch.equal(module.rotary.inv_freq, want)
    model, _ = load_target(folder, device="cpu", dtype=torch.float16)
    assert model.rotary.inv_freq.dtype == torch.float32
    assert engine.generate(input_ids=[5, 6, 7], max_new_tokens=4, ignore_eos=True).new_tokens == 4


def test_a_tiny_temperature_is_greedy_and_a_bad_seed_is_one_line(engine):
    greedy = engine.generate("Once upon a time", max_new_tokens=12, ignore_eos=True)
    for m in ("eagle", "vanilla"):
        tiny = engine.generate("Once upon a time", method=m, max_new_tokens=12, ignore_eos=True, temperature=1e-40,
                               seed=1)
        assert tiny.token_ids == greedy.token_ids
    for seed in (2**64, -1, 1.5, "7"):
        with pytest.raises(ValueError, match="seed"):
            engine.generate("Hi", max_new_tokens=2, seed=seed)


def test_an_incomplete_character_does_not_let_a_stop_strings_start_out():
    """A partial UTF-8 character decodes as one U+FFFD per byte so far; counting those as settled text
    streamed the ';' that began the stop string ';\\x1c\\x19\\u076c\\u02fe' (found by the fuzzer)."""
    text = "X;\x1c\x19\ufffd\ufffd"  # the stop string is 5 characters: hold back 4 of the settled text
    delta, sent = stream_delta(text, 0, hold=4, done=False)
    assert ";" not in delta and sent <= 1
    final, _ = stream_delta("X", sent, hold=4, done=True)  # the match cut the text at the ';'
    assert delta + final == "X"
