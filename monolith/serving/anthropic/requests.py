"""Anthropic's Messages API on the chat path: POST /v1/messages and
/v1/messages/count_tokens: the requests (the replies: reply.py; the
endpoints: routes.py).

A request is parsed here into its typed body (`MessagesBody`, `CountTokensBody`: an
unknown field, block type or value this server cannot honour is a 400 naming it), and
turned into the chat request the rest of the server reads (../requests.py's
`chat_request`, without an OpenAI-shaped body in between): `system` becomes a system
message, `tool_use` blocks assistant `tool_calls`, `tool_result` blocks `tool` messages,
`image` blocks (in a user turn or a tool_result) image items (images.py),
`thinking` blocks `reasoning_content`; `tools` with `input_schema` become
functions with `parameters` (the checks every API shares: tools/specs.py); `tool_choice`
any -> "required" (with `disable_parallel_tool_use`: `parallel_tool_calls` false, one
call), tool -> the named function (both grammar-constrained, ../requests.py /
structured.py). `thinking` and `output_config` are read by options.py,
`context_management` by context_edits.py.

Accepted and inert (declared so on the body): `metadata`, `cache_control` at any level
(the prompt cache keeps every prefix on its own, and usage reports its hits exactly), `service_tier`,
`speed`, `inference_geo`, `diagnostics`, `billing_policy`, `fallbacks`,
`fallback_credit_token`. Claude Code's `x-anthropic-billing-header:` line
at the start of the system prompt is dropped: it changes on every request and would
leave no prefix to reuse.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, Tag, model_validator

from .. import images
from ..errors import bad
from ..fields import (
    Body,
    Flag,
    Integer,
    Object,
    Positive,
    Real,
    Strict,
    Text,
    by_type,
    inert,
    parse,
)
from ..requests import (
    ChatRequest,
    GenerationFields,
    SamplingDefaults,
    chat_request,
    sampling,
    stop_strings,
)
from ..structured import response_format
from ..tools.specs import chat_tool, check_parameters, named
from .context_edits import ContextEdits, parse_context_management
from .options import (
    OutputConfig,
    Thinking,
    ThinkingConfig,
    output_format,
    parse_thinking,
)

MAX_TEMPERATURE = 1.0  # Anthropic's range: [0, 1]
CACHE = "the prompt cache is automatic"
NAME = Annotated[Text, Field(min_length=1)]
# Claude Code's first system line: a per-request checksum (cch=...) that would make
# every prompt differ from the previous one a few tokens in; it means nothing to the model
BILLING_HEADER = re.compile(r"\Ax-anthropic-billing-header:[^\n]*(?:\n|\Z)")


# ------------------------------------------------------------------ the typed body


class TextBlock(Strict):
    type: Literal["text"]
    text: Text
    cache_control: Annotated[Object | None, inert(CACHE)] = None
    citations: Any = None  # refused when not empty


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: Text
    signature: Annotated[Any, inert("the reasoning is read as text")] = None


class RedactedThinkingBlock(Strict):  # another provider's sealed reasoning: nothing here can read it
    type: Literal["redacted_thinking"]
    data: Any = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: NAME
    name: NAME
    input: Object
    cache_control: Annotated[Object | None, inert(CACHE)] = None
    caller: Annotated[Any, inert("only the model calls tools here")] = None
    toolset_name: Annotated[Any, inert("no toolsets here")] = None


class OtherBlock(Strict, extra="allow"):
    """A block of a type no message takes: refused naming it."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, block):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in images.VIDEO_PARTS:
            raise ValueError(f"video input ({kind!r} parts) is not supported; send images")
        raise ValueError(f"{kind!r} blocks are not supported" if isinstance(block, dict) else
                         "must be a content block object")


# a text or image block (an image: images.py reads it)
MediaBlock = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[Object, Tag("image")]
                       | Annotated[OtherBlock, Tag("other")], by_type(("text", "image"))]


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: NAME
    content: Text | list[MediaBlock] | None = None
    is_error: Flag | None = None  # the template has no error flag: the model reads it in the text
    cache_control: Annotated[Object | None, inert(CACHE)] = None
    toolset_name: Annotated[Any, inert("no toolsets here")] = None


BLOCKS = ("text", "image", "tool_result", "thinking", "redacted_thinking", "tool_use")
# any block a message may hold (which role takes which: _user_blocks, _assistant_blocks)
Block = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[Object, Tag("image")]
                  | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
                  | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")] | Annotated[ToolUseBlock, Tag("tool_use")]
                  | Annotated[OtherBlock, Tag("other")], by_type(BLOCKS)]


class Message(Strict):
    role: Literal["user", "assistant", "system"]
    content: Text | list[Block]


class Tool(Strict):
    """A client tool: `eager_input_streaming` is honoured (reply.py); strict,
    defer_loading, input_examples and allowed_callers change nothing here (a forced call
    always follows its schema; every tool is in the prompt)."""

    name: NAME
    description: Text | None = None
    input_schema: Object
    type: Literal["custom"] | None = None
    cache_control: Annotated[Object | None, inert(CACHE)] = None
    eager_input_streaming: Flag | None = None
    strict: Annotated[Flag | None, inert("the grammar enforces the schema in every call, forced or opened by the model under auto")] = None
    defer_loading: Annotated[Flag | None, inert("every tool is in the prompt from the start")] = None
    input_examples: Annotated[Any, inert("not rendered into the prompt")] = None
    allowed_callers: Annotated[Any, inert("only the model calls tools here")] = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, tool):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"{str(kind)[:60]!r} tools (server tools) are not supported; only client tools with an "
                             "input_schema")
        return tool


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    disable_parallel_tool_use: Flag | None = None
    name: Text | None = None  # of a "tool" choice


class CountTokensBody(Body):
    """POST /v1/messages/count_tokens: what shapes the prompt."""

    nulls_given = True
    model: Text
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None  # options.py
    output_config: OutputConfig | None = None  # options.py
    context_management: Any = None  # context_edits.py reads it
    # metadata, caching, service and billing hints (this server never declines a request,
    # so never falls back)
    metadata: Annotated[Object | None, inert("client metadata (user_id); nothing is stored")] = None
    cache_control: Annotated[Object | None, inert(CACHE)] = None
    service_tier: Annotated[Text | None, inert("one tier here")] = None
    speed: Annotated[Text | None, inert("one speed here")] = None
    inference_geo: Annotated[Text | None, inert("one place here")] = None
    diagnostics: Annotated[Object | None, inert("nothing to diagnose")] = None
    billing_policy: Annotated[Any, inert("no billing here")] = None
    fallbacks: Annotated[Any, inert("this server never declines a request")] = None
    fallback_credit_token: Annotated[Any, inert("this server never declines a request")] = None


class MessagesBody(CountTokensBody):
    """POST /v1/messages: the prompt's fields, and the generation's."""

    max_tokens: Positive  # the Messages API has no default
    stop_sequences: list[Text] | None = None
    stream: Flag = False
    temperature: Real | None = None
    top_p: Real | None = None
    top_k: Integer | None = None


@dataclass(frozen=True)
class MessagesRequest:
    chat: ChatRequest  # what the engine runs
    model: str
    tools: list[dict] | None  # OpenAI-shaped, for the tool-call parser (None: calls are not read)
    thinking: Thinking = Thinking()
    edits: ContextEdits | None = None  # context_management (context_edits.py)
    eager: frozenset[str] = frozenset()  # tools whose input streams as the call is written


# ------------------------------------------------------------------ requests


def parse_messages_request(body: dict, defaults: SamplingDefaults) -> MessagesRequest:
    given = parse(MessagesBody, body)
    params = sampling(defaults, given.temperature, given.top_p, given.top_k, max_temperature=MAX_TEMPERATURE)
    fields = GenerationFields(given.model, given.stream, False, given.max_tokens, params,
                              stop_strings(given.stop_sequences, "stop_sequences"), None)
    return _request(given, fields)


def parse_count_tokens_request(body: dict, defaults: SamplingDefaults) -> MessagesRequest:
    given = parse(CountTokensBody, body)
    fields = GenerationFields(given.model, False, False, None, sampling(defaults, None, None), (), None)
    return _request(given, fields)


def _request(given: CountTokensBody, fields: GenerationFields) -> MessagesRequest:
    messages = _system(given.system) + _messages(given.messages)
    tools = _tools(given.tools)
    choice, single = _tool_choice(given.tool_choice, tools)
    thinking = parse_thinking(given.thinking, given.output_config, fields.max_tokens, messages[-1]["role"] == "tool")
    kwargs = {} if thinking.switch is None else {"enable_thinking": thinking.switch}
    form = response_format(output_format(given.output_config))
    edits = parse_context_management(given.context_management)
    req = chat_request(fields, messages, tools, choice, single, form, kwargs)
    eager = frozenset(t.name for t in given.tools or () if t.eager_input_streaming is True)
    return MessagesRequest(req, given.model, req.tools, thinking, edits, eager)


def _system(value: str | list[TextBlock] | None) -> list[dict]:
    """The system message, without a billing-header line at its start (its own block,
    as Claude Code sends it, or the first line of the text)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": BILLING_HEADER.sub("", value, count=1)}]
    texts = [_text_block(block, f"system[{i}]") for i, block in enumerate(value)]
    if texts:
        texts[0] = BILLING_HEADER.sub("", texts[0], count=1)
    return [{"role": "system", "content": "".join(texts)}]


def _text_block(block: TextBlock, at: str) -> str:
    if block.citations:
        raise bad(f"{at}.citations: citations are not supported", f"{at}.citations")
    return block.text


def _block_type(block, at: str, allowed: tuple[str, ...]) -> str:
    kind = block.type if isinstance(block, Strict) else "image"
    if kind not in allowed:
        raise bad(f"{at}.type: {kind!r} blocks are not supported here (supported: {', '.join(allowed)})", f"{at}.type")
    return kind


def _messages(value: list[Message]) -> list[dict]:
    out = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if isinstance(m.content, list) and not m.content:
            raise bad(f"{at}.content is an empty list: a message needs at least one content block", f"{at}.content")
        if m.role == "system":
            content = m.content if isinstance(m.content, str) else "".join(
                _text_block(b, f"{at}.content[{j}]") for j, b in enumerate(m.content)
                if _block_type(b, f"{at}.content[{j}]", ("text",)))
            out.append({"role": "system", "content": content})
        elif isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out += _user_blocks(m.content, f"{at}.content")
        else:
            out.append(_assistant_blocks(m.content, f"{at}.content"))
    if value[-1].role == "assistant":
        raise bad(f"messages[{len(value) - 1}]: a conversation ending with an assistant message (a prefill the "
                  "reply continues) is not supported: the template closes that turn and opens a new one",
                  f"messages[{len(value) - 1}]")
    return out


def _user_blocks(blocks: list, where: str) -> list[dict]:
    """Text and image blocks -> user messages, tool_result blocks -> tool messages, in order."""
    out: list[dict] = []
    parts: list = []  # the text and images of the user message being assembled (images.py)
    for i, block in enumerate(blocks):
        at = f"{where}[{i}]"
        if _block_type(block, at, ("text", "image", "tool_result")) != "tool_result":
            if not parts:
                out.append({"role": "user"})
            parts.append(_part(block, at))
            out[-1]["content"] = images.message_content(parts)
            continue
        parts = []
        content = block.content
        if content is None or isinstance(content, str):
            result = [content or ""]
        else:
            result = [_part(b, f"{at}.content[{j}]") for j, b in enumerate(content)]
        if block.is_error:  # the template has no error flag: the model reads it in the text
            result.insert(0, "Error: ")
        out.append({"role": "tool", "content": images.message_content(result), "tool_call_id": block.tool_use_id})
    return out


def _part(block, at: str):
    """A text block's text, or an image block's item (images.py)."""
    return _text_block(block, at) if isinstance(block, TextBlock) else images.anthropic_image(block, at)


def _assistant_blocks(blocks: list, where: str) -> dict:
    """Text, thinking and tool_use blocks -> one assistant message (redacted_thinking:
    another provider's sealed reasoning, dropped)."""
    texts, reasoning, calls = [], [], []
    for i, block in enumerate(blocks):
        at = f"{where}[{i}]"
        kind = _block_type(block, at, ("text", "thinking", "redacted_thinking", "tool_use"))
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "thinking":
            reasoning.append(block.thinking)
        elif kind == "tool_use":
            calls.append({"type": "function", "function": {"name": block.name, "arguments": block.input},
                          "id": block.id})
    message = {"role": "assistant"}
    if calls:
        message["tool_calls"] = calls
    message["content"] = "".join(texts)
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return message


def _tools(value: list[Tool] | None) -> list[dict] | None:
    out = []
    for i, tool in enumerate(value or ()):
        check_parameters(tool.input_schema, f"tools[{i}].input_schema")
        # in the order OpenAI's function objects have
        out.append(chat_tool(name=tool.name, description=tool.description, parameters=tool.input_schema))
    return out or None


def _tool_choice(value: ToolChoice | None, tools: list[dict] | None) -> tuple[object, bool]:
    """(the chat tool_choice: None, "auto", "none", "required" or the chat tool a call is
    forced to; exactly one call to any tool)."""
    if value is None:
        return None, False
    if value.name is not None and value.type != "tool":
        raise bad("unsupported field: tool_choice.name (only a \"tool\" choice names one)", "tool_choice.name")
    single = value.disable_parallel_tool_use
    if single and value.type == "auto":
        raise bad("tool_choice.disable_parallel_tool_use with type \"auto\" is not supported (at most one call "
                  "cannot be enforced; use \"any\" or \"tool\", which it makes exactly one)",
                  "tool_choice.disable_parallel_tool_use")
    if value.type in ("auto", "none"):
        return value.type, False
    if not tools:
        raise bad(f"tool_choice \"{value.type}\" needs tools", "tool_choice")
    if value.type == "any":
        return "required", bool(single)
    if value.name is None:
        raise bad("tool_choice.name must be a string", "tool_choice.name")
    chosen = named(tools, value.name)
    if not chosen:
        raise bad(f"tool_choice names tool {value.name!r}, which is not in tools", "tool_choice.name")
    return chosen[0], False
