"""The server refuses what it cannot do as asked, with a 4xx naming the field, and never answers 500 to
a client's input: tiny temperatures, lone surrogates, huge bodies, fields that would change behaviour,
unknown roles, max_tokens defaults and caps, context overflows, bad seeds; CORS only when asked; and a
stream cut by shutdown still ends with an error event and [DONE]."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from eaglespec.engine import Engine
from eaglespec.serve import ServeLimits, create_app
from eaglespec.testing import make_tiny_checkpoint
from eaglespec.tree import TreeConfig

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Question 1: what is 1 times 7?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("limits") / MODEL, max_position_embeddings=2048)
    return Engine.load(str(folder), head="random", device="cpu",
                       tree=TreeConfig("dynamic", top_k=2, depth=2, total_tokens=4))


@contextmanager
def app_client(engine, **kw):
    with TestClient(create_app(engine, MODEL, **kw), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def api(engine):
    with app_client(engine, limits=ServeLimits(max_body_bytes=20_000, default_max_tokens=5, max_tokens_cap=40)) as c:
        yield c


def chat(api, **fields):
    return api.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **fields})


def error(r, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- values ------------------------------------------------------------------------------------------

def test_a_tiny_temperature_is_greedy_and_above_two_is_refused(api, engine):
    greedy = chat(api, max_tokens=8, temperature=0).json()["choices"][0]["message"]["content"]
    r = chat(api, max_tokens=8, temperature=1e-40)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == greedy
    assert "temperature" in error(chat(api, temperature=2.5), 400, "temperature")["message"]
    assert chat(api, max_tokens=2, temperature=2.0).status_code == 200


@pytest.mark.parametrize("where", ["content", "role", "model", "prompt", "stop"])
def test_lone_surrogates_are_a_400(api, where):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    path = "/v1/chat/completions"
    if where == "content":
        body["messages"][0]["content"] = "SURROGATE"
    elif where == "role":
        body["messages"][0]["role"] = "SURROGATE"
    elif where == "model":
        body["model"] = "SURROGATE"
    elif where == "stop":
        body["stop"] = ["SURROGATE"]
    else:
        path, body = "/v1/completions", {"model": MODEL, "prompt": "SURROGATE", "max_tokens": 2}
    raw = json.dumps(body).replace("SURROGATE", "a\\ud800b").encode()
    r = api.post(path, content=raw, headers={"content-type": "application/json"})
    err = error(r, 400)
    assert "surrogate" in err["message"] or "Unicode" in err["message"], err


def test_the_model_route_does_not_crash_on_odd_names(api):
    for name in ("%ED%A0%80", "a%00b", "%FF"):
        r = api.get(f"/v1/models/{name}")
        assert r.status_code in (400, 404), r.text
        assert "error" in r.json()


def test_a_body_over_the_limit_is_413_before_it_is_parsed(api):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 30_000}]}
    err = error(api.post("/v1/chat/completions", json=big), 413)
    assert "20000" in err["message"] or "20,000" in err["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 4000
    r = api.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    error(r, 413)
    assert chat(api, max_tokens=2).status_code == 200


def test_the_context_is_checked_cheaply_before_tokenizing(engine, monkeypatch):
    seen = []
    real = type(engine.tokenizer).__call__

    def spy(self, text, *a, **k):
        seen.append(len(text))
        return real(self, text, *a, **k)

    monkeypatch.setattr(type(engine.tokenizer), "__call__", spy)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="context"):
        engine.encode("hello " * 2_000_000)  # 12 MB
    with pytest.raises(ValueError, match="context"):
        engine.encode(messages=[{"role": "user", "content": "hello " * 2_000_000}])
    assert time.perf_counter() - t0 < 5
    assert not seen or max(seen) < 1_000_000, seen  # never the whole 12 MB


def test_context_overflow_has_openais_code(api):
    r = api.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x " * 3000}]})
    err = error(r, 400, "messages")
    assert err["code"] == "context_length_exceeded"
    err = error(api.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 3000}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}),
    ("logit_bias", {"5": 10}),
    ("stream_options", {"include_usage": True}),  # without stream
    ("functions", [{"name": "f"}]),
])
def test_fields_that_change_behaviour_are_refused_not_ignored(api, field, value):
    err = error(chat(api, max_tokens=2, **{field: value}), 400, field)
    assert field in err["message"]


def test_harmless_forms_of_those_fields_are_accepted(api):
    for extra in ({"response_format": {"type": "text"}}, {"tools": []}, {"tool_choice": "none"}, {"logit_bias": {}},
                  {"stream": True, "stream_options": {"include_usage": True}}):
        assert chat(api, max_tokens=2, **extra).status_code == 200, extra
    r = api.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {"3": 5}})
    error(r, 400, "logit_bias")


@pytest.mark.parametrize("role", ["wizard", "tool", "function", ""])
def test_unknown_roles_are_refused(api, role):
    msgs = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
    err = error(api.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs}), 400, "messages[1].role")
    assert "role" in err["message"]


def test_known_roles_are_accepted(api):
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    assert api.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 2}).status_code == 200


def test_max_tokens_has_a_server_default_and_cap(api):
    r = chat(api, ignore_eos=True)
    assert r.json()["usage"]["completion_tokens"] == 5  # the server's default, not the context
    assert chat(api, ignore_eos=True, max_tokens=40).json()["usage"]["completion_tokens"] == 40
    err = error(chat(api, max_tokens=41), 400, "max_tokens")
    assert "40" in err["message"]
    error(chat(api, max_completion_tokens=41), 400, "max_completion_tokens")
    r = api.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 5  # OpenAI's 16 for completions, capped by the default


@pytest.mark.parametrize("seed", [2**64, -1, 2**63])
def test_an_out_of_range_seed_is_a_400(api, seed):
    assert "seed" in error(chat(api, max_tokens=2, seed=seed), 400, "seed")["message"]


def test_cors_is_off_unless_asked(engine):
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    with app_client(engine) as c:
        assert "access-control-allow-origin" not in c.get("/v1/models", headers={"Origin": "https://app.example"}).headers
    with app_client(engine, api_key="sesame", allow_origins=["https://app.example"]) as c:
        r = c.options("/v1/chat/completions", headers=pre)  # a preflight carries no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.get("/v1/models", headers={"Origin": "https://app.example", "Authorization": "Bearer sesame"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert c.get("/v1/models", headers={"Origin": "https://app.example"}).status_code == 401
        r = c.options("/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"})
        assert r.headers.get("access-control-allow-origin") != "https://evil.example"


# ---- shutdown ------------------------------------------------------------------------------------------

def test_shutdown_mid_stream_ends_with_an_error_event_and_done(engine):
    app = create_app(engine, MODEL)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as h, h.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's own SIGTERM handler calls
        rest = [line for line in lines if line]
    thread.join(20)
    events = [first] + rest
    assert events[-1] == "data: [DONE]", events[-3:]
    last = json.loads(events[-2][6:])
    assert "shutting down" in last["error"]["message"] and last["error"]["type"] == "server_error"


@pytest.mark.parametrize("flags,words", [
    (["--max-body-bytes", "0"], "--max-body-bytes must be an integer >= 1"),
    (["--default-max-tokens", "64", "--max-tokens-cap", "32"], "--default-max-tokens 64 exceeds --max-tokens-cap 32"),
])
def test_bad_limit_flags_are_one_line_before_the_model_loads(flags, words, capsys, monkeypatch):
    from eaglespec import serve
    from eaglespec.cli import main

    def no_loading(_args):
        raise AssertionError("the model was loaded before the flags were checked")
    monkeypatch.setattr(serve, "build_engine", no_loading)
    assert main(["serve", "--model", "unused", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
