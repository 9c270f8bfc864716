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
model calls or not as it likes, and a call it opens is a valid one (structured.py). Fields that would change the result and
are not implemented are refused naming them. The reply: reply.py; the store:
store.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from ..errors import bad
from ..fields import (
    Body,
    Flag,
    Positive,
    Real,
    Strict,
    Text,
    inert,
    neutral,
    parse,
)
from ..requests import THINKING_BY_EFFORT, ChatRequest, SamplingDefaults, sampling
from ..structured import Structure
from .items import items_to_messages
from .store import ResponseStore, input_items
from .tools import Tool, ToolChoice, Tools, parse_tools, tool_choice

ENCRYPTED = "reasoning.encrypted_content"
# `include` values about items this server never writes (hosted tools' calls, input images)
INERT_INCLUDES = {"file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                  "message.input_image.image_url", "computer_call_output.output.image_url",
                  "code_interpreter_call.outputs"}
CACHE = "the prompt cache is automatic"


class Reasoning(Strict):
    """`effort` switches Qwen's thinking (none / minimal: off; low and up: on); `summary`
    "auto" or null (the reply's reasoning item carries the reasoning itself as
    reasoning_text; this server writes no separate summaries, so "concise" and
    "detailed" are refused)."""

    effort: Literal[tuple(THINKING_BY_EFFORT)] | None = None
    summary: Text | None = None


class Format(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: Annotated[Any, Field(alias="schema")] = None
    strict: Flag | None = None
    description: Text | None = None


class TextOptions(Strict):
    format: Format | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint Qwen has no switch for: accepted


class ResponsesBody(Body):
    model: Text | None = None
    input: Text | list[Any]  # items.py reads the items
    instructions: Text | None = None
    tools: list[Tool] | None = None  # tools.py
    tool_choice: ToolChoice | None = None  # tools.py
    max_output_tokens: Positive | None = None
    temperature: Real | None = None
    top_p: Real | None = None
    text: TextOptions | None = None
    stream: Flag = False
    store: Flag = True
    metadata: Annotated[dict[str, Text], Field(max_length=16)] | None = None  # echoed
    parallel_tool_calls: Flag = True
    previous_response_id: Text | None = None
    reasoning: Reasoning | None = None
    include: list[Text] = Field(default_factory=list)
    # ids, client hints and caching hints: they change nothing generated
    user: Annotated[Any, inert("an end-user id")] = None
    safety_identifier: Annotated[Text | None, inert("an end-user id; echoed")] = None
    prompt_cache_key: Annotated[Text | None, inert(CACHE + "; echoed")] = None
    service_tier: Annotated[Any, inert("one tier here")] = None
    client_metadata: Annotated[Any, inert("client metadata; nothing is stored")] = None
    prompt_cache_retention: Annotated[Any, inert("entries live until the cache needs the room")] = None
    prompt_cache_options: Annotated[Any, inert(CACHE)] = None
    stream_options: Annotated[Any, inert("nothing to obfuscate")] = None
    max_tool_calls: Annotated[Positive | None, inert("bounds calls to hosted tools, which run nowhere here")] = None
    # accepted only at the value that means "off" (or the API's default)
    truncation: Annotated[Any, neutral("disabled", "the input is never truncated")] = None
    background: Annotated[Any, neutral(False, "no background responses")] = None
    top_logprobs: Annotated[Any, neutral(0, "logprobs are not written in this API")] = None
    presence_penalty: Annotated[Any, neutral(0.0, "penalties are not implemented")] = None
    frequency_penalty: Annotated[Any, neutral(0.0, "penalties are not implemented")] = None


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
    given = parse(ResponsesBody, body)
    params = sampling(defaults, given.temperature, given.top_p)
    previous = given.previous_response_id
    history = list(store.get(previous, "previous_response_id")[1]) if previous is not None else []
    history += _input(given.input, history)
    tools = parse_tools(given.tools)
    choice, structure = tool_choice(given.tool_choice, tools, given.parallel_tool_calls)
    text, form_structure = _text(given.text)
    if form_structure is not None and structure is not None:
        raise bad("text.format and a tool_choice that forces a call cannot both constrain the output", "text.format")
    messages = ([{"role": "system", "content": given.instructions}] if given.instructions else []) + history
    reasoning, template_kwargs = _reasoning(given.reasoning)
    request = ChatRequest(model=given.model, stream=given.stream, include_usage=False,
                          max_tokens=given.max_output_tokens, params=params, stop=(), logprobs=None,
                          messages=messages, tools=None if choice == "none" or not tools.chat else tools.chat,
                          template_kwargs=template_kwargs, structure=structure or form_structure)
    echo = {"instructions": given.instructions, "max_output_tokens": given.max_output_tokens,
            "metadata": _metadata(given.metadata), "parallel_tool_calls": given.parallel_tool_calls,
            "previous_response_id": previous, "temperature": params.temperature, "top_p": params.top_p,
            "text": text, "tool_choice": choice, "tools": tools.echo, "truncation": "disabled",
            "reasoning": reasoning, "presence_penalty": 0.0, "frequency_penalty": 0.0, "top_logprobs": 0,
            "background": False, "service_tier": "default", "max_tool_calls": given.max_tool_calls,
            "safety_identifier": given.safety_identifier, "prompt_cache_key": given.prompt_cache_key}
    return ResponsesCall(request, history, echo, given.store, input_items(given.input) if given.store else [], tools,
                         _include(given.include))


def _include(values: list[str]) -> bool:
    """Whether `include` asks for encrypted reasoning. Values about items this server
    never writes are accepted; logprobs (not written in this API) are refused."""
    for v in values:
        if v != ENCRYPTED and v not in INERT_INCLUDES:
            why = "logprobs are not written in this API" if v == "message.output_text.logprobs" else "unknown"
            raise bad(f"include value {v!r} is not supported ({why})", "include")
    return ENCRYPTED in values


def _reasoning(value: Reasoning | None) -> tuple[dict, dict]:
    """(the response's `reasoning` echo, the chat template's kwargs) of `reasoning`."""
    if value is None:
        return {"effort": None, "summary": None}, {}
    if value.summary not in (None, "auto"):
        raise bad(f"reasoning.summary {value.summary!r} is not supported (this server writes no reasoning "
                  "summaries; the reasoning comes back whole as reasoning_text): use \"auto\" or null",
                  "reasoning.summary")
    kwargs = {} if value.effort is None else {"enable_thinking": THINKING_BY_EFFORT[value.effort]}
    return {"effort": value.effort, "summary": value.summary}, kwargs


def _metadata(value: dict | None) -> dict:
    for key, item in (value or {}).items():
        if len(key) > 64 or len(item) > 512:
            raise bad("metadata keys must be strings of at most 64 characters and values strings of at most 512",
                      f"metadata.{key[:64]}")
    return dict(value or {})


def _input(value, history: list[dict]) -> list[dict]:
    if isinstance(value, str):
        if not value:
            raise bad("input is empty", "input")
        return [{"role": "user", "content": value}]
    if not value:
        raise bad("input must be a non-empty string or a non-empty list of input items", "input")
    return items_to_messages(value, "input", {c.get("id") for m in history for c in m.get("tool_calls", ())})


def _text(value: TextOptions | None) -> tuple[dict, Structure | None]:
    """(`text` as the response reports it, the Structure text.format asks for or None)."""
    if value is None:
        return {"format": {"type": "text"}}, None
    form, structure = _format(value.format)
    return {"format": form, **({"verbosity": value.verbosity} if value.verbosity else {})}, structure


def _format(form: Format | None) -> tuple[dict, Structure | None]:
    """(text.format as the response reports it, the Structure it asks for or None)."""
    extra = sorted(form.model_fields_set - {"type"}) if form is not None and form.type != "json_schema" else []
    if extra:  # text and json_object take no other field
        raise bad(f"text.format has unsupported field(s): {', '.join(extra)}", f"text.format.{extra[0]}")
    if form is None or form.type == "text":
        return {"type": "text"}, None
    if form.type == "json_object":
        return {"type": "json_object"}, Structure("json", "text.format", {"type": "object"})
    if not isinstance(form.schema_, dict):
        raise bad("text.format.schema must be a JSON schema (an object)", "text.format.schema")
    # echoed as the specification's response object has it: the schema itself is not repeated
    echo = {"type": "json_schema", "name": form.name or "response", "description": form.description,
            "schema": None, "strict": bool(form.strict)}
    return echo, Structure("json", "text.format.schema", form.schema_)
