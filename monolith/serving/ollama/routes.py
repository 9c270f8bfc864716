"""Ollama's API on the same port (app.py routes it: `routes`): POST /api/chat and
/api/generate, GET /api/tags, POST /api/show, GET /api/ps, GET /api/version and POST
/api/pull, on the app's handlers (their access checks, models, body reading and engine
driving). What Ollama has and this server does not (embeddings, creating, copying,
deleting and pushing models, blobs) answers Ollama's error body with 501, any other path
under /api/ a 404, a known path with another method a 405: every error on /api/ is
Ollama's {"error": "..."}, which its clients print. The requests: requests.py; the
replies: reply.py."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import NamedTuple

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import structured
from ..driving import Prompt
from ..errors import APIError, ContextOverflow, bad
from ..fields import parse
from . import reply
from .requests import NamedBody, parse_chat, parse_generate, renamed

GENERATION = {"/api/chat": "POST", "/api/generate": "POST"}
OTHERS = {"/api/tags": "GET", "/api/show": "POST", "/api/ps": "GET", "/api/version": "GET", "/api/pull": "POST"}
ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
NOT_HERE = {  # Ollama's endpoints this server does not have: why
    "/api/embed": "embeddings are not supported: the served models are generative",
    "/api/embeddings": "embeddings are not supported: the served models are generative",
    "/api/create": "creating models is not supported: the models are the ones the server was started with",
    "/api/copy": "copying models is not supported: the models are the ones the server was started with",
    "/api/delete": "deleting models is not supported: the models are the ones the server was started with",
    "/api/push": "pushing models is not supported: this server has no registry",
    "/api/blobs": "blobs are not supported: models cannot be created here",
}


def routes(handlers) -> list[Route]:
    """The routes of Ollama's API on the app's handlers (handlers.Handlers)."""
    api = OllamaRoutes(handlers)

    def endpoint(name, handler):
        return handlers.endpoint(name, handler, error_response)

    return [Route("/api/chat", endpoint("ollama_chat", api.chat), methods=["POST"]),
            Route("/api/generate", endpoint("ollama_generate", api.generate), methods=["POST"]),
            Route("/api/tags", endpoint("ollama_tags", api.tags), methods=["GET", "HEAD"]),
            Route("/api/show", endpoint("ollama_show", api.show), methods=["POST"]),
            Route("/api/ps", endpoint("ollama_ps", api.ps), methods=["GET", "HEAD"]),
            Route("/api/version", endpoint("ollama_version", api.version), methods=["GET", "HEAD"]),
            Route("/api/pull", endpoint("ollama_pull", api.pull), methods=["POST"]),
            Route("/api/{rest:path}", endpoint("ollama_other", api.other), methods=ANY_METHOD)]


def error_response(e: APIError) -> JSONResponse:
    """An error as Ollama's error body."""
    return JSONResponse(reply.error_body(e), status_code=e.status)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("monolith")
    except PackageNotFoundError:
        return "0.0.0"


class OllamaRoutes:
    def __init__(self, handlers):
        self.handlers = handlers
        self.facts: dict[str, dict] = {}  # a model's pack_facts, from its first load on
        self.seen: dict[str, float] = {}  # when it was first loaded (its modified_at)

    # ---------------------------------------------------------------- generation

    async def chat(self, request: Request) -> Response:
        return await self._generation(request, chat=True)

    async def generate(self, request: Request) -> Response:
        return await self._generation(request, chat=False)

    async def _generation(self, request: Request, chat: bool) -> Response:
        handlers = self.handlers
        started, body, model, name = await self._arrive(request)
        held = time.monotonic()
        req = (parse_chat if chat else parse_generate)(body, model.defaults)
        if req.chat is None:  # no prompt: Ollama's load (or with keep_alive 0, unload) request
            slot = handlers.state.pool.by_name[name]
            return JSONResponse(reply.done_without_generating(name, chat, "unload" if slot.keep_alive == 0
                                                              else "load"))
        engine = model.engine
        try:
            prompt = await self._encode(engine, req)
        except APIError as e:  # the grammar's errors name OpenAI's response_format
            raise renamed(e) from None
        param = "messages" if chat else "prompt"
        chat_req = replace(req.chat, max_tokens=self._max_tokens(req, engine, len(prompt.ids), param))
        fmt = reply.OllamaFormat(name, chat, chat_req, prompt.reasoning_open, model.token_text, started, held)
        return await self._drive(request, engine, prompt, chat_req, fmt, started, param)

    async def _encode(self, engine, req):
        """The prompt: the chat rendered with the model's template (handlers.py's encode_chat),
        or a raw prompt's own tokens."""
        if req.raw_prompt is None:
            return await self.handlers.encode_chat(engine, req.chat)
        self.handlers.fits(engine, req.raw_prompt, "prompt")

        def encode():
            ids = engine.tokenizer.encode(req.raw_prompt)
            return ids, structured.constraint(req.chat.structure, engine, False)

        ids, constraint = await anyio.to_thread.run_sync(encode)
        return _Raw(ids, False, constraint, ())

    def _max_tokens(self, req, engine, prompt_tokens: int, param: str) -> int | None:
        """num_predict, within num_ctx (prompt and reply together) when that is set
        below the server's context; None: the server's default cap."""
        context = min(req.num_ctx or engine.max_context, engine.max_context)
        room = context - prompt_tokens
        if room < 1 and context == engine.max_context:
            raise ContextOverflow(prompt_tokens, context, param)
        if room < 1:
            raise bad(f"the prompt is {prompt_tokens} tokens, which leaves no room for a reply in options.num_ctx "
                      f"{context}", "options.num_ctx")
        if req.num_predict is not None and req.num_predict < 0:  # -1 / -2: up to the context
            return room
        if req.num_predict is not None:
            return min(req.num_predict, room)
        return room if req.num_ctx is not None and context < engine.max_context else None

    async def _drive(self, request, engine, prompt, req, fmt, started: float, param: str) -> Response:
        """The request through the engine (driving.py), as the other APIs' routes drive it;
        streamed as NDJSON."""
        handlers = self.handlers
        boundaries = engine.tokenizer.message_ends(prompt.ids) if param == "messages" else ()
        submitted = Prompt(prompt.ids, param, boundaries, prompt.constraint, prompt.images)
        job, events = await handlers.start(engine, req, fmt, submitted, started, request)
        if not req.stream:
            return await handlers.respond(request, job, events, fmt, req)
        return StreamingResponse(handlers.stream(job, events, fmt, False), media_type=reply.MEDIA_TYPE)

    async def _arrive(self, request: Request):
        """(when it arrived, its body, its model held, the model's name): handlers.py's arrive,
        with Ollama's `name:latest` read as `name` when the server has no such name."""
        started = time.monotonic()
        body = await self.handlers.read_body(request)
        if isinstance(body.get("model"), str):
            body["model"] = self._name(body["model"])
        held, name = await self.handlers.model_for(request, body)
        self._remember(name, held.engine)
        return started, body, held, name

    def _name(self, name: str) -> str:
        """Ollama's `NAME:latest` is NAME when the server serves NAME and not the other."""
        names = self.handlers.state.pool.names()
        return name[:-7] if name not in names and name.endswith(":latest") and name[:-7] in names else name

    def _remember(self, name: str, engine) -> None:
        if name not in self.facts:
            self.facts[name] = reply.pack_facts(engine)
            self.seen[name] = time.time()

    # ---------------------------------------------------------------- models

    async def tags(self, request: Request) -> Response:
        self._remember_loaded()
        models = []
        for slot in self.handlers.state.pool.slots:
            size = slot.footprint or slot.spec.size()
            models += [reply.tag_entry(name, size, self.facts.get(slot.name), self.seen.get(slot.name, time.time()))
                       for name in slot.spec.names]
        return JSONResponse({"models": models})

    async def ps(self, request: Request) -> Response:
        self._remember_loaded()
        pool, models = self.handlers.state.pool, []
        for slot in pool.loaded():
            engine = slot.served.engine
            idle = None if pool.busy(slot) else max(slot.last_used, engine.idle_since)
            entry = {**reply.tag_entry(slot.name, slot.footprint, self.facts.get(slot.name), self.seen[slot.name]),
                     "expires_at": reply.expires_at(slot.keep_alive, idle), "size_vram": slot.footprint,
                     "context_length": engine.max_context}
            entry.pop("modified_at")
            models.append(entry)
        return JSONResponse({"models": models})

    def _remember_loaded(self) -> None:
        for slot in self.handlers.state.pool.loaded():
            self._remember(slot.name, slot.served.engine)

    async def show(self, request: Request) -> Response:
        """A model's description; the model is loaded for it if it was not."""
        body = await self.handlers.read_body(request)
        name = self._name(parse(NamedBody, body).model_name)
        held, _ = await self.handlers.model_for(request, {"model": name})
        self._remember(name, held.engine)
        return JSONResponse(reply.show_body(held.engine, self.facts[name], self.seen[name]))

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": _version()})

    async def pull(self, request: Request) -> Response:
        """A configured model made ready: resolved, packed if need be and loaded (its
        load does all three). A name the server was not started with is a 404: nothing
        is downloaded on a client's word."""
        body = await self.handlers.read_body(request)
        req = parse(NamedBody, body)
        pool = self.handlers.state.pool
        name = self._name(req.model_name)
        if name not in pool.names():
            await self._add(name)
        if not req.stream:
            held, _ = await self.handlers.model_for(request, {"model": name})
            self._remember(name, held.engine)
            return JSONResponse({"status": "success"})
        return StreamingResponse(self._pulling(name), media_type=reply.MEDIA_TYPE)

    async def _add(self, name: str) -> None:
        """A model not configured, added to the pool when the server allows it (serve's
        --allow-pull: `pool.pull` makes its ModelSpec: a hub id or a local checkpoint,
        resolved, packed and loaded as --model would be); else a 404."""
        pool = self.handlers.state.pool
        if pool.pull is None:
            raise APIError(404, f"pull {name!r}: this server pulls only the models it was started with "
                                f"({', '.join(pool.names())}); start it with that model, or with --allow-pull to "
                                "let clients add models", "model")
        try:
            spec = await anyio.to_thread.run_sync(pool.pull, name)
        except ValueError as e:  # its flags' check (engine_setup.SetupError)
            raise bad(f"pull {name!r}: {e}", "model") from None
        if name not in pool.names():  # another pull of the same name may have added it meanwhile
            pool.add(spec)

    async def _pulling(self, name: str):
        yield reply.json_line({"status": "pulling manifest"})
        pool = self.handlers.state.pool
        slot = pool.by_name[name]
        if slot.served is None:
            yield reply.json_line({"status": f"resolving, packing and loading {name}"})
        try:
            lease = await pool.hold(name)
        except APIError as e:
            yield reply.json_line(reply.error_body(e))
            return
        try:
            self._remember(name, lease.served.engine)
            yield reply.json_line({"status": "verifying sha256 digest", "digest": self.facts[name]["digest"]})
            yield reply.json_line({"status": "success"})
        finally:
            lease.release()

    # ---------------------------------------------------------------- the rest of /api/

    async def other(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        known = {**GENERATION, **OTHERS}
        if path in known:
            raise APIError(405, f"{method} {path}: method not allowed (use {known[path]})")
        for prefix, why in NOT_HERE.items():
            if path == prefix or path.startswith(prefix + "/"):
                raise APIError(501, f"{method} {path}: {why}")
        raise APIError(404, f"{method} {path}: no such endpoint in Ollama's API on this server "
                            f"(served: {', '.join(sorted(known))})")


class _Raw(NamedTuple):
    """A raw prompt as handlers.py's EncodedChat has it."""

    ids: list[int]
    reasoning_open: bool
    constraint: object
    images: tuple
