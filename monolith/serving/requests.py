"""The request every API becomes, and what their typed bodies share: JSON bodies ->
typed bodies (each API's requests.py declares its own, with its field policy: fields.py)
-> the requests the engine driving runs.

`ChatRequest` is what the engine driving runs (`GenerationFields`: what it shares with
OpenAI's completion request), `SamplingDefaults` what a request gets for the sampling
fields it leaves out. Each API turns its typed body into a ChatRequest through the
pieces here: `sampling` (the sampling parameters, within the API's temperature range),
`stop_strings`, `template_kwargs` (chat_template_kwargs and a thinking switch), the
chat tools (`ChatTool`, `ToolChoice`: OpenAI's shapes, which the Anthropic and Responses
parsers build from theirs) and `chat_request` (tools and tool_choice, parallel calls and
the response format -> the output's Structure). A JSON null means "not given", as the
OpenAI API treats it. docs/api-fields.md has the table of every field and why.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from ..sampling import SamplingError, SamplingParams
from .errors import bad
from .fields import Flag, Object, Strict, Text
from .structured import Structure
from .tools.specs import check_parameters, forced_calls

MAX_STOP_STRINGS = 16
MAX_TEMPERATURE = 2.0  # OpenAI's range for temperature
# the most tokens a reply takes when the request sets no limit: Qwen3.6's recommended
# output length ("32,768 tokens for most queries"), or less where the checkpoint's
# generation_config.json says so (max_new_tokens, max_length) or --max-output-tokens
DEFAULT_OUTPUT_TOKENS = 32768
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




# ------------------------------------------------------------------ the pieces of a request


def sampling(defaults: SamplingDefaults, temperature: float | None, top_p: float | None, top_k: int | None = None,
             min_p: float | None = None, seed: int | None = None,
             max_temperature: float = MAX_TEMPERATURE) -> SamplingParams:
    """The sampling parameters of a request's fields (None: the default), temperature in
    [0, max_temperature] (the API's range; SamplingParams checks the rest)."""
    temperature = defaults.temperature if temperature is None else float(temperature)
    if temperature > max_temperature:
        raise bad(f"temperature must be a number in [0, {max_temperature:g}], got {temperature}", "temperature")
    if top_k is None:
        top_k = defaults.top_k
    elif top_k < -1:
        raise bad(f"top_k must be an integer >= 0 (0 or -1 = off), got {top_k}", "top_k")
    try:
        return SamplingParams(temperature, defaults.top_p if top_p is None else float(top_p), max(top_k, 0),
                              defaults.min_p if min_p is None else float(min_p), seed)
    except SamplingError as e:
        raise bad(str(e), e.field) from None


def stop_strings(value: str | list[str] | None, param: str = "stop") -> tuple[str, ...]:
    """A request's stop strings: at most MAX_STOP_STRINGS, none empty."""
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"{param} has {len(stops)} strings; at most {MAX_STOP_STRINGS}", param)
    if any(not s for s in stops):
        raise bad(f"{param} strings must not be empty", param)
    return tuple(stops)


def template_kwargs(kwargs: dict | None, thinking: bool | None = None, switch: str = "reasoning_effort") -> dict:
    """chat_template_kwargs, with a thinking switch (`switch`, the field that sets it:
    the two must agree)."""
    kwargs = dict(kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise bad(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    if thinking is None:
        return kwargs
    if kwargs.get("enable_thinking", thinking) != thinking:
        raise bad(f"{switch} turns thinking {'on' if thinking else 'off'}, but chat_template_kwargs.enable_thinking "
                  "says otherwise; send one", switch)
    return {**kwargs, "enable_thinking": thinking}


class Function(Strict, extra="ignore"):
    """A chat tool's function: its parameter schema is what the tool-call parser can
    read (tools/specs.py); other keys are passed to the template as sent."""

    name: Annotated[Text, Field(min_length=1)]
    description: Text | None = None
    parameters: Object | None = None
    strict: Flag | None = None  # accepted, no effect: every call follows the schema whatever it says


class ChatTool(Strict, extra="ignore"):
    type: Literal["function"]
    function: Function


def chat_tools(tools: list[ChatTool] | None, sent: list[dict] | None) -> list[dict] | None:
    """The chat tools as the template shows them: as `sent` (their typed `tools`), their
    schemas checked."""
    for i, tool in enumerate(tools or ()):
        check_parameters(tool.function.parameters or {}, f"tools[{i}].function.parameters")
    return sent or None


def chat_request(fields: GenerationFields, messages: list[dict], tools: list[dict] | None, choice=None,
                 single: bool = False, form: Structure | None = None, kwargs: dict | None = None,
                 form_param: str = "response_format") -> ChatRequest:
    """The ChatRequest of a chat: `choice` is None, "auto", "none", "required" (one call
    or more to any of `tools`, exactly one when `single`) or the chat tool a call is
    forced to; `form` the response format's Structure (`form_param` names it)."""
    structure = None
    if choice == "required":
        if not tools:
            raise bad("tool_choice \"required\" needs tools", "tool_choice")
        structure = forced_calls(tools, single=single)
    elif isinstance(choice, dict):
        structure = forced_calls([choice], single=True)
    if form is not None and structure is not None:
        raise bad(f"{form_param} and a tool_choice that forces a call cannot both constrain the output", form_param)
    return ChatRequest(**vars(fields), messages=messages, tools=None if choice == "none" else tools,
                       template_kwargs=kwargs or {}, structure=structure or form)
