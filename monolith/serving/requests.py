"""The request every API becomes, and the checks of the chat body they share: JSON bodies
-> typed requests, or an `APIError` whose message names the field (`param`).

`ChatRequest` is what the engine driving runs (`GenerationFields`: what it shares with
OpenAI's completion request), `SamplingDefaults` what a request gets for the sampling
fields it leaves out. `parse_chat_body` reads the OpenAI-shaped chat body (messages,
tools, tool_choice, response_format, sampling fields): OpenAI's chat endpoint checks its
field policy first (openai/requests.py), Anthropic's Messages turn their request into
such a body (anthropic/requests.py), the Responses API builds its ChatRequest itself.
A JSON null means "not given", as the OpenAI API treats it. docs/api-fields.md has the
table of every field and why.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, replace

from ..runtime.events import MAX_TOP_LOGPROBS
from ..sampling import SamplingError, SamplingParams
from . import images
from .errors import bad
from .fields import (
    is_name,
    optional,
    positive_int,
    real,
)
from .structured import Structure, response_format
from .tools.specs import forced_calls, json_arguments, named, tool_entries, tool_fields

MAX_STOP_STRINGS = 16
MAX_TEMPERATURE = 2.0  # OpenAI's range for temperature
# the most tokens a reply takes when the request sets no limit: Qwen3.6's recommended
# output length ("32,768 tokens for most queries"), or less where the checkpoint's
# generation_config.json says so (max_new_tokens, max_length) or --max-output-tokens
DEFAULT_OUTPUT_TOKENS = 32768
ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "refusal"}
STREAM_OPTIONS = {"include_usage", "include_obfuscation"}  # no obfuscation padding is sent
# reasoning_effort -> Qwen's thinking switch (the template's enable_thinking): Qwen has no
# effort levels, only thinking on or off
THINKING_BY_EFFORT = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True,
                      "max": True}
# what the renderer sets itself (and `self`, the render method's own argument), and the
# special token names Hugging Face templates read
RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "self", "bos_token", "eos_token",
                            "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for the sampling fields it leaves out: the checkpoint's
    generation_config.json when it has them (as vLLM does), else OpenAI's defaults; and
    the most tokens a reply takes when the request sets no limit (`max_tokens`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = DEFAULT_OUTPUT_TOKENS

    @classmethod
    def from_generation_config(cls, config: dict | None, max_output_tokens: int | None = None) -> SamplingDefaults:
        """`max_output_tokens` (the --max-output-tokens flag), when given, is the output
        cap; else the lowest of DEFAULT_OUTPUT_TOKENS and the config's max_new_tokens and
        max_length (a bound on prompt and reply together, so on the reply too)."""
        config = config or {}
        def get(name, default, kind):
            value = config.get(name)
            return value if isinstance(value, kind) and not isinstance(value, bool) else default
        limits = [get(name, DEFAULT_OUTPUT_TOKENS, int) for name in ("max_new_tokens", "max_length")]
        cap = max_output_tokens or min([DEFAULT_OUTPUT_TOKENS] + [n for n in limits if n >= 1])
        if config.get("do_sample") is False:
            return cls(temperature=0.0, max_tokens=cap)
        top_k = get("top_k", 0, int)
        return cls(float(get("temperature", 1.0, numbers.Real)), float(get("top_p", 1.0, numbers.Real)),
                   max(0, top_k), float(get("min_p", 0.0, numbers.Real)), cap)


@dataclass(frozen=True)
class GenerationFields:
    """What the chat and completion requests share."""

    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None
    params: SamplingParams
    stop: tuple[str, ...]
    logprobs: int | None  # None: off; k: the sampled token's logprob and the k most likely


@dataclass(frozen=True)
class ChatRequest(GenerationFields):
    messages: list[dict]
    tools: list[dict] | None  # None when tool calls are off (no tools, or tool_choice "none")
    template_kwargs: dict
    structure: Structure | None = None  # response_format or tool_choice constrains the output
    spec: bool = False  # monolith.spec: how each token came, in the stream (openai/speculation.py)
    draft: bool = False  # monolith.draft: draft every round whatever the start measured (openai/speculation.py)


def parse_json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the decoder recurses per level of nesting
        raise bad("the request body is nested too deeply to be read") from None
    except ValueError as e:  # Python's int limit: an integer literal of over 4300 digits
        raise bad(f"the request body holds an integer too long to read ({e})") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    try:  # a \ud800 escape alone decodes to a str no tokenizer takes
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise bad("the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff): not text") from None
    return body


def parse_chat_body(body: dict, defaults: SamplingDefaults = SamplingDefaults()) -> ChatRequest:
    """The ChatRequest of an OpenAI-shaped chat body whose fields the caller has checked
    (`spec` and `draft` are OpenAI's extension: openai/requests.py sets them)."""
    fields = generation_fields(body, defaults, chat=True)
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        tools, choice = _allowed_tools(choice, tools)
    structure = _tool_choice(choice, tools)
    parallel = optional(body, "parallel_tool_calls", bool, "true or false")
    if structure is not None and parallel is False:
        structure = replace(structure, single=True)
    form = response_format(body.get("response_format"))
    if form is not None and structure is not None:
        raise bad("response_format and a tool_choice that forces a call cannot both constrain the output",
                  "response_format")
    return ChatRequest(**vars(fields), messages=messages, tools=None if choice == "none" else tools,
                       template_kwargs=_template_kwargs(body), structure=structure or form)


def _template_kwargs(body: dict) -> dict:
    """chat_template_kwargs, with reasoning_effort's thinking switch (the two must agree)."""
    kwargs = dict(optional(body, "chat_template_kwargs", dict, "an object") or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise bad(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is None:
        return kwargs
    if not is_name(effort, THINKING_BY_EFFORT):
        raise bad(f"reasoning_effort must be one of {', '.join(THINKING_BY_EFFORT)}, got {json.dumps(effort)[:60]}",
                  "reasoning_effort")
    thinking = THINKING_BY_EFFORT[effort]
    if kwargs.get("enable_thinking", thinking) != thinking:
        raise bad(f"reasoning_effort {effort!r} turns thinking {'on' if thinking else 'off'}, but "
                  "chat_template_kwargs.enable_thinking says otherwise; send one", "reasoning_effort")
    return {**kwargs, "enable_thinking": thinking}


def _allowed_tools(choice: dict, tools: list[dict] | None) -> tuple[list[dict] | None, str]:
    """tool_choice {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}} -> (the tools
    the model is shown: only the allowed ones, the tool_choice "auto" or "required")."""
    allowed = choice.get("allowed_tools")
    where = "tool_choice.allowed_tools"
    if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required") \
            or not isinstance(allowed.get("tools"), list):
        raise bad(f"{where} must be {{\"mode\": \"auto\" | \"required\", \"tools\": [...]}}", where)
    names = set()
    for i, entry in enumerate(allowed["tools"]):
        fn = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"{where}.tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                      f"{where}.tools[{i}]")
        if not isinstance(fn.get("name"), str):
            raise bad(f"{where}.tools[{i}].function.name must be a string", f"{where}.tools[{i}].function.name")
        names.add(fn["name"])
    shown = [t for t in tools or () if t["function"]["name"] in names]
    missing = sorted(str(n) for n in names - {t["function"]["name"] for t in shown})
    if missing:
        raise bad(f"{where}.tools names {', '.join(missing)}, not in tools", f"{where}.tools")
    return shown or None, allowed["mode"]


# ------------------------------------------------------------------ fields


def generation_fields(body: dict, defaults: SamplingDefaults, chat: bool) -> GenerationFields:
    model = optional(body, "model", str, "a string")
    stream = optional(body, "stream", bool, "true or false") or False
    include_usage = _stream_options(body) and stream
    max_tokens = positive_int(body, "max_tokens")
    if chat:
        completion = positive_int(body, "max_completion_tokens")
        if completion is not None and max_tokens is not None and completion != max_tokens:
            raise bad("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
        max_tokens = completion if completion is not None else max_tokens
    temperature = real(body, "temperature", defaults.temperature)
    if temperature > MAX_TEMPERATURE:  # the API's bound; SamplingParams checks the rest
        raise bad(f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {temperature}", "temperature")
    top_p, min_p = real(body, "top_p", defaults.top_p), real(body, "min_p", defaults.min_p)
    top_k = optional(body, "top_k", int, "an integer >= 0 (0 or -1 = off)")
    if top_k is None:
        top_k = defaults.top_k
    elif top_k < -1:
        raise bad(f"top_k must be an integer >= 0 (0 or -1 = off), got {top_k}", "top_k")
    seed = optional(body, "seed", int, "an integer")
    try:
        params = SamplingParams(temperature, top_p, max(top_k, 0), min_p, seed)
    except SamplingError as e:
        raise bad(str(e), e.field) from None
    return GenerationFields(model, stream, include_usage, max_tokens, params, _stop(body.get("stop")),
                            _logprobs(body, chat))


def _stream_options(body: dict) -> bool:
    """stream_options' include_usage (the options change nothing when not streaming)."""
    options = optional(body, "stream_options", dict, "an object") or {}
    unknown = sorted(set(options) - STREAM_OPTIONS)
    if unknown:
        raise bad(f"stream_options.{unknown[0]} is not supported", f"stream_options.{unknown[0]}")
    for name in STREAM_OPTIONS:
        optional(options, name, bool, "true or false", f"stream_options.{name}")
    return bool(options.get("include_usage"))


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        wanted = optional(body, "logprobs", bool, "true or false")
        top = optional(body, "top_logprobs", int, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
        if top is not None and not wanted:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if wanted else None
    top = optional(body, "logprobs", int, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "logprobs")
    return top


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS}", "stop")
    if any(not s for s in stops):
        raise bad("stop strings must not be empty", "stop")
    return tuple(stops)


def _messages(value) -> list[dict]:
    if value is None:
        raise bad("messages is required", "messages")
    if not isinstance(value, list):
        raise bad("messages must be a list of message objects", "messages")
    if not value:
        raise bad("messages is empty: at least one message is needed", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(m, where: str) -> dict:
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object", where)
    unknown = sorted(set(m) - MESSAGE_FIELDS)
    if unknown:
        raise bad(f"{where} has unsupported field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}",
                  f"{where}.{unknown[0]}")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    out = {"role": "system" if role == "developer" else role}  # chat templates know no developer role
    content = _content(m.get("content"), out["role"], f"{where}.content")
    tool_calls = m.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise bad(f"{where}.tool_calls is only allowed in assistant messages", f"{where}.tool_calls")
        out["tool_calls"] = _tool_calls(tool_calls, f"{where}.tool_calls")
    if content is None and not (role == "assistant" and tool_calls):
        raise bad(f"{where}.content is required", f"{where}.content")
    out["content"] = content if content is not None else ""
    for name in ("name", "tool_call_id", "reasoning_content"):
        value = m.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise bad(f"{where}.{name} must be a string", f"{where}.{name}")
            out[name] = value
    return out


def _content(value, role: str, where: str) -> str | list[dict] | None:
    """A string, or a list of text and image parts: a string when it has no image, else
    text and image items (images.py)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"{where} must be a string or a list of content parts", where)
    items = []
    for i, part in enumerate(value):
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            items.append(part["text"])
        else:
            items.append(images.chat_image(part, role, f"{where}[{i}]"))
    return images.message_content(items)


def _tool_calls(value, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise bad(f"{where} must be a list", where)
    calls = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{at} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": ...}}}}",
                      at)
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):  # JSON text in the API; templates iterate a mapping
            arguments = json_arguments(arguments, f"{at}.function.arguments")
        if not isinstance(arguments, dict):
            raise bad(f"{at}.function.arguments must be a JSON object", f"{at}.function.arguments")
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        calls.append(entry)
    return calls


def _tools(value) -> list[dict] | None:
    for at, tool in tool_entries(value, "{\"type\": \"function\", \"function\": {...}} objects"):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(f"{at} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", at)
        tool_fields(tool["function"], f"{at}.function")
    return value or None


def _tool_choice(choice, tools: list[dict] | None) -> Structure | None:
    """The Structure a `tool_choice` asks for (None: "auto", "none" or absent)."""
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        if not tools:
            raise bad("tool_choice \"required\" needs tools", "tool_choice")
        return forced_calls(tools)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = named(tools, name)
        if not chosen:
            raise bad(f"tool_choice names function {name!r}, which is not in tools", "tool_choice.function.name")
        return forced_calls(chosen[:1], single=True)
    raise bad("tool_choice must be \"auto\", \"none\", \"required\" or "
              f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")
