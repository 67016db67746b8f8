"""`eaglespec serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both with `stream`),
GET /health, GET /metrics (Prometheus text).

Concurrency model. The engine decodes one sequence at a time and keeps its KV cache inside the
model, so it is not thread-safe. The server holds a pool of --max-concurrency engine *replicas*
that share every weight tensor but own their KV caches and tokenizer (`replicate`), and one worker
thread per replica. A request waits in a FIFO for a free replica (at most --max-queue waiting,
429 beyond that), then its whole generation runs on that replica in a worker thread; the thread
hands chunks to the event loop through an asyncio queue. The replica goes back to the pool only
when its thread is done with it, so a slot is never shared, whatever the client does. A client
that goes away is noticed (stream: Starlette cancels the response; otherwise: polling
`request.is_disconnected()`), its generation stops after the current decoding round, and the
generator is closed in its own thread. Default 1 replica: a second replica adds only KV-cache
memory, but replicas share the compute (CPU cores / one GPU) and the GIL, and nothing is batched,
so N > 1 buys fairness (a short request need not wait for a long one), not throughput: on an H200
with a small model, 2 replicas gave the same aggregate tokens/s as 1.
"""

import asyncio
import copy
import hmac
import ipaddress
import json
import logging
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .cli import add_engine_args, build_engine
from .model import share_weights

if TYPE_CHECKING:
    from .engine import Engine

# torch, pydantic and FastAPI are imported where used: `eaglespec --help` loads every subcommand module.

log = logging.getLogger("eaglespec.serve")
ENDPOINTS = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/health", "/metrics")
POLL_S = 0.25                        # how often a waiting request checks that its client is still there


def add_cli(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, streaming, metrics)")
    add_engine_args(p)
    p.add_argument("--method", default="eagle", choices=["eagle", "vanilla"],
                   help="decoding method (a request may override it with the extra field 'method')")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("EAGLESPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $EAGLESPEC_API_KEY; /health stays open)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's name)")
    p.add_argument("--max-concurrency", type=int, default=1,
                   help="generations at once = engine replicas sharing the weights (default 1)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a replica; more get 429")
    lim = p.add_argument_group("request limits")
    lim.add_argument("--max-body-bytes", type=int, default=ServeLimits.max_body_bytes,
                     help="larger request bodies get 413 before they are parsed")
    lim.add_argument("--default-max-tokens", type=int, default=ServeLimits.default_max_tokens,
                     help="tokens generated for a request without max_tokens (/v1/completions: at most 16, "
                          "OpenAI's default)")
    lim.add_argument("--max-tokens-cap", type=int, default=None,
                     help="refuse a larger max_tokens with 400 (default: no cap but the context)")
    p.add_argument("--allow-origin", action="append", default=None, metavar="ORIGIN",
                   help="let browser pages from ORIGIN call the API (CORS; repeatable; '*' for any; default: none)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def served_model_name(model: str | None) -> str:
    from .loading import DEFAULT_MODEL
    if model in (None, "", DEFAULT_MODEL):
        return DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.exists():
        return path.stem if path.suffix == ".gguf" else path.resolve().name
    return model  # a hub id


def run(args) -> int:
    import uvicorn
    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    log.addHandler(handler)
    log.setLevel(args.log_level.upper())
    log.propagate = False
    limits = ServeLimits(args.max_body_bytes, args.default_max_tokens, args.max_tokens_cap)  # checked before loading
    engine = build_engine(args)
    name = args.served_model_name or served_model_name(args.model)
    app = create_app(replicate(engine, args.max_concurrency), name, method=args.method, api_key=args.api_key,
                     max_queue=args.max_queue, warmup=True, limits=limits, allow_origins=args.allow_origin)
    if not _is_loopback(args.host) and not args.api_key:
        print(f"eaglespec serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    print(f"eaglespec serve: '{name}' ({args.method}, head {engine.head_source}, {engine.device}) on "
          f"http://{args.host}:{args.port}/v1 - {args.max_concurrency} replica(s), queue {args.max_queue}"
          + (", API key required" if args.api_key else ""), file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# ---- engine replicas -----------------------------------------------------------------------------

def replicate(engine: "Engine", n: int) -> list["Engine"]:
    """`engine` plus n-1 engines over the same weights, each with its own KV caches and tokenizer
    (a Rust tokenizer must not be used from two threads at once)."""
    from .engine import Engine
    engines = [engine]
    for _ in range(n - 1):
        head = share_weights(engine.head) if engine.head is not None else None
        extra = {"compile": True} if getattr(engine, "compiled", False) else {}
        e = Engine(share_weights(engine.model), copy.deepcopy(engine.tokenizer), head, engine.tree,
                   engine.max_context, **extra)
        e.head_source = getattr(engine, "head_source", None)
        for setting in ("draft_sampling", "fuse_catchup", "online_costs"):  # what the CLI or caller set on the first
            if hasattr(engine, setting):
                setattr(e, setting, getattr(engine, setting))
        engines.append(e)
    return engines


# ---- metrics -------------------------------------------------------------------------------------

class Metrics:
    """Counters updated from the event loop and the worker threads; rendered as Prometheus text."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.generated_tokens = self.target_forwards = self.cancelled = 0
        self.finished: dict[tuple[str, str], int] = {}
        self.tau_sum: dict[str, float] = {}
        self.tau_count: dict[str, int] = {}
        self.generation_s = 0.0
        self.last_tokens_per_s = 0.0
        self.mean_generation_s = 1.0  # running mean, for Retry-After

    def count_request(self, endpoint: str, status: int):
        with self.lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def add(self, prompt_tokens: int = 0, generated_tokens: int = 0):
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += generated_tokens

    def finish(self, r):
        with self.lock:
            key = (r.method, r.finish_reason)
            self.finished[key] = self.finished.get(key, 0) + 1
            self.tau_sum[r.method] = self.tau_sum.get(r.method, 0.0) + r.tau
            self.tau_count[r.method] = self.tau_count.get(r.method, 0) + 1
            self.target_forwards += r.target_forwards
            self.generation_s += r.time_s
            self.last_tokens_per_s = r.tokens_per_s
            self.mean_generation_s = 0.8 * self.mean_generation_s + 0.2 * r.time_s

    def cancel(self):
        with self.lock:
            self.cancelled += 1

    def render(self, queue_length: int, active: int, replicas: int) -> str:
        out: list[str] = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP eaglespec_{name} {help_}")
            out.append(f"# TYPE eaglespec_{name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
                out.append(f"eaglespec_{name}{'{' + lab + '}' if lab else ''} {value}")

        with self.lock:
            metric("requests_total", "counter", "HTTP requests by endpoint and status code.",
                   [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
            metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [({}, self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Tokens generated (cancelled generations included).",
                   [({}, self.generated_tokens)])
            metric("target_forwards_total", "counter", "Decoding forwards of the target (prefill excluded).",
                   [({}, self.target_forwards)])
            metric("generations_total", "counter", "Finished generations by method and finish reason.",
                   [({"method": m, "finish_reason": f}, n) for (m, f), n in sorted(self.finished.items())])
            metric("generations_cancelled_total", "counter", "Generations stopped because the client went away.",
                   [({}, self.cancelled)])
            out.append("# HELP eaglespec_tau Tokens per target forward of each finished generation.")
            out.append("# TYPE eaglespec_tau summary")
            for m in sorted(self.tau_sum):
                out.append(f'eaglespec_tau_sum{{method="{m}"}} {self.tau_sum[m]:.6g}')
                out.append(f'eaglespec_tau_count{{method="{m}"}} {self.tau_count[m]}')
            metric("generation_seconds_total", "counter", "Time spent generating, prefill included.",
                   [({}, f"{self.generation_s:.6g}")])
            metric("tokens_per_second", "gauge", "Decoding speed of the last finished generation.",
                   [({}, f"{self.last_tokens_per_s:.6g}")])
        metric("queue_length", "gauge", "Requests waiting for a replica.", [({}, queue_length)])
        metric("active_generations", "gauge", "Generations running now.", [({}, active)])
        metric("replicas", "gauge", "Engine replicas (--max-concurrency).", [({}, replicas)])
        return "\n".join(out) + "\n"


# ---- the pool and one generation -------------------------------------------------------------------

_END = object()  # a worker's last event


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class Generation:
    """One request's run on one replica: the worker thread pushes events (StreamChunk, an exception,
    then _END) onto an asyncio queue; the handler sets `cancel` to stop it after the current round.
    Unless `stream`, only the last chunk is handed over, so the handler's wait for it is one await
    that can poll for a vanished client."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: Metrics, stream: bool):
        self.loop, self.metrics, self.stream = loop, metrics, stream
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()

    def run(self, engine: "Engine", kw: dict):  # in the worker thread
        from .api_schema import ApiError
        from .engine import ContextLengthError
        try:
            kw = dict(kw)
            prompt = {k: kw.pop(k) for k in ("prompt", "messages", "input_ids") if k in kw}
            try:
                ids = engine.encode(**prompt)
            except ContextLengthError as e:  # OpenAI's code for it, naming the field that is too long
                raise ApiError(400, str(e), param="messages" if "messages" in prompt else "prompt",
                               code="context_length_exceeded") from None
            self.metrics.add(prompt_tokens=len(ids))
            stream = engine.stream(input_ids=ids, **kw)
            last = None
            try:
                for chunk in stream:
                    self.metrics.add(generated_tokens=len(chunk.token_ids))
                    if chunk.result is not None:
                        self.metrics.finish(chunk.result)
                        last = chunk
                    elif self.stream:
                        self._emit(chunk)
                    if self.cancel.is_set() and chunk.result is None:
                        self.metrics.cancel()
                        break
            finally:
                stream.close()  # in this thread, which owns the engine
            # The result goes out once the stream has let go of the engine: whoever gets the answer may use the
            # engine at once (a caller sharing it with the server saw "already generating" now and then)
            if last is not None:
                self._emit(last)
        except Exception as e:  # handed to the request's handler, which answers in OpenAI's shape
            self._emit(e)
        finally:
            self._emit(_END)

    def _emit(self, item):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is gone, stop generating
            self.cancel.set()


class EnginePool:
    def __init__(self, engines: list["Engine"], max_queue: int, metrics: Metrics):
        self.engines, self.max_queue, self.metrics = engines, max_queue, metrics
        self.executor = ThreadPoolExecutor(len(engines), thread_name_prefix="eaglespec-engine")
        self.free: asyncio.Queue | None = None
        self.waiting = self.active = 0
        self.running: set[Generation] = set()

    def start(self):  # on the server's event loop
        self.free = asyncio.Queue()
        for e in self.engines:
            self.free.put_nowait(e)

    async def warm_up(self):
        """One short generation per method on every replica, all at once, so each worker thread exists and
        has done its first-use set-up (on CUDA that cost seconds per thread) before a client waits on it."""
        loop = asyncio.get_running_loop()

        def job(engine):
            ids = engine.encode("Hello") if engine.tokenizer is not None else [0]
            for m in ("vanilla", "eagle") if engine.head is not None else ("vanilla",):
                engine.generate(input_ids=ids, method=m, max_new_tokens=4, ignore_eos=True)
        t0 = time.perf_counter()
        await asyncio.gather(*[loop.run_in_executor(self.executor, job, e) for e in self.engines])
        log.info("warmed up %d replica(s) in %.1f s", len(self.engines), time.perf_counter() - t0)

    def stop(self):
        for g in list(self.running):
            g.cancel.set()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def acquire(self) -> "Engine":
        if self.free.empty() and self.waiting >= self.max_queue:
            from .api_schema import ApiError
            retry = max(1, min(60, math.ceil(self.metrics.mean_generation_s * (self.waiting + 1) / len(self.engines))))
            raise ApiError(429, f"server busy: {self.active} generation(s) running, {self.waiting} waiting "
                                f"(--max-queue {self.max_queue}); retry later", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(retry)})
        self.waiting += 1
        try:
            engine = await self.free.get()
        finally:
            self.waiting -= 1
        self.active += 1
        return engine

    def release(self, engine: "Engine"):
        self.active -= 1
        self.free.put_nowait(engine)

    def submit(self, engine: "Engine", gen: Generation, kw: dict):
        """Run `gen` on `engine` in a worker thread; the engine returns to the pool when the thread is done."""
        self.running.add(gen)
        fut = asyncio.get_running_loop().run_in_executor(self.executor, gen.run, engine, kw)

        def done(_):
            self.running.discard(gen)
            self.release(engine)
        fut.add_done_callback(done)


async def _unless_gone(request, awaitable, on_abandon=None):
    """Await `awaitable`, but raise ClientGone if the client disconnects first. `on_abandon` gets the
    result if it arrives just as we give up (so an acquired replica is not lost)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    except BaseException:
        if not task.cancel() and not task.cancelled() and task.exception() is None and on_abandon:
            on_abandon(task.result())
        raise


def _as_api_error(e: Exception):
    from .api_schema import ApiError
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ValueError):  # the engine's one-line complaint about the input
        return ApiError(400, str(e))
    log.error("generation failed", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ---- the app -------------------------------------------------------------------------------------

@dataclass
class ServeLimits:
    """What one request may ask of the server (flags of `eaglespec serve`)."""
    max_body_bytes: int = 2 * 2**20          # larger bodies get 413 before they are parsed
    default_max_tokens: int | None = 1024    # requests without max_tokens (None: up to the context)
    max_tokens_cap: int | None = None        # a larger max_tokens gets 400 (None: no cap but the context)

    def __post_init__(self):
        for name in ("max_body_bytes", "default_max_tokens", "max_tokens_cap"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value}")
        if self.default_max_tokens and self.max_tokens_cap and self.default_max_tokens > self.max_tokens_cap:
            raise ValueError(f"--default-max-tokens {self.default_max_tokens} exceeds --max-tokens-cap "
                             f"{self.max_tokens_cap}")


class Gate:
    """ASGI middleware: the API key check, the body size limit, the request counter, and a clean end
    to responses cut by shutdown (a plain ASGI wrapper rather than BaseHTTPMiddleware, which would get
    in the way of streaming and disconnect detection)."""

    def __init__(self, app, api_key: str | None, metrics: Metrics, max_body_bytes: int | None = None):
        self.app, self.api_key, self.metrics, self.max_body_bytes = app, api_key, metrics, max_body_bytes

    def _authorized(self, scope) -> bool:
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                scheme, _, token = v.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())
        return False

    async def _refuse(self, scope, receive, send, status: int, message: str, type_: str, code=None, headers=None):
        from starlette.responses import JSONResponse

        from .api_schema import error_body
        await JSONResponse(error_body(message, type_, code=code), status, headers=headers)(scope, receive, send)

    async def _buffered_body(self, scope, receive, send):
        """The body read whole, at most `max_body_bytes` of it, before the app sees any: a 200 MB body
        is refused with 413 as it arrives instead of being parsed. Returns a `receive` that replays it
        (and then reports disconnects), or None once the 413 is sent."""
        limit = self.max_body_bytes
        too_big = (f"request body too large: this server accepts at most {limit:,} bytes (--max-body-bytes)")
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, 413, too_big, "invalid_request_error", "request_too_large")
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body: let the app see that
                first = message
                break
            size += len(message.get("body", b""))
            if size > limit:
                await self._refuse(scope, receive, send, 413, too_big, "invalid_request_error", "request_too_large")
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        pending = [first]

        async def replay():
            return pending.pop() if pending else await receive()
        return replay

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"].rstrip("/") or "/"
        state = {"status": 500, "started": False, "sse": False}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                state.update(status=message["status"], started=True, sse=any(
                    k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"]))
            await send(message)

        try:
            if self.api_key and path != "/health" and not self._authorized(scope):
                await self._refuse(scope, receive, send_counted, 401,
                                   "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                   "invalid_request_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return
            if self.max_body_bytes is not None:
                receive = await self._buffered_body(scope, receive, send_counted)
                if receive is None:
                    return
            await self.app(scope, receive, send_counted)
        except asyncio.CancelledError:
            # Only uvicorn cancels a whole request task: at shutdown, once the grace period is over.
            # The generation stops with it (the stream's `finally`); end the response so that a client
            # can tell it was cut: a stream gets an error event and [DONE], others a 503.
            log.warning("request %s cut short: the server is shutting down", path)
            await self._end_cut_short(scope, receive, send, send_counted, state)
        finally:
            endpoint = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"
            self.metrics.count_request(endpoint, state["status"])

    async def _end_cut_short(self, scope, receive, send, send_counted, state):
        from .api_schema import error_body
        message = "the server is shutting down"
        try:
            if not state["started"]:
                await self._refuse(scope, receive, send_counted, 503, message, "server_error")
            else:
                tail = (_sse(error_body(message + ": the generation was cut short", "server_error"))
                        + "data: [DONE]\n\n").encode() if state["sse"] else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})
        except Exception:  # the connection may be gone already
            pass


@dataclass
class _Server:
    """What the routes share."""
    pool: EnginePool
    metrics: Metrics
    model_name: str
    method: str
    limits: ServeLimits
    max_context: int
    created: int


def create_app(engines: "Engine | list[Engine]", model_name: str, method: str = "eagle", api_key: str | None = None,
               max_queue: int = 64, warmup: bool = False, limits: ServeLimits | None = None,
               allow_origins: list[str] | None = None):
    """The ASGI app over `engines` (one generation at a time on each; see `replicate`). With `warmup`,
    startup runs a short generation on every replica first. `allow_origins`: browser origins allowed by
    CORS (none by default)."""
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    if method not in ("eagle", "vanilla"):
        raise ValueError(f"method must be eagle or vanilla, got '{method}'")
    metrics = Metrics()
    srv = _Server(EnginePool(engines, max_queue, metrics), metrics, model_name, method, limits or ServeLimits(),
                  engines[0].max_context, int(time.time()))
    app = _fastapi_app(srv, warmup)
    _add_error_handlers(app)
    _add_info_routes(app, srv)
    _add_generation_routes(app, srv)
    return _wrap(app, srv, api_key, allow_origins)


def _fastapi_app(srv: _Server, warmup: bool):
    from fastapi import FastAPI

    @asynccontextmanager
    async def lifespan(_app):
        srv.pool.start()
        if warmup:
            await srv.pool.warm_up()
        yield
        srv.pool.stop()

    app = FastAPI(title="eaglespec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pool, app.state.metrics, app.state.model_name = srv.pool, srv.metrics, srv.model_name
    return app


def _add_error_handlers(app) -> None:
    """Every error in OpenAI's shape; nothing a client sends ends in a traceback."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException

    from .api_schema import ApiError, error_body

    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(ClientGone)
    async def _gone(_request, _e):
        return Response(status_code=499)  # nobody reads it; the status shows in /metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, e: RequestValidationError):
        return JSONResponse(error_body(*_validation_message(e.errors())), 400)

    @app.exception_handler(HTTPException)
    async def _http(_request, e: HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind), e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_request, e: Exception):
        log.error("request failed", exc_info=e)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), 500)


def _check_model(srv: _Server, name: str):
    from .api_schema import ApiError, check_unicode
    check_unicode(name, "model")
    if name != srv.model_name:
        raise ApiError(404, f"The model '{name}' does not exist; this server serves '{srv.model_name}'",
                       param="model", code="model_not_found")


def _add_info_routes(app, srv: _Server) -> None:
    from fastapi.responses import PlainTextResponse

    from .api_schema import models_response

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": srv.model_name, "active": srv.pool.active, "queued": srv.pool.waiting}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(srv.metrics.render(srv.pool.waiting, srv.pool.active, len(srv.pool.engines)),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return models_response(srv.model_name, srv.created)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(srv, model_id)
        return models_response(srv.model_name, srv.created)["data"][0]


async def _start(srv: _Server, request, kw: dict, stream: bool) -> Generation:
    engine = await _unless_gone(request, srv.pool.acquire(), on_abandon=srv.pool.release)
    gen = Generation(asyncio.get_running_loop(), srv.metrics, stream)
    srv.pool.submit(engine, gen, kw)
    return gen


async def _first_event(request, gen: Generation):
    from .api_schema import ApiError
    try:
        item = await _unless_gone(request, gen.events.get())
    except BaseException:
        gen.cancel.set()
        raise
    if isinstance(item, Exception):
        raise _as_api_error(item)
    if item is _END:
        raise ApiError(503, "generation cancelled: the server is shutting down", type="server_error")
    return item


async def _finish(request, gen: Generation):
    """The result of a non-streamed generation (its only event)."""
    try:
        return (await _first_event(request, gen)).result
    finally:
        gen.cancel.set()  # a no-op once finished; stops the worker if we leave early


def _streaming(gen: Generation, first, render):
    from fastapi.responses import StreamingResponse

    async def events():
        try:
            item = first
            while True:
                if isinstance(item, Exception):
                    yield _sse(_as_api_error(item).body())
                    break
                if item is _END:
                    break
                for obj in render(item):
                    yield _sse(obj)
                if item.result is not None:
                    break
                item = await gen.events.get()
            yield "data: [DONE]\n\n"
        finally:
            gen.cancel.set()  # also reached when Starlette cancels us because the client left
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _engine_kwargs(srv: _Server, req, max_tokens, max_tokens_param: str, default_max_tokens) -> dict:
    from .api_schema import check_request_text, sampling_kwargs
    check_request_text(req)  # before anything echoes a string back
    _check_model(srv, req.model)
    kw = sampling_kwargs(req, max_tokens, default_max_tokens, srv.limits.max_tokens_cap, max_tokens_param)
    kw["method"] = req.method or srv.method
    return kw


def _add_generation_routes(app, srv: _Server) -> None:
    from fastapi import Request

    from .api_schema import (COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest, chat_chunk,
                             chat_messages, chat_response, completion_chunk, completion_prompt, completion_response,
                             new_id, stats, usage)
    chat_default = srv.limits.default_max_tokens or srv.max_context
    completions_default = min(COMPLETIONS_DEFAULT_MAX_TOKENS, chat_default)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        newer = req.max_completion_tokens is not None
        kw = _engine_kwargs(srv, req, req.max_completion_tokens if newer else req.max_tokens,
                            "max_completion_tokens" if newer else "max_tokens", chat_default)
        kw["messages"] = chat_messages(req)
        gen = await _start(srv, request, kw, bool(req.stream))
        name = srv.model_name
        if not req.stream:
            return chat_response(new_id("chatcmpl"), name, await _finish(request, gen))
        first = await _first_event(request, gen)
        rid, t0 = new_id("chatcmpl"), int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        role_sent = False

        def render(chunk):
            nonlocal role_sent
            if not role_sent:
                role_sent = True
                yield chat_chunk(rid, name, t0, {"role": "assistant", "content": ""})
            if chunk.text:
                yield chat_chunk(rid, name, t0, {"content": chunk.text})
            if chunk.result is not None:
                yield {**chat_chunk(rid, name, t0, {}, chunk.result.finish_reason), "eaglespec": stats(chunk.result)}
                if include_usage:
                    yield {**chat_chunk(rid, name, t0, {}), "choices": [],
                           "usage": usage(chunk.result.prompt_tokens, chunk.result.new_tokens)}
        return _streaming(gen, first, render)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        kw = _engine_kwargs(srv, req, req.max_tokens, "max_tokens", completions_default)
        kw.update(completion_prompt(req))
        gen = await _start(srv, request, kw, bool(req.stream))
        name = srv.model_name
        if not req.stream:
            return completion_response(new_id("cmpl"), name, await _finish(request, gen))
        first = await _first_event(request, gen)
        rid, t0 = new_id("cmpl"), int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def render(chunk):
            if chunk.text:
                yield completion_chunk(rid, name, t0, chunk.text)
            if chunk.result is not None:
                yield {**completion_chunk(rid, name, t0, "", chunk.result.finish_reason),
                       "eaglespec": stats(chunk.result)}
                if include_usage:
                    yield {**completion_chunk(rid, name, t0, ""), "choices": [],
                           "usage": usage(chunk.result.prompt_tokens, chunk.result.new_tokens)}
        return _streaming(gen, first, render)


def _wrap(app, srv: _Server, api_key: str | None, allow_origins: list[str] | None):
    """The middleware around the routes: the gate (key, body limit, counting), then CORS outside it, so
    that a browser's preflight (which carries no key) is answered."""
    outer = Gate(app, api_key, srv.metrics, srv.limits.max_body_bytes)
    if allow_origins:
        from starlette.middleware.cors import CORSMiddleware
        outer = CORSMiddleware(outer, allow_origins=list(allow_origins), allow_methods=["GET", "POST", "OPTIONS"],
                               allow_headers=["Authorization", "Content-Type"], max_age=600)
    outer.state = app.state
    return outer


def _validation_message(errors) -> tuple[str, str, "str | None"]:
    """FastAPI's 422 details -> (message, type, param) for one OpenAI-shaped 400."""
    if not errors:
        return "invalid request", "invalid_request_error", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", "invalid_request_error", None
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if not loc:
        return f"the request body must be a JSON object: {first.get('msg')}", "invalid_request_error", None
    field = loc[0]
    if first.get("type") == "missing":
        return f"missing required field '{'.'.join(loc)}'", "invalid_request_error", field
    same_field = [e for e in errors if [str(x) for x in e.get("loc", ()) if x != "body"][:1] == [field]]
    if len(same_field) > 1:  # a union: every alternative complained
        return f"'{field}' has the wrong type", "invalid_request_error", field
    return f"'{'.'.join(loc)}': {first.get('msg')}", "invalid_request_error", field
