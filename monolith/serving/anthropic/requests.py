"""Anthropic's Messages API on the chat path: POST /v1/messages and
/v1/messages/count_tokens: the requests (the replies: reply.py; the
endpoints: routes.py).

A request is checked here, field by field (an unknown field, block type or value this
server cannot honour is a 400 naming it), and turned into the OpenAI-shaped chat body
the rest of the server reads (requests.parse_chat_body): `system` becomes a system
message, `tool_use` blocks assistant `tool_calls`, `tool_result` blocks `tool`
messages, `image` blocks (in a user turn or a tool_result) image items (images.py),
`thinking` blocks `reasoning_content`; `tools` with `input_schema` become
functions with `parameters` (the checks every API shares: tools/specs.py); `tool_choice`
any -> "required" (with `disable_parallel_tool_use`: `parallel_tool_calls` false, one
call), tool -> the named function (both grammar-constrained, ../requests.py /
structured.py). `thinking` and `output_config` are read by options.py,
`context_management` by context_edits.py.

Accepted and inert (HINTS): `metadata`, `cache_control` at any level (the prompt cache
keeps every prefix on its own, and usage reports its hits exactly), `service_tier`,
`speed`, `inference_geo`, `diagnostics`, `billing_policy`, `fallbacks`,
`fallback_credit_token`. Claude Code's `x-anthropic-billing-header:` line
at the start of the system prompt is dropped: it changes on every request and would
leave no prefix to reuse.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .. import images
from ..errors import bad
from ..fields import refuse_unknown
from ..requests import MAX_STOP_STRINGS, ChatRequest, SamplingDefaults, parse_chat_body
from ..tools.specs import chat_tool, named, tool_entries, tool_fields
from .context_edits import ContextEdits, parse_context_management
from .options import Thinking, output_format, parse_thinking

# accepted and inert: metadata (user_id), cache_control (the prompt cache keeps every
# prefix on its own), service_tier, speed, inference_geo, diagnostics, and the beta's
# billing fields (this server never declines a request, so never falls back)
HINTS = {"metadata", "cache_control", "service_tier", "speed", "inference_geo", "diagnostics", "billing_policy",
         "fallbacks", "fallback_credit_token"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                "context_management"} | HINTS
MESSAGE_FIELDS = COUNT_FIELDS | {"max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k"}
MAX_TEMPERATURE = 1.0  # Anthropic's range: [0, 1]
# eager_input_streaming is honoured (reply.py); strict, defer_loading,
# input_examples and allowed_callers change nothing here (a forced call always follows
# its schema; every tool is in the prompt)
TOOL_FIELDS = {"name", "description", "input_schema", "type", "cache_control", "eager_input_streaming", "strict",
               "defer_loading", "input_examples", "allowed_callers"}
# Claude Code's first system line: a per-request checksum (cch=...) that would make
# every prompt differ from the previous one a few tokens in; it means nothing to the model
BILLING_HEADER = re.compile(r"\Ax-anthropic-billing-header:[^\n]*(?:\n|\Z)")


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
    refuse_unknown(body, MESSAGE_FIELDS, "")
    if body.get("max_tokens") is None:
        raise bad("max_tokens is required (the Messages API has no default)", "max_tokens")
    _check_type(body, "max_tokens", int, "an integer >= 1")
    if body["max_tokens"] < 1:
        raise bad(f"max_tokens must be an integer >= 1, got {body['max_tokens']}", "max_tokens")
    chat = _chat_body(body)
    chat["max_tokens"] = body["max_tokens"]
    for name in ("stream", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    temperature = body.get("temperature")
    if temperature is not None:
        _check_type(body, "temperature", (int, float), "a number in [0, 1]")
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise bad(f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {temperature}", "temperature")
        chat["temperature"] = temperature
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop_sequences must be a list of non-empty strings", "stop_sequences")
        if len(stops) > MAX_STOP_STRINGS:
            raise bad(f"stop_sequences has {len(stops)} strings; at most {MAX_STOP_STRINGS}", "stop_sequences")
        chat["stop"] = stops
    return _request(body, chat, defaults)


def parse_count_tokens_request(body: dict, defaults: SamplingDefaults) -> MessagesRequest:
    refuse_unknown(body, COUNT_FIELDS, "")
    chat = _chat_body(body)
    return _request(body, chat, defaults)


def _request(body: dict, chat: dict, defaults: SamplingDefaults) -> MessagesRequest:
    _check_hints(body)
    thinking = parse_thinking(body, chat["messages"][-1]["role"] == "tool")
    if thinking.switch is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking.switch}
    response_format = output_format(body.get("output_config"))
    if response_format is not None:
        chat["response_format"] = response_format
    edits = parse_context_management(body.get("context_management"))
    req = parse_chat_body(chat, defaults)
    eager = frozenset(t["name"] for t in body.get("tools") or () if t.get("eager_input_streaming") is True)
    return MessagesRequest(req, chat["model"], req.tools, thinking, edits, eager)


def _check_hints(body: dict) -> None:
    """The accepted, inert fields still have to be what the API says they are."""
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("metadata must be an object like {\"user_id\": ...}", "metadata")
    for name in ("service_tier", "speed", "inference_geo"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad(f"{name} must be a string", name)
    for name in ("cache_control", "diagnostics"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise bad(f"{name} must be an object", name)


def _chat_body(body: dict) -> dict:
    """The OpenAI-shaped chat body of the fields the two endpoints share (any +
    disable_parallel_tool_use, exactly one call to any of the tools: "required" with
    parallel_tool_calls false)."""
    if body.get("model") is None:
        raise bad("model is required", "model")
    _check_type(body, "model", str, "a string")
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    chat = {"model": body["model"], "messages": messages}
    choice, single = _tool_choice(body.get("tool_choice"), tools)
    if tools:
        chat["tools"] = tools
    if choice is not None:
        chat["tool_choice"] = choice
    if single:
        chat["parallel_tool_calls"] = False
    return chat


def _check_type(value: dict, name: str, kind, want: str, where: str = "") -> None:
    v = value.get(name)
    if isinstance(v, bool) or not isinstance(v, kind):
        raise bad(f"{where}{name} must be {want}, got {json.dumps(v)[:60]}", f"{where}{name}")


def _system(value) -> list[dict]:
    """The system message, without a billing-header line at its start (its own block,
    as Claude Code sends it, or the first line of the text)."""
    if value is None:
        return []
    if isinstance(value, list) and value and isinstance(value[0], dict) and isinstance(value[0].get("text"), str):
        value = [{**value[0], "text": BILLING_HEADER.sub("", value[0]["text"], count=1)}, *value[1:]]
    elif isinstance(value, str):
        value = BILLING_HEADER.sub("", value, count=1)
    return [{"role": "system", "content": _text(value, "system")}]


def _text(value, where: str) -> str:
    """A string, or text blocks (joined)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"{where} must be a string or a list of text blocks", where)
    texts = []
    for i, block in enumerate(value):
        at = f"{where}[{i}]"
        _block_type(block, at, ("text",))
        texts.append(_text_block(block, at))
    return "".join(texts)


def _block_type(block, at: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(block, dict):
        raise bad(f"{at} must be a content block object", at)
    kind = block.get("type")
    if kind not in allowed:
        raise bad(f"{at}.type: {json.dumps(kind)[:60]} blocks are not supported here (supported: "
                  f"{', '.join(allowed)})", f"{at}.type")
    return kind


def _text_block(block: dict, at: str) -> str:
    refuse_unknown(block, {"type", "text", "cache_control", "citations"}, f"{at}.")
    if block.get("citations"):
        raise bad(f"{at}.citations: citations are not supported", f"{at}.citations")
    if not isinstance(block.get("text"), str):
        raise bad(f"{at}.text must be a string", f"{at}.text")
    return block["text"]


def _messages(value) -> list[dict]:
    if value is None:
        raise bad("messages is required", "messages")
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{at} must be an object", at)
        refuse_unknown(m, {"role", "content"}, f"{at}.")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant", "system"):
            raise bad(f"{at}.role must be \"user\" or \"assistant\", got {json.dumps(role)[:60]}", f"{at}.role")
        if content is None:
            raise bad(f"{at}.content is required", f"{at}.content")
        if role == "system":
            out.append({"role": "system", "content": _text(content, f"{at}.content")})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise bad(f"{at}.content must be a string or a list of content blocks", f"{at}.content")
        elif not content:
            raise bad(f"{at}.content is an empty list: a message needs at least one content block", f"{at}.content")
        elif role == "user":
            out += _user_blocks(content, f"{at}.content")
        else:
            out.append(_assistant_blocks(content, f"{at}.content"))
    if value[-1].get("role") == "assistant":
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
        kind = _media_block_type(block, at, ("text", "image", "tool_result"))
        if kind != "tool_result":
            if not parts:
                out.append({"role": "user"})
            parts.append(_part(block, kind, at))
            out[-1]["content"] = images.message_content(parts)
            continue
        parts = []
        refuse_unknown(block, {"type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"},
                      f"{at}.")
        if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
            raise bad(f"{at}.tool_use_id must be a non-empty string", f"{at}.tool_use_id")
        content = block.get("content")
        if content is None or isinstance(content, str):
            result = [content or ""]
        elif isinstance(content, list):
            result = [_part(b, _media_block_type(b, f"{at}.content[{j}]", ("text", "image")), f"{at}.content[{j}]")
                      for j, b in enumerate(content)]
        else:
            raise bad(f"{at}.content must be a string or a list of text and image blocks", f"{at}.content")
        error = block.get("is_error")
        if error is not None and not isinstance(error, bool):
            raise bad(f"{at}.is_error must be true or false", f"{at}.is_error")
        if error:  # the template has no error flag: the model reads it in the text
            result.insert(0, "Error: ")
        out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": images.message_content(result)})
    return out


def _media_block_type(block, at: str, allowed: tuple[str, ...]) -> str:
    """_block_type, with a video block refused as such."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in images.VIDEO_PARTS:
        images.refuse_video(kind, at)
    return _block_type(block, at, allowed)


def _part(block: dict, kind: str, at: str):
    """A text block's text, or an image block's item (images.py)."""
    if kind == "image":
        return images.anthropic_image(block, at)
    return _text_block(block, at)


def _assistant_blocks(blocks: list, where: str) -> dict:
    """Text, thinking and tool_use blocks -> one assistant message."""
    texts, reasoning, calls = [], [], []
    for i, block in enumerate(blocks):
        at = f"{where}[{i}]"
        kind = _block_type(block, at, ("text", "thinking", "redacted_thinking", "tool_use"))
        if kind == "redacted_thinking":  # another provider's sealed reasoning: nothing here can read it
            refuse_unknown(block, {"type", "data"}, f"{at}.")
        elif kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "thinking":
            refuse_unknown(block, {"type", "thinking", "signature"}, f"{at}.")
            if not isinstance(block.get("thinking"), str):
                raise bad(f"{at}.thinking must be a string", f"{at}.thinking")
            reasoning.append(block["thinking"])
        else:
            refuse_unknown(block, {"type", "id", "name", "input", "cache_control", "caller", "toolset_name"}, f"{at}.")
            for name in ("id", "name"):
                if not isinstance(block.get(name), str) or not block[name]:
                    raise bad(f"{at}.{name} must be a non-empty string", f"{at}.{name}")
            if not isinstance(block.get("input"), dict):
                raise bad(f"{at}.input must be an object", f"{at}.input")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
    message = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(value) -> list[dict] | None:
    out = []
    for at, tool in tool_entries(value, "{\"name\", \"description\", \"input_schema\"} objects"):
        if not isinstance(tool, dict):
            raise bad(f"{at} must be an object", at)
        if tool.get("type") not in (None, "custom"):
            raise bad(f"{at}.type: {json.dumps(tool.get('type'))[:60]} tools (server tools) are not supported; "
                      "only client tools with an input_schema", f"{at}.type")
        refuse_unknown(tool, TOOL_FIELDS, f"{at}.")
        name, description, schema = tool_fields(tool, at, "input_schema", schema_required=True)
        for flag in ("eager_input_streaming", "strict", "defer_loading"):
            if tool.get(flag) is not None and not isinstance(tool[flag], bool):
                raise bad(f"{at}.{flag} must be true or false", f"{at}.{flag}")
        # in the order OpenAI's function objects have
        out.append(chat_tool(name=name, description=description, parameters=schema))
    return out or None


def _tool_choice(value, tools: list[dict] | None) -> tuple[object, bool]:
    """(the OpenAI tool_choice, exactly one call to any tool)."""
    if value is None:
        return None, False
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
    refuse_unknown(value, {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set()),
                  "tool_choice.")
    single = value.get("disable_parallel_tool_use")
    if single is not None and not isinstance(single, bool):
        raise bad("tool_choice.disable_parallel_tool_use must be true or false",
                  "tool_choice.disable_parallel_tool_use")
    if single and kind == "auto":
        raise bad("tool_choice.disable_parallel_tool_use with type \"auto\" is not supported (at most one call "
                  "cannot be enforced; use \"any\" or \"tool\", which it makes exactly one)",
                  "tool_choice.disable_parallel_tool_use")
    if kind in ("auto", "none"):
        return kind, False
    if not tools:
        raise bad(f"tool_choice \"{kind}\" needs tools", "tool_choice")
    if kind == "any":
        return "required", bool(single)
    if not isinstance(value.get("name"), str):
        raise bad("tool_choice.name must be a string", "tool_choice.name")
    if not named(tools, value["name"]):
        raise bad(f"tool_choice names tool {value['name']!r}, which is not in tools", "tool_choice.name")
    return {"type": "function", "function": {"name": value["name"]}}, False
