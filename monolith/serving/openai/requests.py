"""OpenAI's chat and completion requests: the field policy of POST /v1/chat/completions
and POST /v1/completions, then the chat body every API shares (../requests.py) or the
completion's prompt, into typed requests, or an `APIError` whose message names the
field (`param`).

Fields a client may send that would change the result but are not implemented
(penalties, logit_bias, n > 1, audio, ...) are refused naming them, never
ignored; fields that change nothing (ids, metadata, caching and service hints) are
accepted. A JSON null means "not given", as the OpenAI API treats it. The `monolith`
field is our extension (speculation.py). docs/api-fields.md has the table of every
field and why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import bad
from ..fields import is_int, optional, refuse_non_neutral, refuse_unknown
from ..requests import (
    ChatRequest,
    GenerationFields,
    SamplingDefaults,
    generation_fields,
    parse_chat_body,
)
from .speculation import draft_option, spec_option

# accepted and ignored: ids, metadata, caching and service hints, and a predicted output
# (a latency hint): none changes what is generated
INERT_FIELDS = {"user", "safety_identifier", "metadata", "store", "service_tier", "prompt_cache_key",
                "prompt_cache_options", "prompt_cache_retention", "prediction"}
# accepted only at the value that means "off" (or the API's default)
NEUTRAL_VALUES = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": {},
                  "n": 1, "best_of": 1, "suffix": "", "modalities": ["text"], "verbosity": "medium"}
# refused whatever their value: what they ask for does not exist here
REFUSED_FIELDS = {"audio": "audio output is not supported", "web_search_options": "there is no web search",
                  "moderation": "no moderation model runs here",
                  "functions": "deprecated and not supported: send tools",
                  "function_call": "deprecated and not supported: send tool_choice"}
SAMPLING_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                   "seed", "stop", "logprobs"}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                 "parallel_tool_calls", "chat_template_kwargs", "response_format",
                                 "reasoning_effort", "monolith"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "echo"}


@dataclass(frozen=True)
class CompletionRequest(GenerationFields):
    prompts: tuple[str | list[int], ...]  # one choice each, in order (choice index = position)
    echo: bool = False  # the prompt before the completion, its tokens in logprobs (the first one's null)
    score_only: bool = False  # max_tokens 0: no generation (the prompt's own logprobs with echo)

    @property
    def batched(self) -> bool:
        """Answered by serving/openai/scoring.py (several prompts, echo, or no generation)."""
        return len(self.prompts) > 1 or self.echo or self.score_only


def parse_chat_request(body: dict, defaults: SamplingDefaults = SamplingDefaults()) -> ChatRequest:
    _check_fields(body, CHAT_FIELDS)
    request = parse_chat_body(body, defaults)
    return replace(request, spec=spec_option(body), draft=draft_option(body))


def parse_completion_request(body: dict, defaults: SamplingDefaults = SamplingDefaults()) -> CompletionRequest:
    _check_fields(body, COMPLETION_FIELDS)
    score_only = is_int(body.get("max_tokens")) and body["max_tokens"] == 0
    fields = generation_fields({**body, "max_tokens": None} if score_only else body, defaults, chat=False)
    echo = optional(body, "echo", bool, "true or false") or False
    request = CompletionRequest(**vars(fields), prompts=_prompts(body.get("prompt")), echo=echo,
                                score_only=score_only)
    if request.batched and request.stream:
        raise bad("stream is not supported with echo, max_tokens 0 or several prompts", "stream")
    return request


def _prompts(prompt) -> tuple[str | list[int], ...]:
    """The completion's prompts: a string, a list of token ids, or a list of either."""
    if prompt is None:
        raise bad("prompt is required", "prompt")
    one = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt))
    prompts = [prompt] if one else prompt
    if not isinstance(prompts, list) or not prompts:
        raise bad("prompt must be a non-empty string, a non-empty list of token ids, or a list of those", "prompt")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise bad("prompt is empty" if one else f"prompt[{i}] is empty", "prompt")
        elif isinstance(p, list) and p and all(is_int(t) for t in p):
            if min(p) < 0:
                raise bad("prompt token ids must be >= 0", "prompt")
        else:
            raise bad("prompt must be a non-empty string, a non-empty list of token ids, or a list of those",
                      "prompt")
    return tuple(prompts)


def _check_fields(body: dict, known: set[str]) -> None:
    given = {k for k, v in body.items() if v is not None}  # null: not given
    refused = sorted(given & set(REFUSED_FIELDS))
    if refused:
        raise bad(f"{refused[0]}: {REFUSED_FIELDS[refused[0]]}", refused[0])
    refuse_unknown(given, set(known) | INERT_FIELDS | set(NEUTRAL_VALUES))
    refuse_non_neutral(body, NEUTRAL_VALUES, {"n": "only n=1 is supported", "best_of": "only best_of=1 is supported"})
