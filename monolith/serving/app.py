"""The HTTP app (starlette) that serves the OpenAI, Anthropic and Responses APIs
(docs/serving.md is the contract). `create_app` routes:

- GET /health, GET /metrics (and /metrics/history: metrics.py), GET /v1/models;
- GET / and GET /static/...: the chat page (page.py);
- POST /v1/chat/completions and /v1/completions (OpenAI; the handlers: openai/routes.py);
- POST /v1/messages and /v1/messages/count_tokens (Anthropic; the handlers:
  anthropic/routes.py);
- POST /v1/responses, /v1/responses/input_tokens and /v1/responses/compact; for a
  stored response GET and DELETE /v1/responses/{id}, GET .../{id}/input_items and
  POST .../{id}/cancel (the handlers: responses/routes.py); and a WebSocket at
  /v1/responses (responses/websocket.py), on the same engine driving (driving.py);
- Ollama's API under /api/ (/api/chat, /api/generate, /api/tags, ...: ollama/routes.py).

Each API is a package (openai/, anthropic/, responses/, ollama/) that brings its routes
(`API_ROUTES`: each package's `routes(handlers)`), its handlers calling the common ones
(handlers.py); it imports the common core, never another API's package nor this module.
A request runs one way: the route's wrapper here (`Endpoints.endpoint`) -> the API's
handler -> handlers.py -> driving.py -> the engine.

`create_app(load, config)` answers at once and runs `load()` (which returns an
Engine) on a background thread: /health says 503 until it is done, and the
generation endpoints answer 503 meanwhile. `load` may instead be a models.ModelPool
of several models, loaded when a request names one and unloaded when idle: each
request asks it for its model (`model_for`) and holds it until the request ends.
Each generation request is validated
(its API's requests.py), rendered and tokenized, then queued in the engine; the handler waits
for it to start (bounded by the queue timeout) and then either collects the answer or
streams Server-Sent Events through the API's reply format (the Protocol:
reply_format.py), with keep-alive comments while nothing else is sent (driving.py). A
client that disconnects cancels its request. Access (Host, Origin, API key) is checked
first (access.py). Errors come as the API's own error body (Anthropic's on the
/v1/messages routes, Ollama's under /api/, OpenAI's elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NamedTuple

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..runtime import memory_trim
from . import access, page
from .anthropic import routes as anthropic_routes
from .errors import APIError, ContextOverflow, log_refusal
from .handlers import Handlers
from .images import ImageLimits, RecentImages
from .metrics import CONTENT_TYPE, SAMPLE_SECONDS, GaugeHistory, Metrics
from .models import ModelPool, ModelSpec
from .ollama import routes as ollama_routes
from .openai import routes as openai_routes
from .openai.reply import TokenText, read_json
from .requests import SamplingDefaults
from .responses import routes as responses_routes
from .responses.store import STORED_BYTES, STORED_RESPONSES, ResponseStore
from .responses.websocket import LIMIT_SECONDS

log = logging.getLogger("monolith.serve")
# the APIs: each package's `routes(handlers)` gives its endpoints (docs/serving.md,
# "Adding an API")
API_ROUTES = (openai_routes.routes, anthropic_routes.routes, responses_routes.routes, ollama_routes.routes)
TRIM_AFTER_BYTES = 2**20  # a request body this large: hand the freed heap back after it (runtime/memory_trim.py)


@dataclass(frozen=True)
class ServerConfig:
    model_names: tuple[str, ...]  # the names /v1/models lists and requests may use
    api_key: str | None = None
    max_request_bytes: int = 8 * 2**20
    keepalive_seconds: float = 5.0  # an SSE comment line when nothing was sent for this long
    max_tokens_limit: int | None = None  # the most tokens a request may generate (None: the context)
    max_output_tokens: int | None = None  # a reply's tokens when the request sets no limit (None: the model's
    # default, requests.SamplingDefaults)
    loopback_only: bool = True  # bound to loopback: only loopback Host headers (DNS rebinding)
    allowed_origins: tuple[str, ...] = ()  # browser origins served besides loopback pages ("*": any)
    body_timeout: float = 60.0  # seconds a request body may take to arrive (then 408)
    websocket_limit_seconds: float = LIMIT_SECONDS  # a /v1/responses WebSocket's life (responses/websocket.py)
    websocket_clock: Callable[[], float] = time.monotonic  # what measures it (tests bring their own)
    response_store_size: int = STORED_RESPONSES  # the Responses API's stored responses, at most
    response_store_bytes: int = STORED_BYTES  # ... and at most this many bytes of them
    response_store_dir: str | None = None  # where they survive a restart (None: memory only)
    images: ImageLimits = ImageLimits()  # what a request's images may be (images.py)


class LoadedModel(NamedTuple):
    """A loaded model as the handlers use it: its engine, the sampling defaults of its
    generation_config.json, its tokens' text."""

    engine: object
    defaults: SamplingDefaults
    token_text: TokenText

    @classmethod
    def of(cls, engine, max_output_tokens: int | None = None) -> LoadedModel:
        """`max_output_tokens`: --max-output-tokens (SamplingDefaults.from_generation_config)."""
        config = read_json(engine.tokenizer.path / "generation_config.json")
        # the grammar vocabulary (seconds at 248K tokens) is built now, not on the first
        # structured request
        threading.Thread(target=_prepare_grammars, args=(engine,), name="monolith-grammar", daemon=True).start()
        return cls(engine, SamplingDefaults.from_generation_config(config, max_output_tokens),
                   TokenText(engine.tokenizer))


class ServerState:
    def __init__(self, config: ServerConfig, pool: ModelPool):
        self.config = config
        self.pool = pool  # the models (models.py)
        pool.prepare = lambda engine: LoadedModel.of(engine, config.max_output_tokens)
        self.metrics = Metrics()
        self.metrics.bind(pool)
        self.history = GaugeHistory()  # the status tab's last minutes
        self.created = int(time.time())
        self.responses = ResponseStore(config.response_store_size, config.response_store_bytes,
                                       config.response_store_dir)  # responses/routes.py
        self.recent_images = RecentImages()  # images prepared for earlier requests (images.py)

    def defaults_for(self, engine) -> SamplingDefaults:
        """The sampling defaults (the output cap among them) of the loaded model whose
        Engine `engine` is."""
        for slot in self.pool.loaded():
            if slot.served.engine is engine:
                return slot.served.defaults
        return SamplingDefaults.from_generation_config(None, self.config.max_output_tokens)

    @property
    def status(self) -> str:
        """The start-up load's: "loading", then "ready" or "failed"."""
        return self.pool.status

    @property
    def engine(self):
        """The default model's Engine while it is loaded, else None."""
        served = self.pool.default.served
        return None if served is None else served.engine


def _prepare_grammars(engine) -> None:
    try:
        _ = engine.grammar_tokenizer
    except Exception as e:  # noqa: BLE001 - reported; structured requests then get a clear error
        log.warning("structured output is unavailable: llguidance cannot read this tokenizer: %s", e)


def create_app(load: Callable[[], object] | ModelPool, config: ServerConfig,
               on_load_failure: Callable[[Exception], None] | None = None) -> Starlette:
    """The app; `load()` runs on a background thread at startup and returns the Engine
    (served under every name of `config.model_names`), or `load` is the ModelPool of
    several models, whose default one loads at startup. If that load raises, /health
    reports the error and `on_load_failure(error)` is called (the CLI uses it to stop
    the server)."""
    pool = load if isinstance(load, ModelPool) else ModelPool([ModelSpec(config.model_names, load)])
    state = ServerState(config, pool)

    async def keep_gauges():  # the status tab's last minutes
        while True:
            if state.engine is not None:
                state.history.take(state.metrics.render)
            await anyio.sleep(SAMPLE_SECONDS)

    @asynccontextmanager
    async def lifespan(app):
        pool.start(on_load_failure)
        gauges = asyncio.get_running_loop().create_task(keep_gauges())
        yield
        gauges.cancel()
        await pool.close()
        await anyio.to_thread.run_sync(state.responses.close)  # the stored responses queued for the disk

    handlers = Endpoints(state)
    routes = [
        Route("/health", handlers.health, methods=["GET"]),
        Route("/v1/models", handlers.endpoint("models", handlers.models), methods=["GET"]),
        Route("/metrics", handlers.endpoint("metrics", handlers.metrics), methods=["GET"]),
        Route("/metrics/history", handlers.endpoint("metrics", handlers.metrics_history), methods=["GET"]),
        *[route for api_routes in API_ROUTES for route in api_routes(handlers)],
        *page.routes(handlers),  # the chat page at / (page.py)
    ]

    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)
        log_refusal(f"{request.method} {request.url.path}", error)
        return error_response(error)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.monolith = state
    return app


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class Endpoints(Handlers):
    """The handlers (handlers.py) with what the app adds: the wrapper of every route's
    handler (`endpoint`) and the app's own endpoints."""

    def endpoint(self, name: str, handler, render: Callable[[APIError], Response] = error_response):
        """Authorization, error bodies for every failure (`render`: OpenAI's shape unless
        the API has its own), request counting."""

        async def run(request: Request) -> Response:
            try:
                access.check_origin(self.state.config, request)
                access.authorize(self.state.config, request)
                response = await handler(request)
            except ContextOverflow as e:  # each API words it as its own
                response = render(log_refusal(f"{request.method} {request.url.path}", e.worded_for(name)))
            except APIError as e:
                response = render(log_refusal(f"{request.method} {request.url.path}", e))
            except Exception:
                log.exception("%s %s failed", request.method, request.url.path)
                response = render(APIError(500, "internal server error (the server log has the details)",
                                           code="internal_error"))
            finally:
                self.release(request)  # a stream runs on in the engine, which keeps its model loaded
            self.state.metrics.requests.labels(name, str(response.status_code)).inc()
            if getattr(request.state, "body_bytes", 0) >= TRIM_AFTER_BYTES:  # its copies are freed now
                memory_trim.trim()
            return response

        return run

    # ---------------------------------------------------------------- simple endpoints

    async def health(self, request: Request) -> Response:
        try:
            access.check_origin(self.state.config, request)
        except APIError as e:
            return error_response(e)
        state, engine = self.state, self.state.engine
        if state.status == "ready" and engine is not None and engine.down:
            return JSONResponse({"status": "unhealthy", "message": engine.down}, status_code=503)
        if state.status == "ready":
            return JSONResponse({"status": "ok"})
        body = {"status": state.status}
        if state.pool.error:
            body["message"] = state.pool.error
        return JSONResponse(body, status_code=503)

    async def models(self, request: Request) -> Response:
        state, data = self.state, []
        for slot in state.pool.slots:
            for name in slot.spec.names:
                entry = {"id": name, "object": "model", "created": state.created, "owned_by": "monolith",
                         "loaded": slot.served is not None, "status": slot.state}
                if slot.max_context is not None:  # known once it loaded
                    entry["max_model_len"] = slot.max_context
                if slot.served is not None:  # how it decodes (docs/serving.md, "Speculation in the stream")
                    engine = slot.served.engine
                    entry["monolith"] = {"decoding": "drafting" if engine.draft_name else "plain",
                                         "draft": engine.draft_name or engine.draft_decoder_name,
                                         "draft_on_request": engine.can_draft}
                data.append(entry)
        return JSONResponse({"object": "list", "data": data})

    async def metrics(self, request: Request) -> Response:
        return Response(self.state.metrics.render(), media_type=CONTENT_TYPE)

    async def metrics_history(self, request: Request) -> Response:
        return JSONResponse(self.state.history.as_json())
