"""The handlers every API's routes call (serving/NAME/routes.py), on the engine driving
of driving.py: the request's body, its model (held until the request ends) and the name
it is served under, and a chat request encoded (template, images, grammar) and run
(`generate_chat`). app.py wraps each route's handler (`endpoint`: the access checks, the
API's error body, request counts) and builds the state they read (app.ServerState: the
config, the model pool, metrics, the images seen before); a request runs one way, app ->
the API's routes -> these handlers -> driving -> the engine."""

from __future__ import annotations

import time
from typing import NamedTuple

import anyio
from starlette.requests import Request
from starlette.responses import Response

from ..runtime.grammar import Grammar
from . import structured
from .driving import Driver, Prompt
from .errors import APIError, ContextOverflow, bad
from .images import ImageLoader, prompt_ids
from .models import keep_alive_seconds
from .reasoning import prompt_opens_reasoning
from .requests import ChatRequest, parse_json_body


class EncodedChat(NamedTuple):
    """A chat request ready for the engine (`encode_chat`)."""

    ids: list[int]  # the prompt, each image's <|image_pad|> run expanded
    reasoning_open: bool  # the prompt opens a reasoning block
    constraint: Grammar | None  # the output's grammar
    images: tuple  # models.image_inputs.PreparedImage in prompt order (CountedImage when counting)


class Handlers(Driver):
    """What each API's routes (app.API_ROUTES) and the Responses WebSocket reach the app
    by: the body, the model and its name, a chat request run (`state`: app.ServerState)."""

    async def arrive(self, request: Request) -> tuple[float, dict, object, str]:
        """A request to an API route as it arrives: (when it did, its JSON body, the model
        it names, held, and that model's name: `model_for`)."""
        started = time.monotonic()
        body = await self.read_body(request)
        model, name = await self.model_for(request, body)
        return started, body, model, name

    async def model_for(self, connection, body: dict) -> tuple[object, str]:
        """The loaded model a request body names (its "model"; without one the default)
        and the name it is served under, loaded first if need be (models.ModelPool.hold:
        503 during the start-up load, or when it cannot load), and held until
        `release(connection)`: the endpoint does that when its handler returns. An
        unknown name is a 404. Takes the body's `keep_alive` (our extension) out of it."""
        keep_alive = keep_alive_seconds(body.pop("keep_alive", None)) if isinstance(body, dict) else None
        model = body.get("model") if isinstance(body, dict) else None
        name = self.model_name(model if isinstance(model, str) else None)
        lease = await self.state.pool.hold(name, keep_alive)
        leases = getattr(connection.state, "leases", [])
        connection.state.leases = leases + [lease]
        engine = lease.served.engine
        if engine.down:
            raise APIError(503, f"the model is unavailable: {engine.down}", code="model_unavailable")
        return lease.served, name

    def release(self, connection) -> None:
        """Let go of the models `model_for` gave `connection`'s request."""
        for lease in getattr(connection.state, "leases", ()):
            lease.release()
        connection.state.leases = []

    # ---------------------------------------------------------------- generation

    def prompt_images(self, engine, count_only: bool = False) -> ImageLoader:
        """What loads a request's images (images.py), under this server's limits."""
        return ImageLoader(engine.vision, self.state.config.images, count_only, self.state.recent_images)

    async def encode_chat(self, engine, req: ChatRequest, images: ImageLoader | None = None) -> EncodedChat:
        """A chat request's prompt ids, images and grammar, on a worker thread (the
        template, the images, the tokenizer and a grammar's check take time). `images`:
        what loads them (default: `prompt_images`)."""
        images = images or self.prompt_images(engine)

        def encode() -> EncodedChat:
            try:
                text = engine.tokenizer.apply_chat_template(req.messages, req.tools, **req.template_kwargs)
            except ValueError as e:  # TokenizerError: the template refused the conversation
                raise bad(str(e), "messages") from None
            self.fits(engine, text, "messages")
            reasoning = prompt_opens_reasoning(text)
            structure = req.structure or structured.calls_once_opened(req.tools, engine.tokenizer)
            constraint = structured.constraint(structure, engine, reasoning)
            loaded = images.of(req.messages)
            return EncodedChat(prompt_ids(engine.tokenizer, text, loaded, engine.vision), reasoning, constraint,
                               tuple(loaded))

        return await anyio.to_thread.run_sync(encode)

    async def generate_chat(self, request: Request, engine, req: ChatRequest, make_format, started: float,
                            prompt_param: str = "messages") -> Response:
        """A chat request through the engine, its reply in the format `make_format(reasoning
        open)` builds (each API brings its own: OpenAI's chat.completion, ...)."""
        job, events, fmt = await self.start_chat(engine, req, make_format, started, prompt_param, request)
        return await self.respond(request, job, events, fmt, req)

    async def start_chat(self, engine, req: ChatRequest, make_format, started: float, prompt_param: str,
                         request: Request | None = None):
        """A chat request encoded, submitted and started (`start`): (job, its events, its
        format)."""
        prompt = await self.encode_chat(engine, req)
        fmt = make_format(prompt.reasoning_open)
        submitted = Prompt(prompt.ids, prompt_param, engine.tokenizer.message_ends(prompt.ids), prompt.constraint,
                           prompt.images, req.draft)
        job, events = await self.start(engine, req, fmt, submitted, started, request)
        return job, events, fmt

    async def read_body(self, request: Request) -> dict:
        """The JSON body; 413 as soon as it is known to exceed the limit (from
        Content-Length, before reading; or while reading a chunked body)."""
        limit = self.state.config.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise bad("invalid Content-Length header")
            if int(length) > limit:
                raise _too_big(limit)
        chunks, size = [], 0
        timeout = self.state.config.body_timeout
        try:
            with anyio.fail_after(timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise _too_big(limit)
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                           code="request_timeout") from None
        request.state.body_bytes = size
        if not size:
            raise bad("the request body is empty: send a JSON object")
        return parse_json_body(b"".join(chunks))

    @staticmethod
    def fits(engine, text: str, param: str) -> None:
        """400 before tokenizing a prompt that cannot fit the context whatever it encodes to."""
        least = engine.tokenizer.min_tokens(text)
        if least + 1 > engine.max_context:
            raise ContextOverflow(least, engine.max_context, param, at_least=True)

    def model_name(self, model: str | None) -> str:
        names = self.state.pool.names()
        if model is None:
            return names[0]
        if model not in names:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {', '.join(names)}",
                           "model", "model_not_found")
        return model


def _too_big(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
