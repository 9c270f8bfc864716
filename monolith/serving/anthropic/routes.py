"""Anthropic's HTTP endpoints (app.py routes them: `routes`): POST /v1/messages and POST
/v1/messages/count_tokens, on the app's handlers (their access checks, engine, model
names, body reading and engine driving; `model_for` gives the request's model). The requests: requests.py; `thinking` and
`output_config`: options.py; `context_management`: context_edits.py; the
replies and Anthropic's error body: reply.py."""

from __future__ import annotations

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..driving import Prompt
from ..errors import APIError
from ..structured import grammar_tokenizer
from . import options, reply, requests
from .context_edits import edit_context


def routes(handlers) -> list[Route]:
    """The routes of Anthropic's endpoints on the app's handlers (handlers.Handlers)."""
    api = AnthropicRoutes(handlers)
    return [Route("/v1/messages", handlers.endpoint("messages", api.messages, error_response), methods=["POST"]),
            Route("/v1/messages/count_tokens", handlers.endpoint("count_tokens", api.count_tokens, error_response),
                  methods=["POST"])]


def error_response(e: APIError) -> JSONResponse:
    """An error as Anthropic's error body."""
    return JSONResponse(reply.error_body(e), status_code=e.status)


class AnthropicRoutes:
    def __init__(self, handlers):
        self.handlers = handlers

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API (requests.py, reply.py)."""
        handlers = self.handlers
        started, body, model, name = await handlers.arrive(request)
        engine = model.engine
        req = requests.parse_messages_request(body, model.defaults)
        images = handlers.prompt_images(engine)  # loaded once for the context edits and the prompt
        chat, applied, _ = await anyio.to_thread.run_sync(edit_context, req, engine.tokenizer, False, images)
        prompt = await handlers.encode_chat(engine, chat, images)
        constraint = prompt.constraint
        if req.thinking.budget is not None:  # a grammar ends the reasoning
            constraint = options.budget_grammar(req.thinking, prompt.reasoning_open, constraint,
                                                          engine.tokenizer, grammar_tokenizer(engine))
        fmt = reply.MessagesFormat(name, req, prompt.reasoning_open, len(prompt.ids), engine.tokenizer,
                                             applied)
        submitted = Prompt(prompt.ids, "messages", engine.tokenizer.message_ends(prompt.ids), constraint,
                           prompt.images, chat.draft)
        return await handlers.generate(request, engine, chat, fmt, submitted, started)

    async def count_tokens(self, request: Request) -> Response:
        handlers = self.handlers
        _, body, model, _ = await handlers.arrive(request)
        engine = model.engine
        req = requests.parse_count_tokens_request(body, model.defaults)
        images = handlers.prompt_images(engine, count_only=True)  # an image's tokens follow from its size
        chat, _, original = await anyio.to_thread.run_sync(edit_context, req, engine.tokenizer, True, images)
        prompt = await handlers.encode_chat(engine, chat, images)
        body = {"input_tokens": len(prompt.ids)}
        if req.edits is not None:
            body["context_management"] = {"original_input_tokens": original}
        return JSONResponse(body)
