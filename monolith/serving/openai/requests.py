"""OpenAI's chat and completion requests: the field policy of POST /v1/chat/completions
and POST /v1/completions, then the chat body every API shares (../requests.py) or the
completion's prompt, into typed requests, or an `APIError` whose message names the
field (`param`).

Fields a client may send that would change the result but are not implemented
(penalties, logit_bias, n > 1, echo, audio, ...) are refused naming them, never
ignored; fields that change nothing (ids, metadata, caching and service hints) are
accepted. A JSON null means "not given", as the OpenAI API treats it. The `monolith`
field is our extension (speculation.py). docs/api-fields.md has the table of every
field and why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import bad
from ..fields import is_int, refuse_non_neutral, refuse_unknown
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
                  "n": 1, "best_of": 1, "echo": False, "suffix": "", "modalities": ["text"], "verbosity": "medium"}
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
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt"}


@dataclass(frozen=True)
class CompletionRequest(GenerationFields):
    prompt: str | list[int]


def parse_chat_request(body: dict, defaults: SamplingDefaults = SamplingDefaults()) -> ChatRequest:
    _check_fields(body, CHAT_FIELDS)
    request = parse_chat_body(body, defaults)
    return replace(request, spec=spec_option(body), draft=draft_option(body))


def parse_completion_request(body: dict, defaults: SamplingDefaults = SamplingDefaults()) -> CompletionRequest:
    _check_fields(body, COMPLETION_FIELDS)
    fields = generation_fields(body, defaults, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt is empty", "prompt")
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        if min(prompt) < 0:
            raise bad("prompt token ids must be >= 0", "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("only one prompt per request is supported (batches of prompts are not)", "prompt")
    elif prompt is None:
        raise bad("prompt is required", "prompt")
    else:
        raise bad("prompt must be a non-empty string or a non-empty list of token ids", "prompt")
    return CompletionRequest(**vars(fields), prompt=prompt)


def _check_fields(body: dict, known: set[str]) -> None:
    given = {k for k, v in body.items() if v is not None}  # null: not given
    refused = sorted(given & set(REFUSED_FIELDS))
    if refused:
        raise bad(f"{refused[0]}: {REFUSED_FIELDS[refused[0]]}", refused[0])
    refuse_unknown(given, set(known) | INERT_FIELDS | set(NEUTRAL_VALUES))
    refuse_non_neutral(body, NEUTRAL_VALUES, {"n": "only n=1 is supported", "best_of": "only best_of=1 is supported"})
