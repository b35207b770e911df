"""The FastAPI app: OpenAI-compatible completions and chat completions (JSON or server-sent
events), models, vLLM's tokenize / detokenize / version, health, Prometheus metrics; bearer-token
auth, admission control and draining. A streaming client that stops reading is aborted after
``ServeLimits.send_timeout_s``.

Admission: a request needs one engine sequence per choice (``n``); while ``max_num_seqs +
max_waiting`` sequences are already admitted and unfinished, new requests get 429 at once
instead of queueing without bound. A sequence's slot is released when the engine finishes it,
not when the client reads its last chunk. While the model loads, the server drains (SIGTERM)
or after the engine died they get 503. Requests beyond :class:`~.settings.ServeLimits` get 400
(413 for the body size). Prompts are tokenized and chat-templated in a worker thread, not on the
engine thread. Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, Response, StreamingResponse
from llmopt.core.errors import LlmoptError
from llmopt.runtime import LLMEngine, SamplingParams

from .engine_loop import Chunk, EngineDead, EngineLoop
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body, new_id, now,
                       usage)
from .settings import ServeLimits

log = logging.getLogger("llmopt.serve")
DISCONNECT_CHECK_S = 1.0  # how often a non-streaming request checks that its client is still there
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize",
             "/version")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return _AsciiJSON(error_body(self.status, self.message, self.param, self.code), status_code=self.status)


class ClientGone(Exception):
    """The client of a non-streaming request went away; its run is aborted (logged as 499)."""


class _AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote the request, and a lone surrogate
    from a JSON ``\\ud800`` escape cannot be encoded as UTF-8."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


@dataclass
class ServeSettings:
    model_name: str
    api_key: str | None = None
    max_waiting: int = 128
    chat_template: str | None = None  # overrides the tokenizer's
    limits: ServeLimits = field(default_factory=ServeLimits)
    exit_on_engine_death: bool = True  # stop serving (the process exits non-zero) once the engine is dead


@dataclass
class ServerState:
    settings: ServeSettings
    loader: Callable[[], LLMEngine]
    loop: EngineLoop | None = None
    load_error: str | None = None
    draining: bool = False
    in_flight: int = 0  # engine sequences admitted and not finished (event-loop thread only)
    metrics: ServerMetrics = field(init=False)
    on_fatal: Callable[[], None] | None = None  # set by the server: stop serving

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.settings.model_name, lambda: self.loop.snapshot if self.loop is not None else {},
                                     lambda: self.in_flight)

    @property
    def ready(self) -> bool:
        return self.loop is not None and not self.draining and self.loop.healthy

    @property
    def engine_failure(self) -> str | None:
        """Why the engine stopped for good, or None."""
        if self.loop is None or self.draining or self.loop.healthy:
            return None
        return self.loop.dead or "the engine thread has stopped"

    @property
    def capacity(self) -> int:
        return self.loop.engine.config.max_num_seqs + self.settings.max_waiting

    def load(self) -> None:
        try:
            engine = self.loader()
            if self.settings.chat_template:
                engine.tokenizer.chat_template = self.settings.chat_template
            _touch_kv_cache(engine)
            loop = EngineLoop(engine, error_limit=self.settings.limits.engine_error_limit, on_dead=self._engine_dead)
            loop.start()
            self.loop = loop
        except Exception as exc:  # noqa: BLE001 - reported by /health
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("loading the model failed: %s", self.load_error)

    def _engine_dead(self, message: str) -> None:
        """(engine thread) The engine died: stop serving, so a supervisor restarts the process."""
        log.critical("the engine is dead (%s): %s", message,
                     "the server stops" if self.settings.exit_on_engine_death else "/health answers 503")
        if self.settings.exit_on_engine_death and self.on_fatal is not None:
            self.on_fatal()


def _touch_kv_cache(engine: LLMEngine) -> None:
    """Write the whole KV cache once so its memory is resident from the start: the cache is
    allocated empty and its pages would otherwise be touched block by block under load (the
    server's RSS would keep growing until every block had been used once)."""
    cache = getattr(engine, "cache", None)
    for name in ("data", "scales"):
        tensor = getattr(cache, name, None)
        if tensor is not None and hasattr(tensor, "zero_"):
            tensor.zero_()


class Gate:
    """ASGI middleware: bearer-token check (every path but /health; the scheme's case does not
    matter), 503 while draining, 413 for a body over ``limits.max_body_bytes``, and request
    counting by endpoint and status."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state
        key = state.settings.api_key
        self.key = key.encode() if key else None

    def authorized(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        status = {"code": 500}

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if path != "/health" and self.key is not None:
                if not self.authorized(dict(scope["headers"]).get(b"authorization", b"")):
                    await ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                   code="invalid_api_key").response()(scope, receive, counting_send)
                    return
            if self.state.draining and path not in ("/health", "/metrics"):
                await ApiError(503, "the server is shutting down", code="shutting_down").response()(scope, receive, counting_send)
                return
            receive, refusal = await _bounded_body(scope, receive, self.state.settings.limits.max_body_bytes)
            if refusal is not None:
                await refusal.response()(scope, receive, counting_send)
                return
            await self.app(scope, receive, counting_send)
        finally:
            self.state.metrics.count_request(endpoint, status["code"])


async def _bounded_body(scope, receive, limit: int):
    """``(receive, None)``, or ``(receive, 413 error)`` for a body over ``limit`` bytes: by its
    Content-Length at once, else (chunked) once that much has arrived; the body is then read to
    the end (up to a bound) and dropped, so the client gets the answer rather than a reset."""
    if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
        return receive, None
    declared = dict(scope["headers"]).get(b"content-length")
    size = int(declared) if declared is not None and declared.isdigit() else None
    if size is not None and size <= limit:
        return receive, None
    chunks, total, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return _replay([], message, receive), None  # the client left: the app sees the disconnect
        body = message.get("body", b"")
        total += len(body)
        more = message.get("more_body", False)
        if total > limit:
            break
        chunks.append(body)
    else:
        if size is None:
            return _replay(chunks, None, receive), None
    drained = total
    while more and drained <= 4 * limit + 2**20:
        message = await receive()
        if message["type"] != "http.request":
            break
        drained += len(message.get("body", b""))
        more = message.get("more_body", False)
    shown = size if size is not None else total
    return receive, ApiError(413, f"the request body has {'more than ' if size is None else ''}{shown} bytes but this server "
                                  f"accepts at most {limit}: send a smaller request", None, "request_too_large")


def _replay(chunks: list[bytes], pending, receive):
    """A ``receive`` that first hands out the body already read (or the message already taken)."""
    first = [pending] if pending is not None else [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

    async def replay():
        if first:
            return first.pop()
        return await receive()

    return replay


def create_app(state: ServerState) -> FastAPI:
    """The app around ``state``; its lifespan loads the model in a thread and stops the engine."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = threading.Thread(target=state.load, name="llmopt-load", daemon=True)
        loader.start()
        yield
        state.draining = True
        loader.join(timeout=1)
        if state.loop is not None:
            await asyncio.to_thread(state.loop.stop)

    app = FastAPI(title="llmopt", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # unknown route (404), wrong method (405), a body that cannot be parsed (400): OpenAI's shape too
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        response = ApiError(exc.status_code, str(exc.detail), None, code).response()
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = first.get("msg", "invalid request")
        param = (first.get("ctx") or {}).get("param") or where  # a request-level check names its field
        return ApiError(400, f"{where}: {message}" if where else message, param, "invalid_request").response()

    @app.get("/health")
    async def health():
        if state.ready:
            return {"status": "ok"}
        if state.draining:
            status = "draining"
        elif state.engine_failure:
            status = "engine failed: " + state.engine_failure
        else:
            status = "failed: " + state.load_error if state.load_error else "loading"
        return _AsciiJSON({"status": status}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        from llmopt import __version__

        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        engine = _check_model(state, body.model, _require_loop(state)).engine
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = await _in_worker(lambda: _chat_ids(engine, messages, body.add_generation_prompt),
                                   "the messages could not be tokenized", "messages")
        else:
            ids = await _in_worker(lambda: _prompt_ids(engine, body.prompt), "the prompt could not be tokenized", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        engine = _check_model(state, body.model, _require_loop(state)).engine
        size = len(engine.tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{size - 1})", "tokens", "invalid_request")
        text = await _in_worker(lambda: engine.tokenizer.decode(body.tokens), "the tokens could not be decoded", "tokens")
        return {"prompt": text}

    @app.get("/v1/models")
    async def models():
        loop = _require_loop(state)
        return {"object": "list", "data": [{"id": state.settings.model_name, "object": "model", "created": now(),
                                            "owned_by": "llmopt", "max_model_len": loop.engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = body.prompts()
        run = await _admit(state, body, lambda engine: [_prompt_ids(engine, p) for p in prompts], body.logprobs, "prompt",
                           echo=body.echo)
        if body.echo:
            run.prompt_texts = [p if isinstance(p, str) else None for p in prompts]
        if body.stream:
            return _sse(state, run, _completion_stream(state, body, run, request))
        return await _completion_json(state, body, run, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        top = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_request")
        run = await _admit(state, body, lambda engine: [_chat_ids(engine, messages)], top, "messages")
        if body.stream:
            return _sse(state, run, _chat_stream(state, body, run, request))
        return await _chat_json(state, body, run, request)

    return Gate(app, state)


# -- admission and submission -----------------------------------------------------------------

@dataclass
class Run:
    """One HTTP request's engine sequences and their shared output queue."""

    request_id: str
    queue: asyncio.Queue
    ids: list[str]  # engine request ids, in choice order: prompt k's n choices are k * n … k * n + n - 1
    num_prompt_tokens: int  # all prompts together, each once
    prompt_texts: list[str | None] = field(default_factory=list)  # echo: each prompt's text (None: decode its ids)
    open: set[str] = field(default_factory=set)  # sequences whose last chunk the handler has not read
    admitted: set[str] = field(default_factory=set)  # sequences holding an admission slot
    checked: float = 0.0  # when the client's connection was last checked (event-loop clock)


def _require_loop(state: ServerState) -> EngineLoop:
    if state.loop is None:
        message = f"the model failed to load ({state.load_error})" if state.load_error else "the model is still loading"
        raise ApiError(503, message, code="not_ready")
    if state.draining:
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    if state.engine_failure:
        raise ApiError(503, f"the engine failed ({state.engine_failure}): the server must be restarted", code="engine_dead")
    return state.loop


def _check_model(state: ServerState, model: str | None, loop: EngineLoop) -> EngineLoop:
    """``loop``, when ``model`` is the served one (or not given); 404 otherwise."""
    if model is not None and model != state.settings.model_name:
        raise ApiError(404, f"the model '{model}' does not exist: this server serves '{state.settings.model_name}'",
                       "model", "model_not_found")
    return loop


async def _in_worker(fn: Callable[[], Any], failure: str, param: str) -> Any:
    """``fn()`` in a worker thread (tokenizer work stays off the engine thread and the event loop);
    an exception is a 400 starting with ``failure`` (text the tokenizer cannot take)."""
    try:
        return await asyncio.to_thread(fn)
    except (ApiError, LlmoptError):
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. a lone surrogate
        raise ApiError(400, f"{failure}: {type(exc).__name__}: {exc}", param, "invalid_request") from exc


async def _admit(state: ServerState, body, prompts_fn, logprobs: int | None, prompt_param: str, echo: bool = False) -> Run:
    """Check the request, tokenize its prompts (in a worker thread), reserve ``n`` sequences per
    prompt (429 when full) and queue them in the engine. With ``echo`` each sequence also scores
    its prompt (``logprobs`` top tokens per prompt token)."""
    loop = _check_model(state, body.model, _require_loop(state))
    limits = state.settings.limits
    _check_limits(state, body)
    temperature = 0.0 if body.temperature < limits.greedy_below else body.temperature
    params = []
    for i in range(body.n):
        try:
            params.append(SamplingParams(
                max_tokens=body.max_tokens, temperature=temperature, top_p=body.top_p, top_k=body.top_k,
                min_p=body.min_p, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, seed=None if body.seed is None else body.seed + i,
                stop=list(body.stop or []), ignore_eos=body.ignore_eos, logprobs=logprobs, stream_text=True,
                stop_token_ids=list(body.stop_token_ids or []), include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                prompt_logprobs=(logprobs or 0) if echo else None))
        except LlmoptError as exc:
            raise ApiError(400, exc.problem, code="invalid_request") from exc
    engine = loop.engine
    prompts = await _in_worker(lambda: prompts_fn(engine), "the prompt could not be tokenized", prompt_param)
    for ids in prompts:
        _check_length(state, engine.max_model_len, len(ids), body.max_tokens, prompt_param)
    wanted = body.n * len(prompts)
    if wanted > state.capacity:
        raise ApiError(400, f"{len(prompts)} prompts with n = {body.n} need {wanted} sequences but this server admits "
                            f"{state.capacity} at once (max_num_seqs + max_waiting): send fewer prompts per request",
                       prompt_param, "invalid_request")
    if state.in_flight + wanted > state.capacity:
        raise ApiError(429, f"the server is at capacity ({state.in_flight} sequences admitted, limit {state.capacity} = "
                            f"max_num_seqs + max_waiting): retry later", code="queue_full")
    state.in_flight += wanted
    run = Run(new_id("cmpl"), asyncio.Queue(), [], sum(len(ids) for ids in prompts))
    run.ids = [f"{run.request_id}-{i}" for i in range(wanted)]
    run.admitted = set(run.ids)
    jobs = [(rid, prompts[i // body.n], params[i % body.n]) for i, rid in enumerate(run.ids)]

    def add(engine: LLMEngine) -> int:
        added = []
        try:
            for rid, ids, p in jobs:
                engine.add_request(ids, p, request_id=rid)
                added.append(rid)
        except Exception:
            for rid in added:
                engine.abort(rid, report=False)
            raise
        return len(added)

    try:
        await loop.submit_many(add, run.ids, run.queue, [p for _, _, p in jobs], lambda rid, chunk: _finished(state, run, rid, chunk))
    except BaseException as exc:
        for rid in run.ids:  # if the engine took them after all (this handler was cancelled), they stop
            loop.abort(rid)
        state.in_flight -= len(run.admitted)
        run.admitted.clear()
        if isinstance(exc, LlmoptError):
            raise ApiError(400, exc.problem, prompt_param, "invalid_request") from exc
        if isinstance(exc, EngineDead):
            raise ApiError(503, f"the engine failed ({exc}): the server must be restarted", code="engine_dead") from exc
        raise
    run.open = set(run.ids)
    return run


def _check_limits(state: ServerState, body) -> None:
    """``n`` and the stop strings against the server's limits (400 naming the limit)."""
    limits = state.settings.limits
    most = min(limits.max_n, state.capacity)
    if body.n > most:
        why = (f"max_n is {limits.max_n}" if limits.max_n <= state.capacity else
               f"the server admits {state.capacity} sequences at once (max_num_seqs + max_waiting)")
        raise ApiError(400, f"n is {body.n} but this server allows at most {most} choices per request ({why})", "n", "invalid_request")
    stops = body.stop or []
    if len(stops) > limits.max_stop_sequences:
        raise ApiError(400, f"{len(stops)} stop sequences but this server allows at most {limits.max_stop_sequences}",
                       "stop", "invalid_request")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_chars:
        raise ApiError(400, f"a stop sequence has {longest} characters but this server allows at most {limits.max_stop_chars}",
                       "stop", "invalid_request")


def _check_length(state: ServerState, engine_max: int, n: int, max_tokens: int | None, prompt_param: str) -> None:
    """The prompt, and the prompt plus ``max_tokens``, within the model's context (400 otherwise)."""
    configured = state.settings.limits.max_prompt_tokens
    if configured is not None and n > configured and configured < engine_max - 1:
        raise ApiError(400, f"this server accepts prompts of at most {configured} tokens, but the prompt has {n} tokens: "
                            "shorten the prompt", prompt_param, "context_length_exceeded")
    if n >= engine_max:
        raise ApiError(400, f"this model's maximum context length is {engine_max} tokens, but the prompt has {n} tokens: "
                            "shorten the prompt", prompt_param, "context_length_exceeded")
    if max_tokens is not None and n + max_tokens > engine_max:
        raise ApiError(400, f"this model's maximum context length is {engine_max} tokens, but the prompt ({n}) plus "
                            f"max_tokens ({max_tokens}) need {n + max_tokens}: lower max_tokens or shorten the prompt",
                       "max_tokens", "context_length_exceeded")


def _finished(state: ServerState, run: Run, rid: str, chunk: Chunk) -> None:
    """(event loop, called by the engine loop) The engine is done with ``rid``: release its slot."""
    if rid not in run.admitted:
        return
    run.admitted.discard(rid)
    state.in_flight -= 1
    state.metrics.record_finished(chunk.finish_reason or "error", chunk.num_prompt_tokens, chunk.num_output_tokens, chunk.metrics)


def _prompt_ids(engine: LLMEngine, prompt) -> list[int]:
    if isinstance(prompt, str):
        return list(engine.tokenizer(prompt).input_ids)
    return list(prompt)


def _chat_ids(engine: LLMEngine, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions, or start the server with --chat-template FILE",
                       "messages", "no_chat_template")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
        raise ApiError(400, f"the chat template rejected the messages: {exc}", "messages", "invalid_request") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


async def _next(state: ServerState, run: Run, request: Request | None) -> tuple[int, Chunk]:
    """The next chunk of any of the run's sequences; for non-streaming requests a client that
    went away aborts the run, noticed within about a second, while chunks keep coming too
    (streaming ones are cancelled by the server)."""
    while True:
        if request is not None:
            clock = asyncio.get_running_loop().time()
            if clock - run.checked >= DISCONNECT_CHECK_S:
                run.checked = clock
                if await request.is_disconnected():
                    raise ClientGone()
        try:
            rid, chunk = await asyncio.wait_for(run.queue.get(), timeout=DISCONNECT_CHECK_S if request is not None else None)
        except asyncio.TimeoutError:
            continue
        if chunk.finished:
            run.open.discard(rid)
        return run.ids.index(rid), chunk


def _release(state: ServerState, run: Run) -> None:
    """The handler is done (client gone, error, shutdown): abort what is still running and
    return the slots the engine has not released yet."""
    for rid in run.open:
        state.loop.abort(rid)
    run.open.clear()
    for rid in run.admitted:
        state.in_flight -= 1
        state.metrics.record_finished("abort", run.num_prompt_tokens, 0)
    run.admitted.clear()


# -- responses ------------------------------------------------------------------------------------

def _completion_logprobs(entries: list[dict], offset: int) -> dict:
    """The legacy completions ``logprobs`` object; an echoed prompt's first token has None."""
    tokens = [e["token"] for e in entries]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else dict(reversed(e["top"])) for e in entries], "text_offset": offsets}


def _echoed(run: Run, choice: int, n: int, chunk: Chunk) -> tuple[str, list[dict]]:
    """The prompt's text and log-probability entries, which an echo puts before choice ``choice``."""
    entries = chunk.prompt_logprobs or []
    text = run.prompt_texts[choice // n] if run.prompt_texts else None
    return (text if text is not None else "".join(e["token"] for e in entries)), entries


def _chat_logprobs(entries: list[dict]) -> dict:
    def item(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries]}


def _finish_reason(chunk: Chunk) -> str:
    if chunk.finish_reason == "error":
        raise ApiError(500, chunk.error or "generation failed", code="engine_error")
    return chunk.finish_reason


async def _collect(state: ServerState, run: Run, request: Request, echo: int = 0) -> tuple[list[str], list[list[dict]], list[str], int]:
    """Every choice's text, logprob entries and finish reason, and the tokens generated; with
    ``echo`` (the request's n) each choice starts with its prompt."""
    count = len(run.ids)
    texts, logprobs, reasons, completion = [""] * count, [[] for _ in range(count)], [""] * count, 0
    try:
        while run.open:
            i, chunk = await _next(state, run, request)
            if echo and chunk.prompt_logprobs is not None:
                texts[i], logprobs[i] = _echoed(run, i, echo, chunk)
            texts[i] += chunk.delta_text
            logprobs[i] += chunk.logprobs or []
            if chunk.finished:
                reasons[i] = _finish_reason(chunk)
                completion += chunk.num_output_tokens
    finally:
        _release(state, run)
    return texts, logprobs, reasons, completion


async def _completion_json(state: ServerState, body: CompletionRequest, run: Run, request: Request) -> dict:
    texts, logprobs, reasons, completion = await _collect(state, run, request, body.n if body.echo else 0)
    choices = [{"index": i, "text": texts[i], "finish_reason": reasons[i],
                "logprobs": _completion_logprobs(logprobs[i], 0) if body.logprobs is not None else None}
               for i in range(len(run.ids))]
    return {"id": run.request_id, "object": "text_completion", "created": now(), "model": state.settings.model_name,
            "choices": choices, "usage": usage(run.num_prompt_tokens, completion)}


async def _chat_json(state: ServerState, body: ChatCompletionRequest, run: Run, request: Request) -> dict:
    texts, logprobs, reasons, completion = await _collect(state, run, request)
    choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "finish_reason": reasons[i],
                "logprobs": _chat_logprobs(logprobs[i]) if body.logprobs else None} for i in range(body.n)]
    return {"id": run.request_id.replace("cmpl", "chatcmpl", 1), "object": "chat.completion", "created": now(),
            "model": state.settings.model_name, "choices": choices, "usage": usage(run.num_prompt_tokens, completion)}


_TIMEOUT = getattr(asyncio, "timeout", None)  # Python 3.11+


class _SendTimeout(Exception):
    """One server-sent event could not be sent in time: the client stopped reading."""


class _EventStream(StreamingResponse):
    """Server-sent events whose run is released however the response ends, even when the
    client leaves before the first event (the body generator then never starts); an event that
    cannot be sent within ``send_timeout`` seconds (a client that stopped reading) ends it too."""

    def __init__(self, events: AsyncIterator[dict], on_close: Callable[[], None], send_timeout: float) -> None:
        async def body():
            async for event in events:
                yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"

        super().__init__(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close, self.send_timeout, self.stalled = on_close, send_timeout, False

    async def __call__(self, scope, receive, send) -> None:
        async def timed_send(message) -> None:
            try:
                if _TIMEOUT is not None:
                    async with _TIMEOUT(self.send_timeout):  # no task per event, unlike wait_for
                        await send(message)
                else:
                    await asyncio.wait_for(send(message), self.send_timeout)
            except (TimeoutError, asyncio.TimeoutError):
                self.stalled = True
                raise _SendTimeout() from None

        try:
            await super().__call__(scope, receive, timed_send)
        except Exception:
            if not self.stalled:
                raise
            log.warning("a streaming client read nothing for %g s: its request is aborted", self.send_timeout)
        finally:
            self.on_close()


def _sse(state: ServerState, run: Run, events: AsyncIterator[dict]) -> StreamingResponse:
    return _EventStream(events, lambda: _release(state, run), state.settings.limits.send_timeout_s)


async def _stream(state: ServerState, body, run: Run, make_choice, head: dict) -> AsyncIterator[dict]:
    """Chunks as events; the run is aborted if the client goes away (the generator is closed)."""
    completion = 0
    try:
        while run.open:
            i, chunk = await _next(state, run, None)
            reason = None
            if chunk.finished:
                completion += chunk.num_output_tokens
                if chunk.finish_reason == "error":
                    yield error_body(500, chunk.error or "generation failed", code="engine_error")
                    return
                reason = chunk.finish_reason
            if chunk.delta_text or chunk.logprobs or chunk.prompt_logprobs or reason:
                yield {**head, "created": now(), "choices": [make_choice(i, chunk, reason)]}
        if body.include_usage:
            yield {**head, "created": now(), "choices": [], "usage": usage(run.num_prompt_tokens, completion)}
    finally:
        _release(state, run)


def _completion_stream(state: ServerState, body: CompletionRequest, run: Run, request: Request) -> AsyncIterator[dict]:
    offsets = [0] * len(run.ids)

    def choice(i: int, chunk: Chunk, reason: str | None) -> dict:
        text, entries = _echoed(run, i, body.n, chunk) if body.echo and chunk.prompt_logprobs is not None else ("", [])
        text += chunk.delta_text
        entries = entries + (chunk.logprobs or [])
        lp = None
        if body.logprobs is not None:
            lp = _completion_logprobs(entries, offsets[i])
            offsets[i] += sum(len(t) for t in lp["tokens"])
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

    head = {"id": run.request_id, "object": "text_completion", "model": state.settings.model_name}
    return _stream(state, body, run, choice, head)


def _chat_stream(state: ServerState, body: ChatCompletionRequest, run: Run, request: Request) -> AsyncIterator[dict]:
    head = {"id": run.request_id.replace("cmpl", "chatcmpl", 1), "object": "chat.completion.chunk", "model": state.settings.model_name}
    started = [False] * body.n

    def choice(i: int, chunk: Chunk, reason: str | None) -> dict:
        delta = {"content": chunk.delta_text} if chunk.delta_text or not reason else {}
        if not started[i]:
            delta = {"role": "assistant", **delta}
            started[i] = True
        out = {"index": i, "delta": delta, "logprobs": _chat_logprobs(chunk.logprobs or []) if body.logprobs else None,
               "finish_reason": reason}
        return out

    async def events():
        for i in range(body.n):  # the role first, as OpenAI sends it, before any token
            started[i] = True
            yield {**head, "created": now(), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}]}
        async for event in _stream(state, body, run, choice, head):
            yield event

    return events()


__all__ = ["ApiError", "ServeSettings", "ServerState", "create_app"]
