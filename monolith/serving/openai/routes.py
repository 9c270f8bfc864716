"""OpenAI's chat and completions endpoints (app.py routes them: `routes`): POST
/v1/chat/completions and POST /v1/completions (batched completions: scoring.py), and
vLLM's /tokenize, /detokenize and /tokenizer_info (tokenization.py), on the app's
handlers (their access checks, engine, model names, body reading and engine driving;
`model_for` gives the request's model). The requests: requests.py; the replies:
reply.py."""

from __future__ import annotations

from functools import partial

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..driving import Prompt
from . import scoring, tokenization
from .reply import ChatFormat, CompletionFormat
from .requests import parse_chat_request, parse_completion_request


def routes(handlers) -> list[Route]:
    """The routes of OpenAI's chat and completions endpoints on the app's handlers
    (handlers.py, wrapped by app.Endpoints.endpoint)."""
    api = OpenAIRoutes(handlers)
    return [Route("/v1/chat/completions", handlers.endpoint("chat", api.chat), methods=["POST"]),
            Route("/v1/completions", handlers.endpoint("completions", api.completions), methods=["POST"]),
            *tokenization.routes(handlers)]


class OpenAIRoutes:
    def __init__(self, handlers):
        self.handlers = handlers

    async def chat(self, request: Request) -> Response:
        handlers = self.handlers
        started, body, model, name = await handlers.arrive(request)
        engine = model.engine
        req = parse_chat_request(body, model.defaults)

        # the format, given whether the prompt opens a reasoning block (made by the handlers, no call back here)
        chat_format = partial(ChatFormat, name, model.token_text, req.logprobs is not None, req.tools, spec=req.spec)
        return await handlers.generate_chat(request, engine, req, chat_format, started)

    async def completions(self, request: Request) -> Response:
        handlers = self.handlers
        started, body, model, name = await handlers.arrive(request)
        engine = model.engine
        req = parse_completion_request(body, model.defaults)
        if req.batched:
            return await scoring.complete(handlers, request, model, name, req, started)
        prompt_ids = await scoring.prompt_ids(handlers, engine, req.prompts[0])
        fmt = CompletionFormat(name, model.token_text, req.logprobs is not None)
        return await handlers.generate(request, engine, req, fmt, Prompt(prompt_ids, "prompt"), started)
