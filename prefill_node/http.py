"""The OpenAI-compatible HTTP API of the prefill node (FastAPI under uvicorn, in a thread).

A thin translation onto `GenerationService.generate`, the node's one generation path:
an OpenAI request becomes a GenerateRequest, the GenerateResponse stream becomes an OpenAI
response (or server-sent events), a `RequestFailed` becomes an OpenAI-shaped error. The
sync generator runs in a worker thread of this module's pool (never on the event loop);
responses reach the loop through a queue, one at a time as the client takes them (a client
that stops reading stops the relay: RELAY_CREDIT, SEND_BUFFER_BYTES), and a client that goes
away reaches the thread through the request's `HttpCall` (is_active() turns False, the
callbacks - the relayed decode call's cancel - run, and the generator is closed), so the
decode slot frees.

Endpoints: GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions, GET /health. docs/openai.md describes them.

Until the decode peer is compatible the node cannot generate: /v1/* requests wait for it (at
most `ApiConfig.ready_wait_s`, less when the client says it gives up sooner), then are served,
or answered 503 with Retry-After. No client input reaches a 500: bodies are checked (types,
ranges, strings UTF-8 can encode) before any work, and echoed values are clipped. Every HTTP
request, refused or served, is counted once in pdspec_http_requests_total{route,code}.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from models.tokenizer import ByteTokenizer
from prefill_node.service import GenerationService, RequestFailed
from protos import pdspec_pb2
from protos.constraint import KINDS

log = logging.getLogger(__name__)
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
HEADROOM_THREADS = 16  # requests turned away by admission still need a thread to be told so
# Responses a run hands the event loop before the client's stream has taken them: the relay reads
# the next decode message only once the one before left for the client (pull-based), so a client
# that stops reading stops the relay, and the decode node pauses its request (--pause-backlog).
RELAY_CREDIT = 1
# What the server buffers for a client connection beyond the client's own receive buffer: the
# event loop's write buffer and the socket's unsent bytes (TCP_NOTSENT_LOWAT; in flight stays
# bounded by the client's window). Linux grows a socket's send buffer to MiBs, a whole 4,096-token
# stream of server-sent events (~0.9 MB), for a client that reads nothing.
SEND_BUFFER_BYTES = 16 << 10
ECHO_CHARS = 64  # client values quoted in error messages are cut to this many characters
MAX_MESSAGES = 3  # validation errors spelled out in one response (then "and N more")
RETRY_AFTER_S = 1  # the Retry-After of a 503: the decode peer is re-checked about every second
# openai-python sends its read timeout; a held request is answered (503) this much before it
READY_MARGIN_S = 1.0
OPEN_PATHS = ("/health",)  # need no API key

# pdspec violation fields -> the OpenAI parameter (per endpoint where they differ)
_PARAMS = {
    "sampling.max_new_tokens": "max_tokens",
    "sampling.temperature": "temperature",
    "sampling.top_k": "top_k",
    "sampling.top_p": "top_p",
    "sampling.seed": "seed",
    "sampling.stop_token_ids": "stop_token_ids",
    "sampling.logprobs": "logprobs",
    "num_speculative_tokens": "num_speculative_tokens",
    "draft_candidates": "draft_candidates",
    "prompt": "prompt",
    "prompt_token_ids": "prompt",
    "request_id": None,
}
_CHAT_PARAMS = {"prompt": "messages", "prompt_token_ids": "messages", "sampling.logprobs": "top_logprobs"}
_STATUS = {"INVALID_ARGUMENT": 400, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


# ---------------------------------------------------------------------------- errors


class OpenAIError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.status == 503:
            headers["Retry-After"] = str(RETRY_AFTER_S)
        return _AsciiJSON(self.body(), status_code=self.status, headers=headers)


class _AsciiJSON(JSONResponse):
    """JSON with every non-ASCII character escaped: an error that quotes a string UTF-8 cannot
    encode (a lone surrogate) still renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def clip(value: object, limit: int = ECHO_CHARS) -> str:
    """A client's value as error messages quote it: at most `limit` characters (and how many
    there were), lone surrogates escaped."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def from_request_failed(err: RequestFailed, chat: bool, constraint_param: str | None = None) -> OpenAIError:
    """A GenerationService failure as the OpenAI error a client of this endpoint expects;
    `constraint_param` names the parameter the request's structured-output constraint came in
    (response_format or structured_outputs)."""
    status = _STATUS.get(err.code, 500)
    if err.violations:
        names = {**_PARAMS, **(_CHAT_PARAMS if chat else {})}
        names.update({f"structured_output.{kind}": constraint_param for kind in KINDS})
        parts = [(names.get(v.field, v.field), v) for v in err.violations]
        message = "; ".join(f"{param or v.field}: {v.description}" for param, v in parts)
        return OpenAIError(status, message, parts[0][0], "invalid_parameter")
    code = {429: "resource_exhausted", 503: "unavailable"}.get(status, err.code.lower())
    return OpenAIError(status, err.message, None, code)


_EXTENSION_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _extension(given: dict[str, Any], out: pdspec_pb2.StructuredOutput) -> pdspec_pb2.StructuredOutput:
    """`structured_outputs` (vLLM's names: json, regex, choice, grammar, json_object) into `out`:
    exactly one of them, of its type, else a 400 naming structured_outputs."""
    keys = [k for k, v in given.items() if v not in (None, False)]
    unknown = [k for k in keys if k not in (*_EXTENSION_KINDS, "json_object")]
    if unknown or len(keys) != 1:
        got = f"unsupported key(s) {clip(unknown)}" if unknown else f"{len(keys)} of them"
        message = f"structured_outputs: expected exactly one of json, regex, choice, grammar, json_object; got {got}"
        raise OpenAIError(400, message, "structured_outputs", "invalid_parameter")
    key = keys[0]
    value = given[key]
    if key == "json_object":
        out.json_object = True
    elif key == "json" and isinstance(value, dict | str):
        out.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif key == "choice" and isinstance(value, list) and all(isinstance(c, str) for c in value):
        out.choice.values.extend(value)
    elif key in ("regex", "grammar") and isinstance(value, str):
        setattr(out, key, value)
    else:
        expected = {"json": "a JSON Schema", "choice": "a list of strings"}.get(key, "a string")
        message = f"structured_outputs.{key}: expected {expected}, got {type(value).__name__}"
        raise OpenAIError(400, message, "structured_outputs", "invalid_parameter")
    return out


def _validation_error(err: RequestValidationError) -> OpenAIError:
    """pydantic's errors as one 400 naming the (first) parameter, not FastAPI's 422; a body
    that is not JSON names no parameter (its loc is the parser's offset)."""
    messages: dict[str, None] = {}
    first = None
    for error in err.errors():
        loc = list(error.get("loc", ()))
        if error.get("type") == "json_invalid":
            where = f" at byte {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
            reason = clip((error.get("ctx") or {}).get("error", "not JSON"))
            return OpenAIError(400, f"body: invalid JSON ({reason}{where})", None, "invalid_json")
        if loc and loc[0] == "body":
            loc = loc[1:]
        param = ""
        for i, part in enumerate(loc):  # the field, then list indices: messages[0]
            if isinstance(part, int):
                param += f"[{part}]"
            elif i == 0:
                param = clip(part)
            else:
                break
        first = first or param or None
        messages[f"{param or 'body'}: {clip(error.get('msg', 'invalid'), 200)}"] = None
    shown = list(messages)[:MAX_MESSAGES]
    if len(messages) > MAX_MESSAGES:
        shown.append(f"and {len(messages) - MAX_MESSAGES} more")
    return OpenAIError(400, "; ".join(shown) or "invalid request body", first, "invalid_parameter")


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(data: Any) -> str | None:
    """Where in a parsed JSON body (strings and keys, any depth) a string holds a lone UTF-16
    surrogate (valid JSON, "\\ud800", but not encodable as UTF-8): its path as a parameter
    (`messages[0].content`), "body" for the body itself, None when there is none."""
    stack: list[tuple[Any, tuple | None]] = [(data, None)]  # (value, (parent path, part))
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                return _path(path)
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                    return _path(path)
                stack.append((item, (path, key)))
        elif isinstance(value, list):
            stack.extend((item, (path, i)) for i, item in enumerate(value))
    return None


def _path(path: tuple | None) -> str:
    parts = []
    while path is not None:
        path, part = path
        parts.append(part)
    text = "body" if not parts or isinstance(parts[-1], int) else ""  # body[0]: a body that is a list
    for part in reversed(parts):
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return clip(text)


# ---------------------------------------------------------------------------- request bodies


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both endpoints share; unknown fields are ignored, like OpenAI's own SDK fields."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        """Text the tokenizer and protobuf can encode, anywhere in the body (ignored fields too):
        400 naming where, before any other check."""
        where = lone_surrogate(data)
        if where is not None:
            message = f"{where}: expected text UTF-8 can encode, got a lone UTF-16 surrogate"
            raise OpenAIError(400, message, where, "invalid_parameter")
        return data

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None  # extension; -1 or 0 = off
    seed: Annotated[int, Field(ge=0, le=UINT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = None  # extension (vLLM)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    num_speculative_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None  # pdspec extension
    draft_candidates: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None  # pdspec extension: multi-draft
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema (OpenAI)
    structured_outputs: dict[str, Any] | None = None  # extension (vLLM): json, regex, choice, grammar, json_object


class CompletionBody(_Sampling):
    prompt: str | list[Int32] | list[str] | list[list[Int32]]
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls...: passed on to the template

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    tools: list[Any] | None = None


# ---------------------------------------------------------------------------- the call


class HttpCall:
    """The `Call` of one HTTP request: active until the client goes away (or it ended)."""

    def __init__(self) -> None:
        self._active = True
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def is_active(self) -> bool:
        return self._active

    def time_remaining(self) -> float | None:
        return None  # HTTP clients send no deadline

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if not self._active:
                return False
            self._callbacks.append(callback)
            return True

    def cancel(self) -> None:
        with self._lock:
            if not self._active:
                return
            self._active = False
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("cancel callback failed")

    def end(self) -> None:
        """The generation ended by itself: nothing is left to cancel."""
        with self._lock:
            self._active = False
            self._callbacks = []


_END = object()


class _Run:
    """One GenerateRequest through `GenerationService.generate` in a worker thread, at the pace
    its client takes the responses (`RELAY_CREDIT`)."""

    def __init__(
        self, api: OpenAIApi, build: Callable[[], pdspec_pb2.GenerateRequest], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.call = HttpCall()
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = 0
        self._api = api
        self._room = threading.Condition()
        self._unread = 0  # responses handed to the loop and not yet taken
        api.runs.add(self)
        self.done = loop.run_in_executor(api.executor, self._drive, build)
        self.done.add_done_callback(lambda _: api.runs.discard(self))

    def _put(self, item) -> None:
        """Hand `item` to the loop once it took all but RELAY_CREDIT - 1 of those before; at once
        when the call ended (cancelled, or the generation is over and this is its end)."""
        with self._room:
            self._room.wait_for(lambda: self._unread < RELAY_CREDIT or not self.call.is_active())
            self._unread += 1
        with contextlib.suppress(RuntimeError):  # the loop has closed (shutdown): nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _drive(self, build: Callable[[], pdspec_pb2.GenerateRequest]) -> None:
        try:
            if not self.call.is_active():  # gone while it waited for a thread
                self._put(_END)
                return
            request = build()
            self.prompt_tokens = len(request.prompt_token_ids)
            responses = self._api.service.generate(request, self.call)
            try:
                for response in responses:
                    self._put(response)
                    if not self.call.is_active():
                        break  # close() below: the service counts it CANCELLED and cancels the decode call
                else:
                    self.call.end()
            finally:
                responses.close()
            self._put(_END)
        except BaseException as err:  # relayed to the event loop, which answers the client
            self._put(err)

    async def next(self) -> pdspec_pb2.GenerateResponse | None:
        item = await self.queue.get()
        with self._room:
            self._unread -= 1
            self._room.notify()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    async def collect(self) -> list[pdspec_pb2.GenerateResponse]:
        out = []
        while (item := await self.next()) is not None:
            out.append(item)
        return out

    def cancel(self) -> None:
        self.call.cancel()
        with self._room:
            self._room.notify()  # a relay waiting for its client to take a response: gone


class _ClientGone(Exception):
    pass


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(request: Request, run: _Run, awaitable):
    """`awaitable`'s result, or _ClientGone (and the run cancelled) when the client leaves first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the server is shutting down
        task.cancel()
        run.cancel()
        raise
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        run.cancel()
        raise _ClientGone
    return task.result()


# ---------------------------------------------------------------------------- rendering


def stats_json(stats: pdspec_pb2.RequestStats) -> dict:
    draft = stats.draft_tokens
    return {
        "verify_steps": stats.verify_steps,
        "draft_tokens": draft,
        "accepted_tokens": stats.accepted_tokens,
        "accepted_per_position": list(stats.accepted_per_position),
        "accepted_per_rank": list(stats.accepted_per_rank),
        "acceptance_rate": stats.accepted_tokens / draft if draft else None,
    }


class _TokenTexts:
    """Token strings and bytes for logprobs (bytes the tokenizer cannot make whole: "bytes:\\xNN")."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            if isinstance(self.tokenizer, ByteTokenizer):
                found = bytes([token_id]) if token_id < 256 else b""
            else:
                found = self.tokenizer.decode([token_id]).encode()
            if len(self._bytes) < 1 << 16:
                self._bytes[token_id] = found
        return found

    def text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class _Logprobs:
    """GenerateResponse.logprobs in the OpenAI shapes, `top` alternatives per token."""

    def __init__(self, texts: _TokenTexts, top: int) -> None:
        self.texts, self.top = texts, top
        self.offset = 0  # text_offset: the summed lengths of the token strings before (as vLLM)

    def completion(self, response: pdspec_pb2.GenerateResponse) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(response.token_ids, response.logprobs, strict=False):
            out["tokens"].append(self.texts.text(token_id))
            out["token_logprobs"].append(entry.logprob)
            pairs = zip(entry.top_token_ids[: self.top], entry.top_logprobs[: self.top], strict=False)
            out["top_logprobs"].append({self.texts.text(t): lp for t, lp in pairs})
            out["text_offset"].append(self.offset)
            self.offset += len(out["tokens"][-1])
        return out

    def chat(self, response: pdspec_pb2.GenerateResponse) -> list[dict]:
        def one(token_id: int, logprob: float) -> dict:
            return {"token": self.texts.text(token_id), "logprob": logprob, "bytes": list(self.texts.bytes(token_id))}

        out = []
        for token_id, entry in zip(response.token_ids, response.logprobs, strict=False):
            pairs = zip(entry.top_token_ids[: self.top], entry.top_logprobs[: self.top], strict=False)
            out.append({**one(token_id, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in pairs]})
        return out


@dataclass
class _Shape:
    """How one endpoint renders the responses of one request."""

    chat: bool
    id: str
    model: str
    created: int
    logprobs: _Logprobs | None
    include_usage: bool = False

    def head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def choice_logprobs(self, response: pdspec_pb2.GenerateResponse):
        if self.logprobs is None:
            return None
        return {"content": self.logprobs.chat(response)} if self.chat else self.logprobs.completion(response)

    def chunk(self, response: pdspec_pb2.GenerateResponse) -> dict:
        reason = FINISH_REASONS.get(response.finish_reason, "stop") if response.finished else None
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": response.text} if response.text or not response.finished else {}
        else:
            choice["text"] = response.text
        choice["logprobs"] = self.choice_logprobs(response)
        choice["finish_reason"] = reason
        out = {**self.head(True), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        if response.finished:
            out["pdspec"] = stats_json(response.stats)
        return out

    def role_chunk(self) -> dict:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return {**self.head(True), "choices": [choice], **({"usage": None} if self.include_usage else {})}

    def usage_chunk(self, usage: dict, stats: dict) -> dict:
        return {**self.head(True), "choices": [], "usage": usage, "pdspec": stats}

    def whole(self, responses: Sequence[pdspec_pb2.GenerateResponse], usage: dict) -> dict:
        text = "".join(r.text for r in responses)
        last = responses[-1]
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.logprobs is None:
            choice["logprobs"] = None
        elif self.chat:
            choice["logprobs"] = {"content": [e for r in responses for e in self.logprobs.chat(r)]}
        else:
            parts = [self.logprobs.completion(r) for r in responses]
            choice["logprobs"] = {key: [v for p in parts for v in p[key]] for key in parts[0]}
        choice["finish_reason"] = FINISH_REASONS.get(last.finish_reason, "stop")
        return {**self.head(False), "choices": [choice], "usage": usage, "pdspec": stats_json(last.stats)}


def _is_batch(prompt) -> bool:
    """A list of prompts (strings or id lists), not one prompt of ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


# ---------------------------------------------------------------------------- the API


@dataclass(frozen=True)
class ApiConfig:
    served_model_name: str | None = None  # default: the target model's name in the contract
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on every path but /health when set
    max_streams: int = 160  # also the most requests held waiting for the decode peer at once
    ready_wait_s: float = 30.0  # how long a /v1/* request waits for the decode peer before a 503


class OpenAIApi:
    """The FastAPI app over one GenerationService."""

    def __init__(self, service: GenerationService, config: ApiConfig) -> None:
        self.service = service
        self.config = config
        contract = service.engine.contract
        self.model = config.served_model_name or contract.target_model
        self.draft_model = contract.draft_model
        self.created = int(time.time())
        self.executor = ThreadPoolExecutor(config.max_streams + HEADROOM_THREADS, thread_name_prefix="openai-http")
        self.runs: set[_Run] = set()
        self.tokenizer = service.engine.pair.tokenizer
        self.texts = _TokenTexts(self.tokenizer)
        self.waiting = 0  # requests held until the decode peer is compatible
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None  # set (on the loop) when the peer's state changes
        self.app = self._build()
        metrics = getattr(service, "metrics", None)
        counter = metrics.http_requests if metrics is not None else None
        # Outermost: every request is counted, the ones the API key or routing refuse included.
        self.asgi = _Counted(self.app, counter)

    def ready(self) -> bool:
        """Whether the node can generate now: its decode peer answered and is compatible."""
        return bool(self.service.peer.compatible)

    def peer_changed(self, compatible: bool = True) -> None:
        """The decode peer's state changed (any thread): held requests look again."""
        loop, changed = self._loop, self._changed
        if loop is not None and changed is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(changed.set)

    def _not_ready(self, problem: str | None = None) -> OpenAIError:
        reason = problem or self.service.peer.problem or "the decode peer is not ready"
        return OpenAIError(503, f"not ready: {reason}; retry later", None, "unavailable")

    async def _until_ready(self, request: Request) -> bool:
        """True once the node can generate, False when the client left first; held at most
        `ready_wait_s` (less when the client said, in openai-python's x-stainless-read-timeout,
        that it gives up sooner), then 503."""
        if self.ready():
            return True
        bound = self.config.ready_wait_s
        with contextlib.suppress(ValueError):
            hint = float(request.headers.get("x-stainless-read-timeout", "inf"))
            if math.isfinite(hint):
                bound = min(bound, max(0.0, hint - READY_MARGIN_S))
        if self.waiting >= self.config.max_streams:
            raise self._not_ready(f"{self.waiting} requests already wait for the decode peer")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the first held request (an event belongs to one loop)
            self._changed, self._loop = asyncio.Event(), loop
        assert self._changed is not None
        end = loop.time() + bound
        self.waiting += 1
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            while not self.ready():
                remaining = end - loop.time()
                if remaining <= 0:
                    raise self._not_ready()
                self._changed.clear()
                if self.ready():
                    break
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    done, _ = await asyncio.wait(
                        {changed, watcher}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    changed.cancel()
                if watcher in done:
                    return False
        finally:
            self.waiting -= 1
            watcher.cancel()
        return True

    def close(self) -> None:
        """Cancel what still runs and wait for the worker threads."""
        for run in list(self.runs):
            run.cancel()
        self.executor.shutdown(wait=True, cancel_futures=True)

    # -- the app

    def _build(self) -> FastAPI:
        app = FastAPI(title="pdspec OpenAI-compatible API", docs_url=None, redoc_url=None)

        @app.exception_handler(OpenAIError)
        async def _openai_error(request: Request, err: OpenAIError):
            return err.response()

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, err: RequestValidationError):
            return _validation_error(err).response()

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, err: StarletteHTTPException):
            if err.status_code == 400:  # FastAPI's: a body its JSON parser gave up on (nested too deep)
                message = f"body: invalid JSON ({clip(err.detail, 200)})"
                return OpenAIError(400, message, None, "invalid_json").response()
            code = "not_found" if err.status_code == 404 else None
            return OpenAIError(err.status_code, clip(err.detail, 200), None, code).response()

        @app.exception_handler(Exception)
        async def _unexpected(request: Request, err: Exception):
            """The last resort (a bug, never a client's input): logged, counted as a 500."""
            log.error("HTTP %s %s failed", request.method, clip(request.url.path), exc_info=err)
            return OpenAIError(500, f"internal error ({type(err).__name__}); see the node's log").response()

        @app.get("/health")
        async def health():
            peer = self.service.peer
            if peer.compatible:
                return {"status": "ok"}
            return JSONResponse({"status": "unavailable", "reason": peer.problem}, status_code=503)

        @app.get("/v1/models")
        async def models(request: Request):
            if not await self._until_ready(request):  # listed only while the node can serve them
                return Response(status_code=499)
            return {"object": "list", "data": self._models()}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str, request: Request):
            if not await self._until_ready(request):
                return Response(status_code=499)
            for entry in self._models():
                if entry["id"] == model_id:
                    return entry
            raise self._unknown_model(model_id)

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, request: Request):
            return await self._serve(request, body, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatBody, request: Request):
            return await self._serve(request, body, chat=True)

        if self.config.api_key:
            app.add_middleware(_ApiKey, key=self.config.api_key)
        return app

    def _models(self) -> list[dict]:
        target = {"id": self.model, "object": "model", "created": self.created, "owned_by": "pdspec"}
        draft = {
            "id": self.draft_model,
            "object": "model",
            "created": self.created,
            "owned_by": "pdspec",
            "parent": self.model,  # it drafts for the served model; requests name the served model
        }
        return [target, draft]

    def _unknown_model(self, name: str) -> OpenAIError:
        if name == self.draft_model:
            message = f"model {name!r} is the draft of {self.model!r}: request {self.model!r}"
        else:
            message = f"model '{clip(name)}' does not exist: this server serves {self.model!r}"
        return OpenAIError(404, message, "model", "model_not_found")

    # -- translation

    def _check(self, body: CompletionBody | ChatBody, chat: bool) -> None:
        """What the OpenAI API has and pdspec does not do: 400 naming the parameter."""
        if body.model is not None and body.model != self.model:
            raise self._unknown_model(body.model)
        if body.n != 1:
            raise OpenAIError(400, f"n: expected 1 (one choice per request), got {clip(body.n)}", "n", "unsupported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise OpenAIError(400, f"{name}: expected 0 or unset (not supported)", name, "unsupported")
        if body.logit_bias:
            raise OpenAIError(400, "logit_bias: not supported", "logit_bias", "unsupported")
        if not chat:
            assert isinstance(body, CompletionBody)
            if body.echo:
                raise OpenAIError(400, "echo: expected false (not supported)", "echo", "unsupported")
            if body.best_of not in (None, 1):
                raise OpenAIError(400, f"best_of: expected 1, got {clip(body.best_of)}", "best_of", "unsupported")
            if body.suffix:
                raise OpenAIError(400, "suffix: not supported", "suffix", "unsupported")
            if _is_batch(body.prompt) and len(body.prompt) != 1:
                message = f"prompt: expected one prompt per request, got {len(body.prompt)}"
                raise OpenAIError(400, message, "prompt", "unsupported")
        elif body.tools:
            raise OpenAIError(400, "tools: not supported (no function calling)", "tools", "unsupported")
        elif body.max_tokens and body.max_completion_tokens and body.max_tokens != body.max_completion_tokens:
            message = "max_tokens / max_completion_tokens: expected one, or equal values"
            raise OpenAIError(400, message, "max_completion_tokens", "invalid_parameter")

    def _constraint(self, body: CompletionBody | ChatBody) -> tuple[pdspec_pb2.StructuredOutput | None, str | None]:
        """The request's structured-output constraint and the parameter it came in, or (None,
        None); a 400 naming response_format / structured_outputs for a shape the API does not
        have. Whether it compiles is the engine's check (its message, the same parameter)."""
        fmt, ext = body.response_format, body.structured_outputs
        kind = None if fmt is None else fmt.get("type", "text")
        out = pdspec_pb2.StructuredOutput()
        if ext:
            if kind not in (None, "text"):
                message = "structured_outputs: expected it or response_format, got both"
                raise OpenAIError(400, message, "structured_outputs", "invalid_parameter")
            return _extension(ext, out), "structured_outputs"
        if kind in (None, "text"):
            return None, None
        if kind == "json_object":
            out.json_object = True
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                message = "response_format: expected json_schema.schema, a JSON Schema object"
                raise OpenAIError(400, message, "response_format", "invalid_parameter")
            out.json_schema = json.dumps(schema)  # strict or not: the schema is always enforced
        else:
            message = f"response_format: expected type text, json_object or json_schema, got {clip(repr(kind))}"
            raise OpenAIError(400, message, "response_format", "invalid_parameter")
        return out, "response_format"

    def _sampling(self, body: CompletionBody | ChatBody, max_tokens: int, logprobs: int) -> pdspec_pb2.SamplingParams:
        temperature = 1.0 if body.temperature is None else body.temperature
        sampling = pdspec_pb2.SamplingParams(
            do_sample=temperature != 0,  # 0 = greedy; a negative value is the engine's to reject
            temperature=temperature,
            top_k=0 if body.top_k in (None, -1) else body.top_k,
            top_p=1.0 if body.top_p is None else body.top_p,
            max_new_tokens=max_tokens,
            stop_token_ids=body.stop_token_ids or [],
            logprobs=logprobs,
        )
        if body.seed is not None:
            sampling.seed = body.seed
        return sampling

    def _prompt_ids(self, body: CompletionBody | ChatBody, chat: bool) -> list[int]:
        """The prompt as the engine will see it (its length is usage.prompt_tokens)."""
        if chat:
            assert isinstance(body, ChatBody)
            messages = []
            for i, message in enumerate(body.messages):
                entry = message.model_dump(exclude_none=True)
                if isinstance(message.content, list):
                    texts = []
                    for part in message.content:
                        if part.get("type") != "text" or not isinstance(part.get("text"), str):
                            param = f"messages[{i}].content"
                            raise OpenAIError(400, f"{param}: only text content parts are supported", param)
                        texts.append(part["text"])
                    entry["content"] = "".join(texts)
                messages.append(entry)
            template = getattr(self.tokenizer, "apply_chat_template", None)
            if template is None or not getattr(self.tokenizer, "chat_template", None):
                raise OpenAIError(
                    400, f"messages: model {self.model!r} has no chat template: use /v1/completions", "messages"
                )
            try:
                text = template(messages)
            except Exception as err:  # a template that raises on these messages (jinja2 errors)
                message = f"messages: the chat template failed: {clip(err, 200)}"
                raise OpenAIError(400, message, "messages") from err
            return self.tokenizer.encode(text)
        assert isinstance(body, CompletionBody)
        prompt = body.prompt
        if _is_batch(prompt):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise OpenAIError(400, "prompt: expected text of at least 1 token, got 0 tokens", "prompt")
            return ids
        return list(prompt)

    def _generate_request(
        self,
        body: CompletionBody | ChatBody,
        chat: bool,
        rid: str,
        logprobs: int,
        constraint: pdspec_pb2.StructuredOutput | None,
    ):
        if chat:
            assert isinstance(body, ChatBody)
            max_tokens = body.max_completion_tokens or body.max_tokens or 0  # 0: the server's default
        else:
            assert isinstance(body, CompletionBody)
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        sampling = self._sampling(body, max_tokens, logprobs)

        def build() -> pdspec_pb2.GenerateRequest:  # in the worker thread: tokenizing is model work
            request = pdspec_pb2.GenerateRequest(
                request_id=rid, prompt_token_ids=self._prompt_ids(body, chat), sampling=sampling, stop=stops
            )
            if body.num_speculative_tokens is not None:
                request.num_speculative_tokens = body.num_speculative_tokens
            if body.draft_candidates is not None:
                request.draft_candidates = body.draft_candidates
            if constraint is not None:
                request.structured_output.CopyFrom(constraint)
            return request

        return build

    # -- serving

    async def _serve(self, request: Request, body: CompletionBody | ChatBody, chat: bool):
        self._check(body, chat)
        constraint, constraint_param = self._constraint(body)
        if chat:
            assert isinstance(body, ChatBody)
            top = body.top_logprobs or 0
            wants_logprobs = body.logprobs
            if top and not body.logprobs:
                raise OpenAIError(400, "top_logprobs: expected logprobs: true with it", "top_logprobs")
        else:
            assert isinstance(body, CompletionBody)
            top = body.logprobs or 0
            wants_logprobs = body.logprobs is not None
        # The chosen token's logprob needs the engine to report at least one alternative.
        engine_logprobs = max(top, 1) if wants_logprobs else 0
        if not await self._until_ready(request):
            return Response(status_code=499)
        rid = uuid.uuid4().hex
        shape = _Shape(
            chat=chat,
            id=f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
            model=self.model,
            created=int(time.time()),
            logprobs=_Logprobs(self.texts, top) if wants_logprobs else None,
            include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        )
        build = self._generate_request(body, chat, rid, engine_logprobs, constraint)
        run = _Run(self, build, asyncio.get_running_loop())
        headers = {"x-request-id": rid}
        try:
            if not body.stream:
                responses = await _until_disconnect(request, run, run.collect())
                if not responses or not responses[-1].finished:
                    raise OpenAIError(500, f"request {rid!r}: the generation ended without a final response")
                usage = _usage(run.prompt_tokens, sum(len(r.token_ids) for r in responses))
                return JSONResponse(shape.whole(responses, usage), headers=headers)
            first = await _until_disconnect(request, run, run.next())
        except RequestFailed as err:
            run.cancel()
            raise from_request_failed(err, chat, constraint_param) from err
        except _ClientGone:
            return Response(status_code=499)
        except BaseException:
            run.cancel()
            raise
        if first is None:
            raise OpenAIError(500, f"request {rid!r}: the generation ended without a response")
        return StreamingResponse(
            self._events(run, first, shape, chat, constraint_param),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(
        self, run: _Run, first, shape: _Shape, chat: bool, constraint_param: str | None
    ) -> AsyncIterator[str]:
        """The SSE stream; a client that disconnects cancels the stream's task, and so the run."""
        try:
            if chat:
                yield _sse(shape.role_chunk())
            response, generated, stats = first, 0, {}
            while response is not None:
                generated += len(response.token_ids)
                yield _sse(shape.chunk(response))
                if response.finished:
                    stats = stats_json(response.stats)
                    break
                response = await run.next()
            if shape.include_usage:
                yield _sse(shape.usage_chunk(_usage(run.prompt_tokens, generated), stats))
            yield _sse("[DONE]")
        except RequestFailed as err:
            yield _sse(from_request_failed(err, chat, constraint_param).body())
        except Exception as err:
            log.exception("request %s: stream failed", shape.id)
            yield _sse(OpenAIError(500, f"{type(err).__name__}: {err}").body())
        finally:
            run.cancel()  # a no-op when the generation ended by itself


class _ApiKey:
    """`Authorization: Bearer <key>` on every path but /health: /v1/*, /openapi.json, unknown
    paths (pure ASGI: streams and disconnects pass untouched)."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                message = "invalid API key" if given else "missing API key: send Authorization: Bearer <key>"
                await OpenAIError(401, message, None, "invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Counted:
    """pdspec_http_requests_total{route, code}: every HTTP request once, with the status it was
    answered (route: the matched route's template, "other" for a path no route has; 499 for
    a request that ended without a response). Outside every other layer of the app, so the
    refusals of the API key, the router and validation count too."""

    def __init__(self, app: FastAPI, counter) -> None:
        self.app, self.counter = app, counter

    def route(self, scope) -> str:
        for route in self.app.router.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:  # PARTIAL: the path, another method (405)
                return getattr(route, "path_format", None) or getattr(route, "path", "other")
        return "other"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.counter is None:
            await self.app(scope, receive, send)
            return
        route, status = self.route(scope), None

        async def counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start" and status is None:
                status = message["status"]
                self.counter.labels(route, str(status)).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            # Answered (and logged) by the app's last-resort handler, which Starlette re-raises
            # after; else nothing answered it yet.
            if status is None:
                log.exception("HTTP %s %s failed", scope.get("method"), clip(scope.get("path", "")))
                with contextlib.suppress(Exception):  # the client may be gone
                    await OpenAIError(500, "internal error; see the node's log").response()(scope, receive, counted)
        finally:
            if status is None:
                self.counter.labels(route, "499").inc()


# ---------------------------------------------------------------------------- the server thread


class _BoundedSend(AutoHTTPProtocol):
    """uvicorn's HTTP/1.1 protocol with a connection's send buffering bounded (SEND_BUFFER_BYTES):
    a response stream whose client stops reading stops at once, and so does its relay. Nagle's
    algorithm is off (TCP_NODELAY): an event stream's chunks are small writes, and with it on, a
    chunk written while the one before is unacknowledged waits for that ACK, which a client
    that keeps its connection alive delays by ~40 ms (delayed ACK), so a streamed response arrived
    in one burst that late instead of token by token."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if sock is not None and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, SEND_BUFFER_BYTES)
        transport.set_write_buffer_limits(high=SEND_BUFFER_BYTES)
        super().connection_made(transport)


class HttpServer:
    """uvicorn serving the API from a background thread; `stop` drains and joins it."""

    def __init__(self, api: OpenAIApi, host: str, port: int, grace_s: float, tls=None) -> None:
        self.api = api
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        try:
            self.socket = socket.create_server((host, port), family=family)
        except OSError as err:
            raise OSError(f"cannot listen on {host}:{port} for HTTP (is another node there?): {err}") from err
        self.port = self.socket.getsockname()[1]
        self.grace_s = grace_s
        config = uvicorn.Config(
            api.asgi,
            log_config=None,  # the node's logging, not uvicorn's
            http=_BoundedSend,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=max(1, round(grace_s)),
            **_ssl_options(tls),
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="openai-http-server", daemon=True)
        self._failed: BaseException | None = None

    def _run(self) -> None:
        try:
            # anyio imports its asyncio backend when it is first used, by the first streamed
            # response (starlette's StreamingResponse): that request waited ~25-50 ms for it
            anyio.run(anyio.sleep, 0)
            self.server.run(sockets=[self.socket])
        except BaseException as err:
            self._failed = err
            log.exception("HTTP server failed")

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"HTTP server did not start: {self._failed!r}")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(self.grace_s + 5)
        self.api.close()
        self.socket.close()


def _ssl_options(tls) -> dict:
    """uvicorn's TLS settings from the node's pdspec.tls.ServerTls (its CA: client certificates required)."""
    if tls is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)}
    if tls.ca is not None:
        options.update(ssl_ca_certs=str(tls.ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


def start_http(
    service: GenerationService,
    host: str,
    port: int,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_streams: int = 160,
    grace_s: float = 5.0,
    tls=None,
    ready_wait_s: float = 30.0,
) -> HttpServer:
    api = OpenAIApi(service, ApiConfig(served_model_name, api_key, max_streams, ready_wait_s))
    try:
        server = HttpServer(api, host, port, grace_s, tls)
    except BaseException:
        api.close()
        raise
    try:
        server.start()
    except BaseException:
        api.close()
        server.socket.close()
        raise
    return server


__all__ = ["ApiConfig", "HttpCall", "HttpServer", "OpenAIApi", "OpenAIError", "start_http"]
