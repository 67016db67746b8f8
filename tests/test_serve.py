"""`eaglespec serve`: a real uvicorn server on 127.0.0.1 over a tiny random model, driven by the
official `openai` client and raw HTTP."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from eaglespec.engine import Engine
from eaglespec.loading import DEFAULT_MODEL
from eaglespec.serve import create_app, replicate, served_model_name
from eaglespec.testing import make_tiny_checkpoint
from eaglespec.tree import TreeConfig

MODEL = "tiny"
SMALL_TREE = TreeConfig("dynamic", top_k=2, depth=2, total_tokens=4)  # keeps random-head rounds cheap
LONG = 1900  # tokens: a generation that takes seconds, to hold a slot


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("serve") / MODEL, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def ref(folder):
    """An independent engine for the expected outputs: plain greedy decoding."""
    return Engine.load(str(folder), head="random", device="cpu")


def _load(folder):
    return Engine.load(str(folder), head="random", device="cpu", tree=SMALL_TREE)


@contextmanager
def serving(engines, **kw):
    app = create_app(engines, MODEL, **kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def server(folder):
    """Two replicas (shared weights), EAGLE by default."""
    with serving(replicate(_load(folder), 2), max_queue=32, warmup=True) as (url, app):
        yield url


@pytest.fixture(scope="module")
def single(folder):
    """One replica and no queue: a second request while one runs gets 429."""
    engine = _load(folder)
    with serving(engine, max_queue=0, method="vanilla") as (url, app):
        yield url, engine


def client(url, key="unused"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat(i):
    return [{"role": "user", "content": f"Question {i}: what is {i} times 7?"}]


def expected_chat(ref, messages, n):
    return ref.generate(messages=messages, method="vanilla", max_new_tokens=n, temperature=0.0)


def metric(url, name) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or
               line.startswith(name + "{"))


# ---- happy paths -------------------------------------------------------------------------------------

def test_models_and_health(server):
    assert [m.id for m in client(server).models.list().data] == [MODEL]
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_chat_equals_greedy_and_stream_equals_non_stream(server, ref):
    c, msgs = client(server), chat(1)
    want = expected_chat(ref, msgs, 16)
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_tokens, want.new_tokens)
    extra = r.model_extra["eaglespec"]
    assert extra["method"] == "eagle" and sum(extra["accept_lengths"]) == want.new_tokens - 1
    assert extra["target_forwards"] == len(extra["accept_lengths"]) and extra["tau"] >= 1

    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == want.finish_reason
    assert chunks[-1].usage.completion_tokens == want.new_tokens


def test_completions_equal_greedy_with_stop(server, ref):
    c, prompt = client(server), "Once upon a time"
    want = ref.generate(prompt, method="vanilla", max_new_tokens=20, temperature=0.0)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason == "length"
    streamed = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert all(ch.object == "text_completion" for ch in streamed)
    assert "".join(ch.choices[0].text for ch in streamed) == want.text
    assert streamed[-1].choices[0].finish_reason == "length"

    stop = want.text[len(want.text) // 2:][:2]
    want_stop = ref.generate(prompt, method="vanilla", max_new_tokens=20, temperature=0.0, stop=stop)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == want_stop.text and r.choices[0].finish_reason == "stop"
    # the vanilla override and token-id prompts are accepted too
    ids = ref.encode(prompt)
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 20,
                                                      "temperature": 0, "method": "vanilla"}).json()
    assert r["choices"][0]["text"] == want.text and r["eaglespec"]["method"] == "vanilla"


def test_raw_sse_format(server):
    lines = []
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": chat(2), "max_tokens": 6, "stream": True, "seed": 1}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len({e["id"] for e in events}) == 1
    assert events[-1]["choices"][0]["finish_reason"] == "length" and "tau" in events[-1]["eaglespec"]


def test_sixteen_concurrent_clients_get_their_own_answers(server, ref):
    n = 16
    want = [expected_chat(ref, chat(100 + i), 10).text for i in range(n)]
    assert len(set(want)) > 1  # distinct prompts give distinct answers, so a crossed answer would show

    def ask(i):
        c = client(server)
        if i % 2:
            stream = c.chat.completions.create(model=MODEL, messages=chat(100 + i), max_tokens=10, temperature=0,
                                               stream=True)
            return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        return c.chat.completions.create(model=MODEL, messages=chat(100 + i), max_tokens=10,
                                         temperature=0).choices[0].message.content

    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(ask, range(n)))
    assert got == want
    assert metric(server, "eaglespec_active_generations") == 0


def test_sampling_is_reproducible_with_a_seed(server):
    kw = dict(model=MODEL, messages=chat(3), max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    a, b = (client(server).chat.completions.create(**kw).choices[0].message.content for _ in range(2))
    assert a == b


def test_metrics(server):
    text = httpx.get(server + "/metrics").text
    for name in ("eaglespec_requests_total", "eaglespec_generation_tokens_total", "eaglespec_prompt_tokens_total",
                 "eaglespec_tau_sum", "eaglespec_tau_count", "eaglespec_tokens_per_second",
                 "eaglespec_queue_length", "eaglespec_active_generations"):
        assert name in text, name
    assert 'eaglespec_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert metric(server, "eaglespec_generation_tokens_total") > 0


# ---- errors ------------------------------------------------------------------------------------------

BAD = [  # (path, body, status, words the message must contain)
    ("/v1/chat/completions", b"{not json", 400, "malformed JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"messages": chat(0)}, 400, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat(0), "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat(0), "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat(0), "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": chat(0)}, 404, "gpt-4"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat(0), "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat(0), "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat(0), "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat(0), "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat(0), "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat(0), "n": 2}, 400, "n must be 1"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat(0), "stop": ""}, 400, "stop"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * 3000}]}, 400, "context"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 3000, "stream": True}, 400, "context"),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 3000}, 400, "context"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
]


@pytest.mark.parametrize("path,body,status,words", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, path, body, status, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert words.lower() in err["message"].lower(), err["message"]
    assert httpx.get(server + "/health").status_code == 200


def test_openai_client_sees_typed_errors(server):
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="nope", messages=chat(0))
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client(server).chat.completions.create(model=MODEL, messages=chat(0), temperature=-1)
    r = httpx.post(server + "/v1/chat/completions", timeout=60,  # unknown fields are ignored
                   json={"model": MODEL, "messages": chat(0), "max_tokens": 2, "frobnicate": {"x": 1}, "user": "u"})
    assert r.status_code == 200
    r = httpx.get(server + "/no/such/route")
    assert r.status_code == 404 and "message" in r.json()["error"]


def test_engine_crash_is_a_500_and_does_not_hurt_the_next_request(single):
    url, engine = single

    def broken(**kw):
        raise RuntimeError("boom")
        yield

    def breaks_midway(**kw):
        for i, chunk in enumerate(Engine.stream(engine, **kw)):
            if i == 2:
                raise RuntimeError("midway")
            yield chunk

    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0}
    want = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    engine.stream = broken
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "boom" in r.text
        engine.stream = breaks_midway
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        assert "midway" in json.loads(lines[-2][6:])["error"]["message"] and lines[-1] == "data: [DONE]"
    finally:
        del engine.stream
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


# ---- the queue and disconnects -------------------------------------------------------------------------

@contextmanager
def long_stream(url):
    """A streamed generation of ~LONG tokens, open and holding the only slot once we yield."""
    body = {"model": MODEL, "prompt": "Once", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as h, h.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        yield


def wait_until_free(url, timeout=30):
    deadline = time.time() + timeout
    while metric(url, "eaglespec_active_generations") and time.time() < deadline:
        time.sleep(0.05)
    return time.time() < deadline


def test_queue_overflow_is_429_with_retry_after(single):
    url, _ = single
    with long_stream(url):
        t0 = time.time()
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and time.time() - t0 < 5
        with pytest.raises(openai.RateLimitError):
            client(url).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert wait_until_free(url)


def test_disconnect_mid_stream_stops_the_generation_and_frees_the_slot(single):
    url, _ = single
    cancelled, tokens = metric(url, "eaglespec_generations_cancelled_total"), metric(url, "eaglespec_generation_tokens_total")
    t0 = time.time()
    with long_stream(url):
        pass  # leaving closes the connection after the first chunk
    assert wait_until_free(url, timeout=10), "the generation kept its slot after the client left"
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and time.time() - t0 < 15
    assert metric(url, "eaglespec_generations_cancelled_total") == cancelled + 1
    assert metric(url, "eaglespec_generation_tokens_total") - tokens < LONG / 2


def test_disconnect_while_waiting_for_a_non_streamed_answer_stops_it(single):
    url, _ = single
    cancelled = metric(url, "eaglespec_generations_cancelled_total")
    body = {"model": MODEL, "prompt": "Once", "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    assert wait_until_free(url, timeout=10)
    assert metric(url, "eaglespec_generations_cancelled_total") == cancelled + 1


def test_a_client_that_leaves_the_queue_is_dropped(server):
    with long_stream(server), long_stream(server):  # both replicas busy
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       timeout=httpx.Timeout(60, read=0.3))
        deadline = time.time() + 5
        while metric(server, "eaglespec_queue_length") and time.time() < deadline:
            time.sleep(0.05)
        assert metric(server, "eaglespec_queue_length") == 0
        assert metric(server, "eaglespec_active_generations") == 2
    assert wait_until_free(server)


def test_served_model_name(folder):
    assert served_model_name(None) == DEFAULT_MODEL == "smollm2-135m-instruct"
    assert served_model_name(str(folder)) == MODEL
    assert served_model_name("org/some-model") == "org/some-model"


# ---- the CLI, with an API key --------------------------------------------------------------------------

def test_cli_serves_with_api_key(folder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "eaglespec.cli", "serve", "--model", str(folder), "--head", "random",
           "--device", "cpu", "--tree", "chain", "--depth", "2", "--port", str(port), "--api-key", "sesame",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "EAGLESPEC_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(url, key="wrong").models.list()
        good = client(url, key="sesame")
        assert [m.id for m in good.models.list().data] == [Path(folder).name]
        r = good.chat.completions.create(model=MODEL, messages=chat(0), max_tokens=4)
        assert r.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(15)


def test_replicas_keep_the_first_engines_settings(make_oracle_pair):
    """Each replica decodes as the engine it copies: the drafts' kind, the fused catch-up, the online costs."""
    from eaglespec.engine import Engine
    model, head = make_oracle_pair()
    engine = Engine(model, head=head)
    engine.draft_sampling, engine.fuse_catchup, engine.online_costs = False, False, True
    for e in replicate(engine, 2)[1:]:
        assert (e.draft_sampling, e.fuse_catchup, e.online_costs) == (False, False, True)
