"""OpenAI-compatible request/response shapes for `eaglespec serve`.

Pydantic checks the types; `sampling_kwargs` checks the values and turns a request into the
engine's keyword arguments. Every rejection is an `ApiError`, rendered in OpenAI's error shape.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr


class ApiError(Exception):
    """An error the client caused (4xx) or the server hit (5xx), in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    # A message may echo what the client sent; a lone surrogate in it cannot be encoded as UTF-8 and
    # would turn this error into a 500, so such characters are written as escapes.
    return {"error": {"message": _printable(message), "type": type, "param": _printable(param), "code": code}}


def _printable(text: str | None) -> str | None:
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


# ---- requests: what is refused before a generation starts ----------------------------------------

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TEMPERATURE = 2.0                # OpenAI's range is [0, 2]
GREEDY_BELOW = 1e-5                  # temperatures below decode greedily (as vLLM); 1e-40 would overflow
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, param: str) -> None:
    found = _SURROGATE.search(text)
    if found:
        raise ApiError(400, f"{param}: holds a lone surrogate (U+{ord(found.group()):04X}), which is not valid Unicode",
                       param=param)


def check_request_text(req: "_Request") -> None:
    """Refuse lone surrogates anywhere in the request (JSON may escape them; no text can hold them)."""
    def walk(value, path: str):
        if isinstance(value, str):
            check_unicode(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k, path)
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
    walk(req.model_dump(exclude_none=True), "")


# ---- requests ------------------------------------------------------------------------------------

class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we have no use for


class TextPart(_Request):
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Request):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None


class StreamOptions(_Request):
    include_usage: StrictBool | None = False


class _Sampling(_Request):
    model: StrictStr
    logit_bias: Any = None           # refused unless empty: we would silently ignore it
    response_format: Any = None      # refused unless {"type": "text"}
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = 1
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    # extensions (vLLM spells the first two the same way)
    top_k: StrictInt | None = None
    ignore_eos: StrictBool | None = False
    method: Literal["eagle", "vanilla"] | None = Field(None, description="override the server's --method")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    # tool calling is not implemented: refused (unless empty / "none") rather than ignored
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    max_completion_tokens: StrictInt | None = None  # newer OpenAI name for max_tokens
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


def _unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what} is not supported by this server", param=param)


def _refuse_behaviour_fields(req: _Sampling) -> None:
    """Fields that would change the output if we honoured them are refused, not silently ignored."""
    if req.logit_bias:
        raise _unsupported("logit_bias", "logit_bias")
    if req.response_format is not None and not (isinstance(req.response_format, dict)
                                                and req.response_format.get("type") == "text"):
        raise _unsupported("response_format", "a response_format other than {\"type\": \"text\"}")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")
    for name in ("tools", "functions"):
        if getattr(req, name, None):
            raise _unsupported(name, "tool calling")
    for name in ("tool_choice", "function_call"):
        if getattr(req, name, None) not in (None, "none"):
            raise _unsupported(name, "tool calling")


def sampling_kwargs(req: _Sampling, max_tokens: int | None, default_max_tokens: int | None,
                    max_tokens_cap: int | None = None, max_tokens_param: str = "max_tokens") -> dict:
    """Validate the shared sampling fields; return engine.stream keyword arguments."""
    if req.n not in (None, 1):
        raise ApiError(400, f"n must be 1: this server generates one choice per request (got {req.n})", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise _unsupported(name, "a non-zero penalty")
    _refuse_behaviour_fields(req)
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif max_tokens <= 0:
        raise ApiError(400, f"{max_tokens_param} must be at least 1, got {max_tokens}", param=max_tokens_param)
    elif max_tokens_cap is not None and max_tokens > max_tokens_cap:
        raise ApiError(400, f"{max_tokens_param} is {max_tokens}; this server allows at most {max_tokens_cap}",
                       param=max_tokens_param)
    temperature = 1.0 if req.temperature is None else req.temperature  # OpenAI's default
    if not 0 <= temperature <= MAX_TEMPERATURE:  # also rejects NaN
        raise ApiError(400, f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}", param="temperature")
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = req.top_k or 0
    if top_k < 0:
        raise ApiError(400, f"top_k must be >= 0, got {top_k}", param="top_k")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise ApiError(400, f"seed must be in [0, 2**63), got {req.seed}", param="seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise ApiError(400, "stop strings must be non-empty", param="stop")
    if len(stop) > 4:
        raise ApiError(400, f"stop takes at most 4 strings, got {len(stop)}", param="stop")
    kw = dict(temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=req.seed,
              stop=stop or None, ignore_eos=bool(req.ignore_eos))
    if max_tokens is not None:
        kw["max_new_tokens"] = max_tokens
    return kw


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    if req.logprobs or req.top_logprobs:
        raise _unsupported("logprobs", "logprobs")
    if not req.messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role: '{m.role}' is not supported; use one of "
                                + ", ".join(CHAT_ROLES), param=f"messages[{i}].role")
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            content = "".join(p.text for p in content)
        out.append({"role": CHAT_ROLES[m.role], "content": content or ""})  # developer: OpenAI's newer system
    return out


def completion_prompt(req: CompletionRequest) -> dict:
    """The engine's prompt argument: {"prompt": str} or {"input_ids": [...]}."""
    if req.logprobs is not None:
        raise _unsupported("logprobs", "logprobs")
    if req.echo:
        raise _unsupported("echo", "echo")
    if req.best_of not in (None, 1):
        raise _unsupported("best_of", "best_of > 1")
    if req.suffix:
        raise _unsupported("suffix", "suffix")
    p = req.prompt
    if isinstance(p, str):
        return {"prompt": p}
    if not p:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if isinstance(p[0], str):
        if len(p) != 1:
            raise ApiError(400, "prompt: batched prompts are not supported; send one string", param="prompt")
        return {"prompt": p[0]}
    return {"input_ids": list(p)}


# ---- responses -----------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def stats(result) -> dict:
    """The `eaglespec` field every finished response carries."""
    return {"method": result.method, "tau": round(result.tau, 4), "target_forwards": result.target_forwards,
            "accept_lengths": result.accept_lengths, "tokens_per_s": round(result.tokens_per_s, 2),
            "time_s": round(result.time_s, 4), "time_prefill_s": round(result.time_prefill_s, 4)}


def chat_response(rid: str, model: str, result) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text, "refusal": None},
                         "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": usage(result.prompt_tokens, result.new_tokens), "eaglespec": stats(result)}


def completion_response(rid: str, model: str, result) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": usage(result.prompt_tokens, result.new_tokens), "eaglespec": stats(result)}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def models_response(name: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "eaglespec"}]}
