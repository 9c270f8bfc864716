"""OpenAI's Responses API (POST /v1/responses): a request validated and turned into a
ChatRequest (`parse_request`). `instructions` becomes the system message; `input` (a
string, or items: items.py) becomes chat messages; `previous_response_id` puts
the stored conversation (its input and output, not its instructions, as OpenAI does)
before the new input; `tools` become chat tools (tools.py: function, namespace,
custom and hosted tools); `tool_choice` and `text.format` become the grammar the chat
path already enforces. `include: ["reasoning.encrypted_content"]` seals each reasoning
item's text into its `encrypted_content` (seal.py). A field sent as `null`
counts as not given. `parallel_tool_calls:
false` makes a forced call (`tool_choice` required) a single one; under `auto` the
model's calls are returned as it wrote them. Fields that would change the result and
are not implemented are refused naming them. The reply: reply.py; the store:
store.py."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...sampling import SamplingError, SamplingParams
from ..errors import bad
from ..fields import (
    is_name,
    optional,
    positive_int,
    real,
    refuse_extra,
    refuse_non_neutral,
    refuse_unknown,
)
from ..requests import MAX_TEMPERATURE, ChatRequest, SamplingDefaults
from ..structured import Structure
from .items import items_to_messages
from .store import ResponseStore, input_items
from .tools import Tools, parse_tools, tool_choice

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
          "text", "stream", "store", "metadata", "parallel_tool_calls", "previous_response_id", "reasoning", "include"}
# reasoning.effort -> Qwen's thinking switch (the template's enable_thinking): Qwen has no
# effort levels, only thinking on or off
THINKING = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True, "max": True}
# ids, client hints and caching hints: they change nothing generated; max_tool_calls bounds
# calls to hosted tools, which run nowhere here
INERT_FIELDS = {"user", "safety_identifier", "prompt_cache_key", "service_tier", "client_metadata",
                "prompt_cache_retention", "prompt_cache_options", "stream_options", "max_tool_calls"}
NEUTRAL_VALUES = {"truncation": "disabled", "background": False, "top_logprobs": 0, "presence_penalty": 0.0,
                  "frequency_penalty": 0.0}
ENCRYPTED = "reasoning.encrypted_content"
# `include` values about items this server never writes (hosted tools' calls, input images)
INERT_INCLUDES = {"file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                  "message.input_image.image_url", "computer_call_output.output.image_url",
                  "code_interpreter_call.outputs"}
VERBOSITY = ("low", "medium", "high")
FORMAT_KEYS = {"type", "name", "schema", "strict", "description"}


@dataclass(frozen=True)
class ResponsesCall:
    request: ChatRequest
    history: list[dict]  # the conversation without the instructions: stored with the output
    echo: dict  # the request's settings as the response object reports them
    store: bool
    input: list[dict]  # the request's input as items with ids: stored for GET /v1/responses/{id}/input_items
    tools: Tools  # what the model sees of `tools`, and how its calls come back
    encrypted: bool = False  # include reasoning.encrypted_content


def parse_request(body: dict, defaults: SamplingDefaults, store: ResponseStore) -> ResponsesCall:
    body = {key: value for key, value in body.items() if value is not None}
    _check_fields(body)
    model = optional(body, "model", str, "a string")
    stream = optional(body, "stream", bool, "true or false") or False
    keep = optional(body, "store", bool, "true or false")
    parallel = optional(body, "parallel_tool_calls", bool, "true or false")
    parallel = True if parallel is None else parallel
    max_tokens = positive_int(body, "max_output_tokens")
    temperature = real(body, "temperature", defaults.temperature)
    if temperature > MAX_TEMPERATURE:
        raise bad(f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {temperature}", "temperature")
    top_p = real(body, "top_p", defaults.top_p)
    try:
        params = SamplingParams(temperature, top_p, defaults.top_k, defaults.min_p)
    except SamplingError as e:
        raise bad(str(e), e.field) from None
    instructions = optional(body, "instructions", str, "a string")
    previous = optional(body, "previous_response_id", str, "a string")
    history = list(store.get(previous, "previous_response_id")[1]) if previous is not None else []
    history += _input(body.get("input"), history)
    tools = parse_tools(body.get("tools"))
    choice, structure = tool_choice(body.get("tool_choice"), tools, parallel)
    text, form_structure = _text(body.get("text"))
    if form_structure is not None and structure is not None:
        raise bad("text.format and a tool_choice that forces a call cannot both constrain the output", "text.format")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    reasoning, template_kwargs = _reasoning(body.get("reasoning"))
    request = ChatRequest(model=model, stream=stream, include_usage=False, max_tokens=max_tokens, params=params,
                          stop=(), logprobs=None, messages=messages,
                          tools=None if choice == "none" or not tools.chat else tools.chat,
                          template_kwargs=template_kwargs, structure=structure or form_structure)
    echo = {"instructions": instructions, "max_output_tokens": max_tokens, "metadata": _metadata(body),
            "parallel_tool_calls": parallel, "previous_response_id": previous, "temperature": temperature,
            "top_p": top_p, "text": text, "tool_choice": choice, "tools": tools.echo,
            "truncation": "disabled", "reasoning": reasoning, **_settings_echo(body)}
    return ResponsesCall(request, history, echo, keep is not False,
                         input_items(body["input"]) if keep is not False else [], tools,
                         _include(body.get("include", [])))


def _include(value) -> bool:
    """Whether `include` asks for encrypted reasoning. Values about items this server
    never writes are accepted; logprobs (not written in this API) are refused."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad("include must be a list of strings", "include")
    for v in value:
        if v != ENCRYPTED and v not in INERT_INCLUDES:
            why = "logprobs are not written in this API" if v == "message.output_text.logprobs" else "unknown"
            raise bad(f"include value {v!r} is not supported ({why})", "include")
    return ENCRYPTED in value


def _settings_echo(body: dict) -> dict:
    """The response object's fields for settings this server holds fixed or only echoes."""
    max_calls = body.get("max_tool_calls")
    if max_calls is not None and (type(max_calls) is not int or max_calls < 1):
        raise bad(f"max_tool_calls must be an integer >= 1, got {json.dumps(max_calls)[:60]}", "max_tool_calls")
    echo = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "top_logprobs": 0, "background": False,
            "service_tier": "default", "max_tool_calls": max_calls}
    for name in ("safety_identifier", "prompt_cache_key"):
        echo[name] = optional(body, name, str, "a string")
    return echo


def _reasoning(value) -> tuple[dict, dict]:
    """(the response's `reasoning` echo, the chat template's kwargs) of `reasoning`:
    `effort` switches Qwen's thinking (none / minimal: off; low and up: on); `summary`
    "auto" or null (the reply's reasoning item carries the reasoning itself as
    reasoning_text; this server writes no separate summaries, so "concise" and
    "detailed" are refused)."""
    if value is None:
        return {"effort": None, "summary": None}, {}
    if not isinstance(value, dict):
        raise bad("reasoning must be an object like {\"effort\": \"medium\"}", "reasoning")
    unknown = sorted(set(value) - {"effort", "summary"})
    if unknown:
        raise bad(f"reasoning.{unknown[0]} is not supported", f"reasoning.{unknown[0]}")
    effort, summary = value.get("effort"), value.get("summary")
    if effort is not None and not is_name(effort, THINKING):
        raise bad(f"reasoning.effort must be one of {', '.join(THINKING)}, got {effort!r}", "reasoning.effort")
    if summary not in (None, "auto"):
        raise bad(f"reasoning.summary {summary!r} is not supported (this server writes no reasoning summaries; "
                  "the reasoning comes back whole as reasoning_text): use \"auto\" or null", "reasoning.summary")
    kwargs = {} if effort is None else {"enable_thinking": THINKING[effort]}
    return {"effort": effort, "summary": summary}, kwargs


def _check_fields(body: dict) -> None:
    refuse_unknown(body, FIELDS | INERT_FIELDS | set(NEUTRAL_VALUES))
    refuse_non_neutral(body, NEUTRAL_VALUES)


def _metadata(body: dict) -> dict:
    value = optional(body, "metadata", dict, "an object of strings") or {}
    if len(value) > 16:
        raise bad(f"metadata has {len(value)} keys; at most 16", "metadata")
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise bad("metadata keys must be strings of at most 64 characters and values strings of at most 512",
                      f"metadata.{key[:64]}")
    return dict(value)


def _input(value, history: list[dict]) -> list[dict]:
    if isinstance(value, str):
        if not value:
            raise bad("input is empty", "input")
        return [{"role": "user", "content": value}]
    if value is None:
        raise bad("input is required", "input")
    if not isinstance(value, list) or not value:
        raise bad("input must be a non-empty string or a non-empty list of input items", "input")
    return items_to_messages(value, "input", {c.get("id") for m in history for c in m.get("tool_calls", ())})


def _text(value) -> tuple[dict, Structure | None]:
    """(`text` as the response reports it, the Structure text.format asks for or None).
    `verbosity` is a hint to OpenAI's models that Qwen has no switch for: accepted."""
    if value is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(value, dict):
        raise bad("text must be an object like {\"format\": {\"type\": \"json_schema\", ...}}", "text")
    refuse_extra(value, {"format", "verbosity"}, "text")
    verbosity = value.get("verbosity")
    if verbosity is not None and verbosity not in VERBOSITY:
        raise bad(f"text.verbosity must be one of {', '.join(VERBOSITY)}, got {json.dumps(verbosity)[:40]}",
                  "text.verbosity")
    form, structure = _format(value.get("format"))
    return {"format": form, **({"verbosity": verbosity} if verbosity else {})}, structure


def _format(form) -> tuple[dict, Structure | None]:
    """(text.format as the response reports it, the Structure it asks for or None)."""
    if form is None:
        return {"type": "text"}, None
    if not isinstance(form, dict):
        raise bad("text.format must be an object", "text.format")
    kind = form.get("type")
    refuse_extra(form, {"type"} if kind in ("text", "json_object") else FORMAT_KEYS, "text.format")
    if kind == "text":
        return {"type": "text"}, None
    if kind == "json_object":
        return {"type": "json_object"}, Structure("json", "text.format", {"type": "object"})
    if kind != "json_schema":
        raise bad(f"text.format.type must be \"text\", \"json_object\" or \"json_schema\", got "
                  f"{json.dumps(kind)[:60]}", "text.format.type")
    schema = form.get("schema")
    if not isinstance(schema, dict):
        raise bad("text.format.schema must be a JSON schema (an object)", "text.format.schema")
    for key, want in (("name", str), ("description", str), ("strict", bool)):
        if form.get(key) is not None and not isinstance(form[key], want):
            raise bad(f"text.format.{key} must be a {want.__name__}", f"text.format.{key}")
    # echoed as the specification's response object has it: the schema itself is not repeated
    echo = {"type": "json_schema", "name": form.get("name") or "response", "description": form.get("description"),
            "schema": None, "strict": bool(form.get("strict"))}
    return echo, Structure("json", "text.format.schema", schema)

