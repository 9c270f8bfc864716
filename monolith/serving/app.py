"""The HTTP app (starlette) that serves the OpenAI, Anthropic and Responses APIs
(docs/serving.md is the contract). `create_app` routes:

- GET /health, GET /metrics, GET /v1/models;
- POST /v1/chat/completions and /v1/completions (OpenAI);
- POST /v1/messages and /v1/messages/count_tokens (Anthropic);
- POST /v1/responses, /v1/responses/input_tokens and /v1/responses/compact; for a
  stored response GET and DELETE /v1/responses/{id}, GET .../{id}/input_items and
  POST .../{id}/cancel (responses_routes.py); and a WebSocket at /v1/responses
  (responses_socket.py), on the same engine driving (`start`, `progress`).

`create_app(load, config)` answers at once and runs `load()` (which returns an
Engine) on a background thread: /health says 503 until it is done, and the
generation endpoints answer 503 meanwhile. Each generation request is validated
(schemas.py), rendered and tokenized, then queued in the engine; the handler waits
for it to start (bounded by the queue timeout) and then either collects the answer or
streams Server-Sent Events (the bodies: responses.py, anthropic_reply.py,
responses_reply.py), with keep-alive comments while nothing else is sent. A client that disconnects cancels its request. Errors come as
the API's own error body (Anthropic's on the /v1/messages routes, OpenAI's elsewhere).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute

from ..runtime import heap
from ..runtime.engine import (
    EngineClosed,
    QueueFull,
    QueueTimeout,
    release_thread_streams,
)
from ..runtime.events import (
    ContextLengthError,
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    RequestError,
    Resumed,
    Started,
)
from ..runtime.grammar import Grammar
from ..runtime.pipeline import PipelineError
from . import (
    anthropic,
    anthropic_options,
    anthropic_reply,
    responses_api,
    responses_compact,
    responses_reply,
    structured,
)
from .context_edits import edit_context
from .errors import APIError, ContextOverflow, bad
from .metrics import CONTENT_TYPE, Metrics
from .reasoning import prompt_opens_reasoning
from .responses import ChatFormat, CompletionFormat, TokenText, read_json
from .responses_routes import STORED_ROUTES, StoredResponses
from .responses_socket import LIMIT_SECONDS, ResponsesSocket
from .responses_store import STORED_BYTES, STORED_RESPONSES, ResponseStore
from .schemas import (
    ChatRequest,
    SamplingDefaults,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)

log = logging.getLogger("monolith.serve")
TRIM_AFTER_BYTES = 2**20  # a request body this large: hand the freed heap back after it (runtime/heap.py)


@dataclass(frozen=True)
class ServerConfig:
    model_names: tuple[str, ...]  # the names /v1/models lists and requests may use
    api_key: str | None = None
    max_request_bytes: int = 8 * 2**20
    keepalive_seconds: float = 5.0  # an SSE comment line when nothing was sent for this long
    max_tokens_limit: int | None = None  # the most tokens a request may generate (None: the context)
    loopback_only: bool = True  # bound to loopback: only loopback Host headers (DNS rebinding)
    allowed_origins: tuple[str, ...] = ()  # browser origins served besides loopback pages ("*": any)
    body_timeout: float = 60.0  # seconds a request body may take to arrive (then 408)
    websocket_limit_seconds: float = LIMIT_SECONDS  # a /v1/responses WebSocket's life (responses_socket.py)
    websocket_clock: Callable[[], float] = time.monotonic  # what measures it (tests bring their own)
    response_store_size: int = STORED_RESPONSES  # the Responses API's stored responses, at most
    response_store_bytes: int = STORED_BYTES  # ... and at most this many bytes of them
    response_store_dir: str | None = None  # where they survive a restart (None: memory only)


class ServerState:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.status = "loading"  # -> "ready" or "failed"
        self.error: str | None = None
        self.engine = None
        self.defaults = SamplingDefaults()
        self.token_text: TokenText | None = None
        self.metrics = Metrics()
        self.created = int(time.time())
        self.responses = ResponseStore(config.response_store_size, config.response_store_bytes,
                                       config.response_store_dir)  # responses_routes.py

    def ready(self, engine) -> None:
        config = read_json(engine.tokenizer.path / "generation_config.json")
        self.defaults = SamplingDefaults.from_generation_config(config)
        self.token_text = TokenText(engine.tokenizer)
        self.metrics.bind(engine)
        self.engine = engine
        self.status = "ready"
        # the grammar vocabulary (seconds at 248K tokens) is built now, not on the first
        # structured request
        threading.Thread(target=_prepare_grammars, args=(engine,), name="monolith-grammar", daemon=True).start()


def _prepare_grammars(engine) -> None:
    try:
        _ = engine.grammar_tokenizer
    except Exception as e:  # noqa: BLE001 - reported; structured requests then get a clear error
        log.warning("structured output is unavailable: llguidance cannot read this tokenizer: %s", e)


def _grammar_tokenizer(engine):
    try:
        return engine.grammar_tokenizer
    except Exception as e:  # noqa: BLE001 - llguidance refused the tokenizer
        raise APIError(500, f"structured output is unavailable: llguidance cannot read this tokenizer: {e}",
                       "response_format") from None


def create_app(load: Callable[[], object], config: ServerConfig,
               on_load_failure: Callable[[Exception], None] | None = None) -> Starlette:
    """The app; `load()` runs on a background thread at startup and returns the Engine.
    If it raises, /health reports the error and `on_load_failure(error)` is called
    (the CLI uses it to stop the server)."""
    state = ServerState(config)

    def load_in_background() -> None:
        try:
            state.ready(load())
        except Exception as e:  # noqa: BLE001 - reported on /health and to the caller
            state.status, state.error = "failed", f"{type(e).__name__}: {e}" if not str(e) else str(e)
            log.error("loading failed: %s", state.error)
            if on_load_failure is not None:
                on_load_failure(e)
        finally:
            release_thread_streams()

    @asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=load_in_background, name="monolith-load", daemon=True).start()
        yield
        if state.engine is not None:
            await anyio.to_thread.run_sync(state.engine.close)
        await anyio.to_thread.run_sync(state.responses.close)  # the stored responses queued for the disk

    handlers = _Handlers(state)
    stored = StoredResponses(state.responses)
    routes = [
        Route("/health", handlers.health, methods=["GET"]),
        Route("/v1/models", handlers.endpoint("models", handlers.models), methods=["GET"]),
        Route("/v1/chat/completions", handlers.endpoint("chat", handlers.chat), methods=["POST"]),
        Route("/v1/completions", handlers.endpoint("completions", handlers.completions), methods=["POST"]),
        Route("/v1/messages", handlers.endpoint("messages", handlers.messages, anthropic_error), methods=["POST"]),
        Route("/v1/messages/count_tokens", handlers.endpoint("count_tokens", handlers.count_tokens, anthropic_error),
              methods=["POST"]),
        Route("/metrics", handlers.endpoint("metrics", handlers.metrics), methods=["GET"]),
        Route("/v1/responses", handlers.endpoint("responses", handlers.responses), methods=["POST"]),
        Route("/v1/responses/input_tokens", handlers.endpoint("responses", handlers.input_tokens), methods=["POST"]),
        Route("/v1/responses/compact", handlers.endpoint("responses", handlers.compact), methods=["POST"]),
        *[Route(path, handlers.endpoint("responses", _json(getattr(stored, name))), methods=[method])
          for path, method, name in STORED_ROUTES],
        WebSocketRoute("/v1/responses", ResponsesSocket(handlers, config.websocket_limit_seconds,
                                                        config.websocket_clock).serve),
    ]

    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       code=code))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.monolith = state
    return app


def _json(handler):
    """A handler that returns a JSON body, as a starlette endpoint."""

    async def run(request: Request) -> Response:
        return JSONResponse(await handler(request))

    return run


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def anthropic_error(e: APIError) -> JSONResponse:
    return JSONResponse(anthropic_reply.error_body(e), status_code=e.status)


class _Handlers:
    def __init__(self, state: ServerState):
        self.state = state

    def endpoint(self, name: str, handler, render: Callable[[APIError], Response] = error_response):
        """Authorization, error bodies for every failure (`render`: OpenAI's shape unless
        the API has its own), request counting."""

        async def run(request: Request) -> Response:
            try:
                self._check_origin(request)
                self._authorize(request)
                response = await handler(request)
            except ContextOverflow as e:  # each API words it as its own
                response = render(e.worded_for(name))
            except APIError as e:
                response = render(e)
            except Exception:
                log.exception("%s %s failed", request.method, request.url.path)
                response = render(APIError(500, "internal server error (the server log has the details)",
                                           code="internal_error"))
            self.state.metrics.requests.labels(name, str(response.status_code)).inc()
            if getattr(request.state, "body_bytes", 0) >= TRIM_AFTER_BYTES:  # its copies are freed now
                heap.trim()
            return response

        return run

    def _check_origin(self, request: Request) -> None:
        """Bound to loopback, only a loopback Host is served: a page whose own name
        resolves to 127.0.0.1 (DNS rebinding) sends its name. A browser page of another
        origin (its Origin header) is refused unless --allowed-origins names it; pages
        served from loopback are trusted, as clients without an Origin are."""
        config = self.state.config
        host = request.headers.get("host", "")
        if config.loopback_only and not _loopback(_hostname(host)):
            raise APIError(403, f"the Host header {host[:80]!r} is not this machine's loopback address: a server "
                                "bound to loopback answers only requests addressed to localhost or 127.0.0.1",
                           code="host_not_allowed")
        origin = request.headers.get("origin")
        if origin is None or "*" in config.allowed_origins or origin in config.allowed_origins:
            return
        scheme, _, rest = origin.partition("://")
        if scheme in ("http", "https") and _loopback(_hostname(rest)):
            return
        raise APIError(403, f"requests from the browser origin {origin[:80]!r} are not allowed; start the server "
                            "with --allowed-origins to allow it", code="origin_not_allowed")

    def _authorize(self, request: Request) -> None:
        key = self.state.config.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "missing or invalid API key: send the header Authorization: Bearer KEY "
                           "(or x-api-key: KEY)", code="invalid_api_key")

    def _engine(self):
        state = self.state
        if state.status == "ready":
            if state.engine.down:
                raise APIError(503, f"the model is unavailable: {state.engine.down}", code="model_unavailable")
            return state.engine
        if state.status == "failed":
            raise APIError(503, f"the model failed to load: {state.error}", code="model_load_failed")
        raise APIError(503, "the model is still loading; retry when GET /health answers 200", code="model_loading")

    # ---------------------------------------------------------------- simple endpoints

    async def health(self, request: Request) -> Response:
        try:
            self._check_origin(request)
        except APIError as e:
            return error_response(e)
        state = self.state
        if state.status == "ready" and state.engine.down:
            return JSONResponse({"status": "unhealthy", "message": state.engine.down}, status_code=503)
        if state.status == "ready":
            return JSONResponse({"status": "ok"})
        body = {"status": state.status}
        if state.error:
            body["message"] = state.error
        return JSONResponse(body, status_code=503)

    async def models(self, request: Request) -> Response:
        state = self.state
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "monolith"}
                for name in state.config.model_names]
        if state.engine is not None:
            for entry in data:
                entry["max_model_len"] = state.engine.max_context
        return JSONResponse({"object": "list", "data": data})

    async def metrics(self, request: Request) -> Response:
        return Response(self.state.metrics.render(), media_type=CONTENT_TYPE)

    # ---------------------------------------------------------------- generation

    async def chat(self, request: Request) -> Response:
        engine = self._engine()
        started = time.monotonic()
        req = parse_chat_request(await self._body(request), self.state.defaults)
        name = self._model(req.model)

        def chat_format(reasoning_open: bool) -> ChatFormat:
            return ChatFormat(name, self.state.token_text, req.logprobs is not None, req.tools, reasoning_open)

        return await self.generate_chat(request, engine, req, chat_format, started)

    async def encode_chat(self, engine, req: ChatRequest) -> tuple[list[int], bool, Grammar | None]:
        """(prompt ids, the prompt opens reasoning, the output's grammar) of a chat request,
        on a worker thread (the template, the tokenizer and a grammar's check take time)."""

        def encode() -> tuple[list[int], bool, Grammar | None]:
            try:
                text = engine.tokenizer.apply_chat_template(req.messages, req.tools, **req.template_kwargs)
            except ValueError as e:  # TokenizerError: the template refused the conversation
                raise bad(str(e), "messages") from None
            _fits(engine, text, "messages")
            reasoning = prompt_opens_reasoning(text)
            constraint = None
            if req.structure is not None:
                constraint = structured.grammar(req.structure, engine.tokenizer, reasoning)
                structured.check(req.structure, constraint, _grammar_tokenizer(engine))
            return engine.tokenizer.encode(text, add_special_tokens=False), reasoning, constraint

        return await anyio.to_thread.run_sync(encode)

    async def generate_chat(self, request: Request, engine, req: ChatRequest, make_format, started: float,
                            prompt_param: str = "messages") -> Response:
        """A chat request through the engine, its reply in the format `make_format(reasoning
        open)` builds (OpenAI's chat.completion here; other APIs bring their own)."""
        job, events, fmt = await self.start_chat(engine, req, make_format, started, prompt_param, request)
        return await self._respond(request, job, events, fmt, req)

    async def start_chat(self, engine, req: ChatRequest, make_format, started: float, prompt_param: str,
                         request: Request | None = None):
        """A chat request encoded, submitted and started (`start`): (job, its events, its
        format)."""
        prompt_ids, reasoning_open, constraint = await self.encode_chat(engine, req)
        fmt = make_format(reasoning_open)
        job, events = await self.start(engine, prompt_ids, req, fmt, prompt_param, started,
                                       engine.tokenizer.message_ends(prompt_ids), constraint, request)
        return job, events, fmt

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API (anthropic.py, anthropic_reply.py)."""
        engine = self._engine()
        started = time.monotonic()
        req = anthropic.parse_messages_request(await self._body(request), self.state.defaults)
        name = self._model(req.model)
        chat, applied, _ = await anyio.to_thread.run_sync(edit_context, req, engine.tokenizer, False)
        prompt_ids, reasoning_open, constraint = await self.encode_chat(engine, chat)
        if req.thinking.budget is not None:  # a grammar ends the reasoning
            constraint = anthropic_options.budget_grammar(req.thinking, reasoning_open, constraint,
                                                          engine.tokenizer, _grammar_tokenizer(engine))
        fmt = anthropic_reply.MessagesFormat(name, req, reasoning_open, len(prompt_ids), engine.tokenizer, applied)
        return await self._generate(request, engine, prompt_ids, chat, fmt, "messages", started,
                                    engine.tokenizer.message_ends(prompt_ids), constraint)

    async def count_tokens(self, request: Request) -> Response:
        engine = self._engine()
        req = anthropic.parse_count_tokens_request(await self._body(request), self.state.defaults)
        self._model(req.model)
        chat, _, original = await anyio.to_thread.run_sync(edit_context, req, engine.tokenizer, True)
        prompt_ids, _, _ = await self.encode_chat(engine, chat)
        body = {"input_tokens": len(prompt_ids)}
        if req.edits is not None:
            body["context_management"] = {"original_input_tokens": original}
        return JSONResponse(body)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API on the chat path (responses_api.py, responses_reply.py)."""
        engine = self._engine()
        started = time.monotonic()
        call = responses_api.parse_request(await self._body(request), self.state.defaults, self.state.responses)
        name = self._model(call.request.model)
        make_format = responses_reply.format_maker(name, call, self.state.responses, engine.tokenizer)
        response = await self.generate_chat(request, engine, call.request, make_format, started, "input")
        if call.tools.omitted:  # hosted tools this server cannot run: left out, and said so
            omitted = ", ".join(dict.fromkeys(call.tools.omitted))
            log.info("responses: hosted tools left out of what the model sees: %s", omitted)
            response.headers["x-monolith-omitted-tools"] = omitted
        return response

    async def input_tokens(self, request: Request) -> Response:
        """POST /v1/responses/input_tokens: the prompt tokens a Responses request would take."""
        engine = self._engine()
        call = responses_api.parse_request(await self._body(request), self.state.defaults, self.state.responses)
        self._model(call.request.model)
        prompt_ids, _, _ = await self.encode_chat(engine, call.request)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prompt_ids)})

    async def compact(self, request: Request) -> Response:
        """POST /v1/responses/compact: the conversation summarized by the model (responses_compact.py)."""
        engine = self._engine()
        started = time.monotonic()
        req, kept = responses_compact.parse_compact(await self._body(request), self.state.defaults,
                                                    self.state.responses)
        self._model(req.model)
        return await self.generate_chat(request, engine, req, lambda opened: responses_compact.CompactFormat(
            kept, opened), started, "input")

    async def completions(self, request: Request) -> Response:
        engine = self._engine()
        started = time.monotonic()
        req = parse_completion_request(await self._body(request), self.state.defaults)
        name = self._model(req.model)
        if isinstance(req.prompt, str):
            _fits(engine, req.prompt, "prompt")
            prompt_ids = await anyio.to_thread.run_sync(engine.tokenizer.encode, req.prompt)
        else:
            prompt_ids = req.prompt
        fmt = CompletionFormat(name, self.state.token_text, req.logprobs is not None)
        return await self._generate(request, engine, prompt_ids, req, fmt, "prompt", started)

    async def _body(self, request: Request) -> dict:
        """The JSON body; 413 as soon as it is known to exceed the limit (from
        Content-Length, before reading; or while reading a chunked body)."""
        limit = self.state.config.max_request_bytes
        length = request.headers.get("content-length")
        too_big = APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
        if length is not None:
            if not length.isdigit():
                raise bad("invalid Content-Length header")
            if int(length) > limit:
                raise too_big
        chunks, size = [], 0
        timeout = self.state.config.body_timeout
        try:
            with anyio.fail_after(timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                           code="request_timeout") from None
        request.state.body_bytes = size
        if not size:
            raise bad("the request body is empty: send a JSON object")
        return parse_json_body(b"".join(chunks))

    def _model(self, model: str | None) -> str:
        names = self.state.config.model_names
        if model is None:
            return names[0]
        if model not in names:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {', '.join(names)}",
                           "model", "model_not_found")
        return model

    async def _generate(self, request: Request, engine, prompt_ids, req, fmt, prompt_param: str,
                        started: float, boundaries: list[int] = (), constraint: Grammar | None = None) -> Response:
        job, events = await self.start(engine, prompt_ids, req, fmt, prompt_param, started, boundaries, constraint,
                                       request)
        return await self._respond(request, job, events, fmt, req)

    async def start(self, engine, prompt_ids, req, fmt, prompt_param: str, started: float,
                    boundaries: list[int] = (), constraint: Grammar | None = None, request: Request | None = None):
        """Submit a request to the engine and wait until it has left the queue (bounded by
        its deadline) and resumed: (the job, its events). The job is cancelled if this is
        cancelled, or if `request`'s client disconnects meanwhile."""
        limit, max_tokens = self.state.config.max_tokens_limit, req.max_tokens
        if limit is not None:
            max_tokens = limit if max_tokens is None else min(max_tokens, limit)
        gen = GenerationRequest(tuple(prompt_ids), max_tokens, req.params, req.stop, req.logprobs,
                                tuple(boundaries), constraint)
        events = _EventBridge(asyncio.get_running_loop(), self.state.metrics, started)
        try:
            job = engine.submit(gen, events.put)
        except ContextLengthError as e:
            raise ContextOverflow(e.prompt_tokens, e.max_context, prompt_param) from None
        except RequestError as e:
            raise bad(str(e), prompt_param if e.field == "prompt" else e.field) from None
        except QueueFull as e:
            raise APIError(429, f"{e}; retry later", code="queue_full") from None
        except EngineClosed:
            raise APIError(503, "the server is shutting down", code="shutting_down") from None
        by_id = hasattr(fmt, "submitted")  # a format whose response can be cancelled by id (responses_routes.py)
        if by_id:
            fmt.submitted(job)
        try:
            cached = await self._wait_started(request, job, events, by_id)
        except BaseException:
            _end(job, fmt)
            raise
        if hasattr(fmt, "resumed"):  # a format that reports the cache's hits before the first token
            fmt.resumed(cached)
        return job, events

    async def _respond(self, request: Request, job, events: _EventBridge, fmt, req) -> Response:
        """A started request's reply: streamed, or collected."""
        if req.stream:
            return StreamingResponse(self._stream(job, events, fmt, req.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        try:
            while True:
                event = await events.get()
                if isinstance(event, Delta):
                    fmt.collect(event)
                elif isinstance(event, Finished):
                    return JSONResponse(fmt.response(event))
                elif isinstance(event, Failed):
                    raise _engine_error(event.error)
        finally:
            watcher.cancel()
            _end(job, fmt)

    async def _wait_started(self, request: Request | None, job, events: _EventBridge, by_id: bool = False) -> int:
        """Wait until the request has left the queue (bounded by its deadline) and resumed:
        the prompt tokens it resumed with. Cancelled before that, it is a 499 (its client
        has gone), unless it can be cancelled `by_id`: then its format finishes it."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job)) if request is not None else None
        started = False
        try:
            while True:
                left = job.deadline - time.monotonic()
                if left <= 0 and not started:
                    raise _engine_error(QueueTimeout("the request timed out waiting in the queue"))
                try:
                    event = await events.get(None if started else left)
                except asyncio.TimeoutError:
                    continue
                if isinstance(event, Started):
                    started = True
                elif isinstance(event, Resumed):
                    return event.cached_tokens
                elif isinstance(event, Failed):
                    raise _engine_error(event.error)
                elif isinstance(event, Finished) and by_id:
                    events.unget(event)  # for the format's finished response
                    return 0
                elif isinstance(event, Finished):  # cancelled while queued or prefilling: the client has gone
                    raise APIError(499, "the request was cancelled", code="cancelled")
        finally:
            if watcher is not None:
                watcher.cancel()

    async def progress(self, events: _EventBridge, fmt, include_usage: bool):
        """A started request's stream chunks (dicts, not yet numbered or framed), as the
        engine produces them: None when nothing came for `keepalive_seconds`, and last an
        APIError if generation failed. The caller cancels the job when it is done."""
        keepalive = self.state.config.keepalive_seconds
        for chunk in fmt.stream_start(include_usage):
            yield chunk
        while True:
            try:
                event = await events.get(keepalive)
            except asyncio.TimeoutError:
                yield None
                continue
            if isinstance(event, Delta):
                for chunk in fmt.stream_delta(event, include_usage):
                    yield chunk
            elif isinstance(event, Finished):
                for chunk in fmt.stream_finish(event, include_usage):
                    yield chunk
                return
            elif isinstance(event, Failed):
                yield _engine_error(event.error)
                return

    async def _stream(self, job, events: _EventBridge, fmt, include_usage: bool):
        """Server-Sent Events of `progress`."""
        try:
            async with aclosing(self.progress(events, fmt, include_usage)) as chunks:
                async for chunk in chunks:
                    if chunk is None:
                        yield fmt.keepalive()
                    elif isinstance(chunk, APIError):
                        yield fmt.failure(chunk)
                    else:
                        yield fmt.event(chunk)
            yield fmt.end()
        finally:
            _end(job, fmt)  # the client went away (the task is cancelled) or we are done


# ------------------------------------------------------------------ engine <-> asyncio


class _EventBridge:
    """Engine events (pushed on the worker thread) into an asyncio queue. The metrics of
    a request are recorded here, on the worker thread, so that a request whose client
    has gone (nobody reads its queue any more) is counted too. `get` hands out the text
    deltas that queued up while the reader was busy as one (one chunk, not one a token,
    when the event loop falls behind several streams)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: Metrics, started: float):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.metrics = metrics
        self.started = started
        self.first_token: float | None = None
        self._next = None  # an event taken off the queue behind the deltas `get` joined

    def put(self, event) -> None:
        if isinstance(event, Delta) and self.first_token is None:
            self.first_token = time.monotonic() - self.started
        elif isinstance(event, Finished):
            self.metrics.observe(event, self.first_token, time.monotonic() - self.started)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def unget(self, event) -> None:
        """Hand `event` out again, first."""
        self._next = event

    async def get(self, timeout: float | None = None):
        """The next event, within `timeout` seconds (asyncio.TimeoutError), with the
        deltas queued right behind a delta joined to it."""
        if self._next is not None:
            event, self._next = self._next, None
        elif not self.queue.empty():
            event = self.queue.get_nowait()
        else:
            event = await asyncio.wait_for(self.queue.get(), timeout)
        if not isinstance(event, Delta):
            return event
        deltas = [event]
        while not self.queue.empty():
            more = self.queue.get_nowait()
            if not isinstance(more, Delta):
                self._next = more
                break
            deltas.append(more)
        return Delta.join(deltas)


async def _cancel_on_disconnect(request: Request, job) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def _end(job, fmt) -> None:
    """A request's handler is done with it: its job is cancelled (a no-op once finished)
    and a format that asks (`ended`) is told."""
    job.cancel()
    if hasattr(fmt, "ended"):
        fmt.ended()


def _fits(engine, text: str, param: str) -> None:
    """400 before tokenizing a prompt that cannot fit the context whatever it encodes to."""
    least = engine.tokenizer.min_tokens(text)
    if least + 1 > engine.max_context:
        raise ContextOverflow(least, engine.max_context, param, at_least=True)


def _hostname(host: str) -> str:
    """The name of a Host header (or an origin's authority), without the port."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _loopback(name: str) -> bool:
    if name in ("localhost", "::1") or name.endswith(".localhost"):
        return True
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "127" and all(p.isdigit() and int(p) < 256 for p in parts)


def _engine_error(error: Exception) -> APIError:
    if isinstance(error, QueueTimeout):
        return APIError(503, f"{error}; the server is busy, retry later", code="queue_timeout")
    if isinstance(error, EngineClosed):
        return APIError(503, "the server is shutting down", code="shutting_down")
    if isinstance(error, PipelineError):
        log.error("generation failed: %s", error)
        return APIError(503, str(error), code="model_unavailable")
    if isinstance(error, RequestError):  # the engine's check of the request itself
        return bad(str(error), error.field)
    # anything else, a ValueError too, is our own failure: the client's request was valid
    log.error("generation failed: %s: %s", type(error).__name__, error, exc_info=error)
    return APIError(500, "generation failed (the server log has the details)", code="internal_error")
