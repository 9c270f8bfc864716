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
from ..fields import is_int, optional, refuse_unknown
from ..requests import parse_chat_body

PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
CHAT_FIELDS = {"model", "messages", "add_special_tokens", "return_token_strs", "add_generation_prompt",
               "continue_final_message", "chat_template_kwargs", "tools"}


def routes(handlers) -> list[Route]:
    api = TokenizerRoutes(handlers)
    return [Route("/tokenize", handlers.endpoint("tokenize", api.tokenize), methods=["POST"]),
            Route("/detokenize", handlers.endpoint("detokenize", api.detokenize), methods=["POST"]),
            Route("/tokenizer_info", handlers.endpoint("tokenizer_info", api.info), methods=["GET"])]


class TokenizerRoutes:
    def __init__(self, handlers):
        self.handlers = handlers

    async def tokenize(self, request: Request) -> Response:
        _, body, model = await self.handlers.arrive(request)
        tokenizer = model.engine.tokenizer
        strs = optional(body, "return_token_strs", bool, "true or false") or False
        if "messages" in body:
            refuse_unknown({k for k, v in body.items() if v is not None}, CHAT_FIELDS)
            special = optional(body, "add_special_tokens", bool, "true or false") or False
            text = await anyio.to_thread.run_sync(self._render, tokenizer, body)
        else:
            refuse_unknown({k for k, v in body.items() if v is not None}, PROMPT_FIELDS)
            text = body.get("prompt")
            if not isinstance(text, str):
                raise bad("prompt must be a string (or send messages)", "prompt")
            special = optional(body, "add_special_tokens", bool, "true or false")
            special = True if special is None else special
        ids = await anyio.to_thread.run_sync(lambda: tokenizer.encode(text, add_special_tokens=special))
        return JSONResponse({"count": len(ids), "max_model_len": model.engine.max_context, "tokens": ids,
                             "token_strs": [model.token_text.text(t) for t in ids] if strs else None})

    @staticmethod
    def _render(tokenizer, body: dict) -> str:
        """The chat prompt text of a /tokenize body with messages."""
        generation = optional(body, "add_generation_prompt", bool, "true or false")
        final = optional(body, "continue_final_message", bool, "true or false") or False
        if final and generation:
            raise bad("continue_final_message and add_generation_prompt cannot both be true",
                      "continue_final_message")
        chat = parse_chat_body({"messages": body["messages"], "tools": body.get("tools"),
                                "chat_template_kwargs": body.get("chat_template_kwargs")})
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
        _, body, model = await self.handlers.arrive(request)
        refuse_unknown({k for k, v in body.items() if v is not None}, {"model", "tokens"})
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
            raise bad("tokens must be a list of token ids", "tokens")
        vocab = model.engine.vocab_size
        wrong = next((t for t in tokens if not 0 <= t < vocab), None)
        if wrong is not None:
            raise bad(f"token id {wrong} is out of range for a vocabulary of {vocab}", "tokens")
        decode = model.engine.tokenizer.decode
        text = await anyio.to_thread.run_sync(lambda: decode(tokens, skip_special_tokens=False))
        return JSONResponse({"prompt": text})

    async def info(self, request: Request) -> Response:
        model = await self.handlers.model_for(request, dict(request.query_params))
        tokenizer, engine = model.engine.tokenizer, model.engine
        info = {"tokenizer_class": tokenizer.config.get("tokenizer_class"), **tokenizer.special_tokens,
                "chat_template": tokenizer.chat_template, "model_max_length": engine.max_context,
                "vocab_size": tokenizer.vocab_size, "eos_token_ids": sorted(engine.stop_ids)}
        return JSONResponse(info)
