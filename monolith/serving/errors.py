"""The error every endpoint answers with: OpenAI's {"error": {message, type, param, code}};
the context-overflow error, worded per API; refusals logged (`log_refusal`)."""

from __future__ import annotations

import logging

log = logging.getLogger("monolith.serve")
MAX_LOGGED_REASON = 500  # characters of a refusal's message in the log


class APIError(Exception):
    """An error answered with the OpenAI error body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _default_type(status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def log_refusal(where: str, e: APIError) -> APIError:
    """A refusal (4xx) at INFO: where, the status, the param and the reason, never the
    body, so that an operator sees why a request was refused (uvicorn's access line has
    the status only). `e`, for the caller to answer with."""
    if 400 <= e.status < 500:
        log.info("%s refused: %d%s: %s", where, e.status, f" (param {e.param})" if e.param else "",
                 e.message[:MAX_LOGGED_REASON])
    return e


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


class ContextOverflow(APIError):
    """A prompt of `tokens` tokens (`at_least`: a lower bound, known before tokenizing)
    that leaves no room for one generated token in a context of `context` tokens. Raised
    in OpenAI chat's words; the endpoint answers `context_overflow(api, ...)` instead."""

    def __init__(self, tokens: int, context: int, param: str, at_least: bool = False):
        self.tokens, self.context, self.at_least = tokens, context, at_least
        error = context_overflow("chat", tokens, context, param, at_least)
        super().__init__(error.status, error.message, error.param, error.code)

    def worded_for(self, api: str) -> APIError:
        return context_overflow(api, self.tokens, self.context, self.param, self.at_least)


def context_overflow(api: str, tokens: int, context: int, param: str, at_least: bool = False) -> APIError:
    """The 400 for a prompt of `tokens` tokens ("at least" that many with `at_least`) that
    does not fit a context of `context` tokens with one generated token, worded as the
    API (the endpoint: chat, completions, responses, messages, count_tokens) words its
    own, since clients match on it: Claude Code compacts on Anthropic's "prompt is too
    long: N tokens > M maximum" (M: the most prompt tokens that fit), LiteLLM, Aider and
    OpenCode read OpenAI's "maximum context length is M tokens", Codex reads the code."""
    n = f"at least {tokens}" if at_least else str(tokens)
    needed = f"at least {tokens + 1}" if at_least else str(tokens + 1)
    if api in ("messages", "count_tokens"):
        message = f"prompt is too long: {n} tokens > {context - 1} maximum"
    elif api == "responses":
        message = ("Your input exceeds the context window of this model. Please adjust your input and try again. "
                   f"The input is {n} tokens; this model's context window is {context} tokens.")
    elif api == "completions":
        message = (f"This model's maximum context length is {context} tokens, however you requested {needed} tokens "
                   f"({n} in your prompt; 1 for the completion). Please reduce your prompt; or completion length.")
    elif tokens > context:  # the messages alone overflow
        message = (f"This model's maximum context length is {context} tokens. However, your messages resulted in "
                   f"{n} tokens. Please reduce the length of the messages.")
    else:  # the messages fit, the one token to generate does not
        message = (f"This model's maximum context length is {context} tokens. However, you requested {needed} tokens "
                   f"({n} in the messages, 1 in the completion). Please reduce the length of the messages or "
                   "completion.")
    return APIError(400, message, param, "context_length_exceeded")
