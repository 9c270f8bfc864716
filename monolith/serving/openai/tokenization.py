"""The tokenizer over HTTP, as vLLM's OpenAI-compatible server serves it: POST /tokenize
(a `prompt`, or chat `messages` rendered by the model's template, into token ids),
POST /detokenize (ids back into text) and GET /tokenizer_info (the special tokens,
the chat template and the context). lm-eval's `local-completions` finds them on its
own (`tokenizer_backend` auto or remote) and then needs no tokenizer from a hub.

Fields that would change the answer and are not implemented (a `chat_template` of the
request's own, ...) are a 400 naming them; `model` picks the model as everywhere.
"""

from __future__ import annotations

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import bad
from ..fields import Body, Flag, Integer, Object, Text, parse
from .requests import parse_chat_request


class PromptBody(Body):
    model: Text | None = None
    prompt: Text
    add_special_tokens: Flag = True
    return_token_strs: Flag = False


class ChatPromptBody(Body):
    """A chat to render and tokenize: its messages, tools and template switches are read
    as a chat completion's are (requests.py)."""

    model: Text | None = None
    messages: list[Object]
    tools: list[Object] | None = None
    chat_template_kwargs: Object | None = None
    add_special_tokens: Flag = False
    return_token_strs: Flag = False
    add_generation_prompt: Flag | None = None
    continue_final_message: Flag = False


class DetokenizeBody(Body):
    model: Text | None = None
    tokens: list[Integer]


def routes(handlers) -> list[Route]:
    api = TokenizerRoutes(handlers)
    return [Route("/tokenize", handlers.endpoint("tokenize", api.tokenize), methods=["POST"]),
            Route("/detokenize", handlers.endpoint("detokenize", api.detokenize), methods=["POST"]),
            Route("/tokenizer_info", handlers.endpoint("tokenizer_info", api.info), methods=["GET"])]


class TokenizerRoutes:
    def __init__(self, handlers):
        self.handlers = handlers

    async def tokenize(self, request: Request) -> Response:
        _, body, model, _ = await self.handlers.arrive(request)
        tokenizer = model.engine.tokenizer
        if "messages" in body:
            req = parse(ChatPromptBody, body)
            text = await anyio.to_thread.run_sync(self._render, tokenizer, req)
        else:
            req = parse(PromptBody, body)
            text = req.prompt
        special, strs = req.add_special_tokens, req.return_token_strs
        ids = await anyio.to_thread.run_sync(lambda: tokenizer.encode(text, add_special_tokens=special))
        return JSONResponse({"count": len(ids), "max_model_len": model.engine.max_context, "tokens": ids,
                             "token_strs": [model.token_text.text(t) for t in ids] if strs else None})

    @staticmethod
    def _render(tokenizer, req: ChatPromptBody) -> str:
        """The chat prompt text of a /tokenize body with messages."""
        generation, final = req.add_generation_prompt, req.continue_final_message
        if final and generation:
            raise bad("continue_final_message and add_generation_prompt cannot both be true",
                      "continue_final_message")
        chat = parse_chat_request({"messages": req.messages, "tools": req.tools,
                                   "chat_template_kwargs": req.chat_template_kwargs})
        try:
            text = tokenizer.apply_chat_template(chat.messages, chat.tools, add_generation_prompt=not final
                                                 and generation is not False, **chat.template_kwargs)
        except ValueError as e:  # TokenizerError: the template refused the conversation
            raise bad(str(e), "messages") from None
        if final:  # the text ends where the last message's content does, as transformers cuts it
            last = chat.messages[-1].get("content")
            if not isinstance(last, str) or not last or last not in text:
                raise bad("continue_final_message needs a last message whose content is non-empty text",
                          "continue_final_message")
            text = text[:text.rindex(last) + len(last)]
        return text

    async def detokenize(self, request: Request) -> Response:
        _, body, model, _ = await self.handlers.arrive(request)
        tokens = parse(DetokenizeBody, body).tokens
        vocab = model.engine.vocab_size
        wrong = next((t for t in tokens if not 0 <= t < vocab), None)
        if wrong is not None:
            raise bad(f"token id {wrong} is out of range for a vocabulary of {vocab}", "tokens")
        decode = model.engine.tokenizer.decode
        text = await anyio.to_thread.run_sync(lambda: decode(tokens, skip_special_tokens=False))
        return JSONResponse({"prompt": text})

    async def info(self, request: Request) -> Response:
        model, _ = await self.handlers.model_for(request, dict(request.query_params))
        tokenizer, engine = model.engine.tokenizer, model.engine
        info = {"tokenizer_class": tokenizer.config.get("tokenizer_class"), **tokenizer.special_tokens,
                "chat_template": tokenizer.chat_template, "model_max_length": engine.max_context,
                "vocab_size": tokenizer.vocab_size, "eos_token_ids": sorted(engine.stop_ids)}
        return JSONResponse(info)
