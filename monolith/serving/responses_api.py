"""OpenAI's Responses API (POST /v1/responses): a request validated and turned into a
ChatRequest (`parse_request`). `instructions` becomes the system message; `input` (a
string, or items: responses_items.py) becomes chat messages; `previous_response_id` puts
the stored conversation (its input and output, not its instructions, as OpenAI does)
before the new input; flat function `tools` become chat tools; `tool_choice` and
`text.format` become the grammar the chat path already enforces. `parallel_tool_calls:
false` makes a forced call (`tool_choice` required) a single one; under `auto` the
model's calls are returned as it wrote them. Fields that would change the result and
are not implemented are refused naming them. The reply: responses_reply.py; the store:
responses_store.py."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..sampling import SamplingError, SamplingParams
from .errors import bad
from .responses_items import items_to_messages, string_field
from .responses_store import ResponseStore, input_items
from .schemas import (
    MAX_TEMPERATURE,
    ChatRequest,
    SamplingDefaults,
    _optional,
    _positive_int,
    _real,
)
from .structured import Structure

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
          "text", "stream", "store", "metadata", "parallel_tool_calls", "previous_response_id", "reasoning"}
# reasoning.effort -> Qwen's thinking switch (the template's enable_thinking): Qwen has no
# effort levels, only thinking on or off
THINKING = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}
# change nothing generated; max_tool_calls bounds calls to hosted tools, which run nowhere here
INERT_FIELDS = {"user", "safety_identifier", "prompt_cache_key", "service_tier", "max_tool_calls"}
NEUTRAL_VALUES = {"truncation": "disabled", "background": False, "include": [], "top_logprobs": 0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0}
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
FORMAT_KEYS = {"type", "name", "schema", "strict", "description"}


@dataclass(frozen=True)
class ResponsesCall:
    request: ChatRequest
    history: list[dict]  # the conversation without the instructions: stored with the output
    echo: dict  # the request's settings as the response object reports them
    store: bool
    input: list[dict]  # the request's input as items with ids: stored for GET /v1/responses/{id}/input_items


def parse_request(body: dict, defaults: SamplingDefaults, store: ResponseStore) -> ResponsesCall:
    _check_fields(body)
    model = _optional(body, "model", str, "a string")
    stream = _optional(body, "stream", bool, "true or false") or False
    keep = _optional(body, "store", bool, "true or false")
    parallel = _optional(body, "parallel_tool_calls", bool, "true or false")
    parallel = True if parallel is None else parallel
    max_tokens = _positive_int(body, "max_output_tokens")
    temperature = _real(body, "temperature", defaults.temperature)
    if temperature > MAX_TEMPERATURE:
        raise bad(f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {temperature}", "temperature")
    top_p = _real(body, "top_p", defaults.top_p)
    try:
        params = SamplingParams(temperature, top_p, defaults.top_k, defaults.min_p)
    except SamplingError as e:
        raise bad(str(e), e.field) from None
    instructions = _optional(body, "instructions", str, "a string")
    previous = _optional(body, "previous_response_id", str, "a string")
    history = list(store.get(previous, "previous_response_id")[1]) if previous is not None else []
    history += _input(body.get("input"), history)
    flat_tools, chat_tools = _tools(body.get("tools"))
    choice, structure = _tool_choice(body.get("tool_choice"), chat_tools, parallel)
    form, form_structure = _text(body.get("text"))
    if form_structure is not None and structure is not None:
        raise bad("text.format and a tool_choice that forces a call cannot both constrain the output", "text.format")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    reasoning, template_kwargs = _reasoning(body.get("reasoning"))
    request = ChatRequest(model=model, stream=stream, include_usage=False, max_tokens=max_tokens, params=params,
                          stop=(), logprobs=None, messages=messages, tools=None if choice == "none" else chat_tools,
                          template_kwargs=template_kwargs, structure=structure or form_structure)
    echo = {"instructions": instructions, "max_output_tokens": max_tokens, "metadata": _metadata(body),
            "parallel_tool_calls": parallel, "previous_response_id": previous, "temperature": temperature,
            "top_p": top_p, "text": {"format": form}, "tool_choice": choice, "tools": flat_tools,
            "truncation": "disabled", "reasoning": reasoning, **_settings_echo(body)}
    return ResponsesCall(request, history, echo, keep is not False,
                         input_items(body["input"]) if keep is not False else [])


def _settings_echo(body: dict) -> dict:
    """The response object's fields for settings this server holds fixed or only echoes."""
    max_calls = body.get("max_tool_calls")
    if max_calls is not None and (type(max_calls) is not int or max_calls < 1):
        raise bad(f"max_tool_calls must be an integer >= 1, got {json.dumps(max_calls)[:60]}", "max_tool_calls")
    echo = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "top_logprobs": 0, "background": False,
            "service_tier": "default", "max_tool_calls": max_calls}
    for name in ("safety_identifier", "prompt_cache_key"):
        echo[name] = _optional(body, name, str, "a string")
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
    if effort is not None and effort not in THINKING:
        raise bad(f"reasoning.effort must be one of {', '.join(THINKING)}, got {effort!r}", "reasoning.effort")
    if summary not in (None, "auto"):
        raise bad(f"reasoning.summary {summary!r} is not supported (this server writes no reasoning summaries; "
                  "the reasoning comes back whole as reasoning_text): use \"auto\" or null", "reasoning.summary")
    kwargs = {} if effort is None else {"enable_thinking": THINKING[effort]}
    return {"effort": effort, "summary": summary}, kwargs


def _check_fields(body: dict) -> None:
    unknown = sorted(k for k in body if k not in FIELDS | INERT_FIELDS | set(NEUTRAL_VALUES))
    if unknown:
        raise bad(f"unsupported field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                  "(fields that would change the result are refused, not ignored)", unknown[0])
    for name, neutral in NEUTRAL_VALUES.items():
        value = body.get(name)
        number = isinstance(neutral, float) and type(value) in (int, float)  # 0 and 0.0 alike
        if value is not None and (value != neutral or not (number or type(value) is type(neutral))):
            raise bad(f"{name} is not supported (only {json.dumps(neutral)}), got {json.dumps(value)[:60]}", name)


def _metadata(body: dict) -> dict:
    value = _optional(body, "metadata", dict, "an object of strings") or {}
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


def _tools(value) -> tuple[list[dict], list[dict] | None]:
    """(the tools as the response reports them, the chat-shaped tools)."""
    if value is None:
        return [], None
    if not isinstance(value, list):
        raise bad("tools must be a list of {\"type\": \"function\", \"name\": ...} objects", "tools")
    flat, chat, names = [], [], set()
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad(f"{at}: only function tools are supported, got type {json.dumps(kind)[:60]}", f"{at}.type")
        extra = sorted(set(tool) - TOOL_KEYS)
        if extra:
            raise bad(f"{at} has unsupported field(s): {', '.join(extra)}", f"{at}.{extra[0]}")
        name = string_field(tool, "name", at)
        if name in names:
            raise bad(f"{at}.name {name!r} is given twice", f"{at}.name")
        names.add(name)
        for key, kind, want in (("parameters", dict, "a JSON schema object"), ("description", str, "a string"),
                                ("strict", bool, "true or false")):
            if tool.get(key) is not None and not isinstance(tool[key], kind):
                raise bad(f"{at}.{key} must be {want}", f"{at}.{key}")
        fn = {"name": name, "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        chat.append({"type": "function", "function": fn})
        flat.append({"type": "function", "name": name, "description": tool.get("description"),
                     "parameters": fn["parameters"], "strict": tool.get("strict")})
    return flat, chat or None


def _tool_choice(choice, tools: list[dict] | None, parallel: bool):
    """(tool_choice as the response reports it, the Structure it forces or None)."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", None
    if choice == "required":
        if not tools:
            raise bad("tool_choice \"required\" needs tools", "tool_choice")
        return choice, Structure("tools", "tools", tools=tuple(tools), single=not parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        named = [t for t in tools or () if t["function"]["name"] == choice.get("name")]
        if not named:
            raise bad(f"tool_choice names function {json.dumps(choice.get('name'))[:60]}, which is not in tools",
                      "tool_choice.name")
        return dict(choice), Structure("tools", "tools", tools=tuple(named), single=True)
    raise bad("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}, "
              f"got {json.dumps(choice)[:80]}", "tool_choice")


def _text(value) -> tuple[dict, Structure | None]:
    """(text.format as the response reports it, the Structure it asks for or None)."""
    if value is None:
        return {"type": "text"}, None
    if not isinstance(value, dict):
        raise bad("text must be an object like {\"format\": {\"type\": \"json_schema\", ...}}", "text")
    extra = sorted(set(value) - {"format"})
    if extra:
        raise bad(f"text has unsupported field(s): {', '.join(extra)}", f"text.{extra[0]}")
    form = value.get("format")
    if form is None:
        return {"type": "text"}, None
    if not isinstance(form, dict):
        raise bad("text.format must be an object", "text.format")
    kind = form.get("type")
    extra = sorted(set(form) - ({"type"} if kind in ("text", "json_object") else FORMAT_KEYS))
    if extra:
        raise bad(f"text.format has unsupported field(s): {', '.join(extra)}", f"text.format.{extra[0]}")
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

