"""Edge cases of the decoding loop, each checked for EAGLE against plain decoding: one-token prompts,
one new token, EOS in the middle of an accepted path, a full context, stop strings, streaming."""
from __future__ import annotations

import pytest
import torch

from eaglespec.engine import Engine
from eaglespec.testing import tiny_tokenizer
from eaglespec.tree import TreeConfig

METHODS = ("eagle", "vanilla")


def prompt_ids(n: int, seed: int = 0, vocab: int = 320) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pair(make_oracle_pair):
    return make_oracle_pair(noise=0.3, logit_scale=3.0)


@pytest.fixture(scope="module")
def chat_engine(pair):
    """The oracle pair (multi-token acceptance) with the tiny byte-level BPE tokenizer."""
    model, head = pair
    return Engine(model, tokenizer=tiny_tokenizer(), head=head)


def ascii_piece(text: str, start: int, n: int) -> str:
    """The first printable-ASCII substring of length n at or after `start` (random models emit
    plenty of broken UTF-8; a stop string of replacement characters would prove little)."""
    i = next(i for i in range(start, len(text) - n) if text[i:i + n].isascii() and text[i:i + n].isprintable())
    return text[i:i + n]


def spy_rounds(engine: Engine) -> list[list[int]]:
    """Record the tokens each EAGLE round hands to the engine's stopping rules, before they apply."""
    rounds, real = [], engine._eagle

    def eagle(*args):
        for new in real(*args):
            rounds.append(list(new))
            yield new

    engine._eagle = eagle
    return rounds


def test_one_token_prompt(pair, same_or_tie):
    model, head = pair
    for kind in ("dynamic", "static", "chain"):
        engine = Engine(model, head=head, tree=TreeConfig(kind=kind))
        for tok in (5, 77, 300):
            e, v = (engine.generate(input_ids=[tok], method=m, max_new_tokens=20, ignore_eos=True) for m in METHODS)
            assert e.prompt_tokens == 1 and e.new_tokens == v.new_tokens == 20
            same_or_tie(model, [tok], e.token_ids, v.token_ids)


def test_one_new_token(pair):
    model, head = pair
    engine = Engine(model, head=head)
    for p in (prompt_ids(1), prompt_ids(17, seed=1)):
        results = [engine.generate(input_ids=p, method=m, max_new_tokens=1) for m in METHODS]
        for r in results:
            assert r.new_tokens == len(r.token_ids) == 1 and r.finish_reason == "length"
        assert results[0].token_ids == results[1].token_ids
        sampled = [engine.generate(input_ids=p, method=m, max_new_tokens=1, temperature=1.0, seed=3) for m in METHODS]
        assert all(r.new_tokens == 1 for r in sampled)


def test_eos_inside_an_accepted_path_stops_there(make_oracle_pair):
    """EOS drafted and accepted mid-path: output ends before it, nothing after it, as plain decoding."""
    model, head = make_oracle_pair(noise=0.0, logit_scale=3.0)
    engine = Engine(model, head=head, tree=TreeConfig(kind="chain"))
    rounds = spy_rounds(engine)
    for seed in range(20):
        prompt = prompt_ids(8, seed=seed)
        full = engine.generate(input_ids=prompt, max_new_tokens=32, ignore_eos=True).token_ids
        # a token with tokens after it in its round, appearing nowhere earlier in the output
        at, done = 1, []
        for new in rounds[1:]:
            for i, t in enumerate(new[:-1]):
                if t not in full[:at + i]:
                    done.append((t, at + i))
            at += len(new)
        rounds.clear()
        if done:
            eos, k = done[0]
            break
    else:
        pytest.fail("no prompt put a fresh token inside an accepted path")

    model.args.eos_token_id = [eos]  # the model's own EOS; Engine reads it at construction
    engine = Engine(model, head=head, tree=TreeConfig(kind="chain"))
    rounds = spy_rounds(engine)
    e = engine.generate(input_ids=prompt, max_new_tokens=32)
    v = engine.generate(input_ids=prompt, method="vanilla", max_new_tokens=32)
    assert any(eos in new[:-1] for new in rounds), "EOS was not inside an accepted path"
    for r in (e, v):
        assert r.finish_reason == "stop"
        assert r.token_ids == full[:k] and eos not in r.token_ids
    kept = engine.generate(input_ids=prompt, max_new_tokens=32, ignore_eos=True)
    assert kept.token_ids == full and kept.finish_reason == "length"


@pytest.mark.parametrize("kind", ["dynamic", "chain"])
def test_generation_stops_at_a_full_context(kind, make_oracle_pair, same_or_tie):
    model, head = make_oracle_pair(noise=0.3, logit_scale=3.0, max_position_embeddings=40)
    for max_context, n_prompt in ((24, 10), (24, 23), (None, 30)):  # None: the model's own 40
        engine = Engine(model, head=head, tree=TreeConfig(kind=kind), max_context=max_context)
        prompt = prompt_ids(n_prompt, seed=n_prompt)
        e, v = (engine.generate(input_ids=prompt, method=m, max_new_tokens=100, ignore_eos=True) for m in METHODS)
        for r in (e, v):
            assert r.finish_reason == "length"
            assert r.prompt_tokens + r.new_tokens == engine.max_context == (max_context or 40)
        same_or_tie(model, prompt, e.token_ids, v.token_ids)


def test_stop_strings(chat_engine):
    prompt = "The quick brown fox"
    full = chat_engine.generate(prompt, method="vanilla", max_new_tokens=40, ignore_eos=True)
    text = full.text
    assert len(text) > 20, text
    late, early = ascii_piece(text, 14, 3), ascii_piece(text, 6, 2)
    assert text.find(early) < text.find(late)
    for stop, cut in ((late, text.find(late)), ([late, early], min(text.find(late), text.find(early)))):
        for m in METHODS:
            r = chat_engine.generate(prompt, method=m, max_new_tokens=40, ignore_eos=True, stop=stop)
            assert (r.text, r.finish_reason) == (text[:cut], "stop"), (m, stop)
    for m in METHODS:  # a stop string that never shows: full length
        r = chat_engine.generate(prompt, method=m, max_new_tokens=40, ignore_eos=True, stop="\x00never")
        assert (r.text, r.finish_reason) == (text, "length")


@pytest.mark.parametrize("method", METHODS)
def test_stream_chunks_add_up_to_the_result(method, chat_engine):
    text = chat_engine.generate("Once upon a time", method="vanilla", max_new_tokens=48, ignore_eos=True).text
    cases = [dict(), dict(stop=ascii_piece(text, 20, 3)), dict(stop=["\x00never", "xyzzy"]),
             dict(temperature=1.0, seed=1), dict(messages=[{"role": "user", "content": "Hello there"}])]
    for kw in cases:
        kw = {"prompt": "Once upon a time", **kw} if "messages" not in kw else kw
        chunks = list(chat_engine.stream(method=method, max_new_tokens=48, ignore_eos=True, **kw))
        result = chunks[-1].result
        assert result is not None and all(c.result is None for c in chunks[:-1])
        assert "".join(c.text for c in chunks) == result.text, kw
        assert sum((c.token_ids for c in chunks), []) == result.token_ids, kw
        if method == "eagle" and not kw.get("stop"):
            assert any(len(c.token_ids) > 1 for c in chunks)  # rounds of several tokens were streamed
