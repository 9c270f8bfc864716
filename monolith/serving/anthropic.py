"""Anthropic's Messages API on the chat path: POST /v1/messages and
/v1/messages/count_tokens (issue 17).

A request is checked here, field by field (an unknown field, block type or value this
server cannot honour is a 400 naming it), and turned into the OpenAI-shaped chat body
the rest of the server reads (schemas.parse_chat_request): `system` becomes a system
message, `tool_use` blocks assistant `tool_calls`, `tool_result` blocks `tool`
messages, `thinking` blocks `reasoning_content`; `tools` with `input_schema` become
functions with `parameters`; `tool_choice` any -> "required", tool -> the named
function (both grammar-constrained, schemas.py / structured.py); `thinking` ->
chat_template_kwargs enable_thinking.

`thinking.budget_tokens` below max_tokens is enforced (`budget_grammar`): after that many
reasoning tokens the `</think>` token is forced (runtime.grammar's budget; through
speculation too), then the answer follows, free or as the tool calls any/tool ask for.
It needs a template that opens the think block (Qwen3.6's does with thinking on), else
it is refused. A budget at or above max_tokens is max_tokens itself. `cache_control`
marks are accepted: the prompt cache keeps every prefix on its own, so they change
nothing.

`MessagesFormat` writes the reply: content blocks in the order the model wrote them
(`thinking` from the reasoning split, `text`, `tool_use` with the parsed input),
`stop_reason`, and usage with `input_tokens` (prompt tokens that were prefilled),
`cache_read_input_tokens` (the prompt cache's hits) and `cache_creation_input_tokens`
(0: nothing is billed for writing the cache). The non-streamed body is built from the
same events as the stream, so both give the same message.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace

from ..runtime.events import Delta, Finished
from ..runtime.grammar import Grammar, GrammarError
from .errors import APIError, bad
from .reasoning import ReasoningSplitter
from .schemas import MAX_STOP_STRINGS, ChatRequest, SamplingDefaults, parse_chat_request
from .structured import THINK_END, Structure
from .tools import ToolCallParser

MESSAGE_FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
                  "top_p", "top_k", "tools", "tool_choice", "thinking", "metadata"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking"}
MAX_TEMPERATURE = 1.0  # Anthropic's range: [0, 1]
TOOL_FIELDS = {"name", "description", "input_schema", "type", "cache_control"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


@dataclass(frozen=True)
class MessagesRequest:
    chat: ChatRequest  # what the engine runs
    model: str
    tools: list[dict] | None  # OpenAI-shaped, for the tool-call parser (None: calls are not read)
    budget: int | None = None  # thinking.budget_tokens when it is below max_tokens (budget_grammar)


# ------------------------------------------------------------------ errors


def error_body(e: APIError) -> dict:
    kind = ERROR_TYPES.get(e.status) or ("api_error" if e.status >= 500 else "invalid_request_error")
    if e.code == "model_load_failed":
        kind = "api_error"
    return {"type": "error", "error": {"type": kind, "message": e.message},
            "request_id": "req_" + uuid.uuid4().hex[:24]}


# ------------------------------------------------------------------ requests


def parse_messages_request(body: dict, defaults: SamplingDefaults) -> MessagesRequest:
    _check_fields(body, MESSAGE_FIELDS, "")
    if body.get("max_tokens") is None:
        raise bad("max_tokens is required (the Messages API has no default)", "max_tokens")
    _check_type(body, "max_tokens", int, "an integer >= 1")
    if body["max_tokens"] < 1:
        raise bad(f"max_tokens must be an integer >= 1, got {body['max_tokens']}", "max_tokens")
    chat, single = _chat_body(body)
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
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("metadata must be an object like {\"user_id\": ...}", "metadata")
    thinking, budget = _thinking(body.get("thinking"))
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    return _request(chat, single, defaults, budget if budget is not None and budget < body["max_tokens"] else None)


def parse_count_tokens_request(body: dict, defaults: SamplingDefaults) -> MessagesRequest:
    _check_fields(body, COUNT_FIELDS, "")
    chat, single = _chat_body(body)
    thinking, _ = _thinking(body.get("thinking"))
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    return _request(chat, single, defaults)


def _request(chat: dict, single: bool, defaults: SamplingDefaults, budget: int | None = None) -> MessagesRequest:
    req = parse_chat_request(chat, defaults)
    if single:
        s = req.structure
        req = replace(req, structure=Structure(s.kind, s.param, s.schema, s.tools, single=True))
    return MessagesRequest(req, chat["model"], req.tools, budget)


def _chat_body(body: dict) -> tuple[dict, bool]:
    """The OpenAI-shaped chat body of the fields the two endpoints share, and whether the
    output must be exactly one call to any of the tools (any + disable_parallel_tool_use)."""
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
    return chat, single


def _check_fields(value: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(value) - known)
    if unknown:
        names = ", ".join(f"{where}{k}" for k in unknown)
        raise bad(f"unsupported field{'s' if len(unknown) > 1 else ''}: {names} (fields that would change the "
                  "result are refused, not ignored)", f"{where}{unknown[0]}")


def _check_type(value: dict, name: str, kind, want: str, where: str = "") -> None:
    v = value.get(name)
    if isinstance(v, bool) or not isinstance(v, kind):
        raise bad(f"{where}{name} must be {want}, got {json.dumps(v)[:60]}", f"{where}{name}")


def _thinking(value) -> tuple[bool | None, int | None]:
    """(enable_thinking for the template (None: the template's default), the budget)."""
    if value is None:
        return None, None
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "disabled"):
        raise bad("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}",
                  "thinking")
    if value["type"] == "disabled":
        _check_fields(value, {"type"}, "thinking.")
        return False, None
    _check_fields(value, {"type", "budget_tokens"}, "thinking.")
    _check_type(value, "budget_tokens", int, "an integer >= 1", "thinking.")
    budget = value["budget_tokens"]
    if budget < 1:
        raise bad(f"thinking.budget_tokens must be >= 1, got {budget}", "thinking.budget_tokens")
    return True, budget


def budget_grammar(req: MessagesRequest, reasoning_open: bool, constraint: Grammar | None, tokenizer,
                   grammar_tokenizer) -> Grammar:
    """The grammar that ends the reasoning after req.budget tokens (the `</think>` token
    is then forced: runtime.grammar's budget), then lets the answer be free text, or
    what `constraint` (which starts after `</think>`) asks for."""
    end = tokenizer.token_to_id(THINK_END)
    if not reasoning_open or end is None:
        raise bad(f"thinking.budget_tokens {req.budget} is below max_tokens, but this model's chat template does "
                  "not open a reasoning block, so the budget cannot be enforced; send budget_tokens >= max_tokens",
                  "thinking.budget_tokens")
    if constraint is not None:
        return replace(constraint, budget=req.budget)
    grammar = Grammar("start: /(?s:.*)/", end, req.budget)
    try:
        grammar_tokenizer.check(grammar)
    except GrammarError as e:  # not expected: the grammar allows any text
        raise APIError(500, f"the reasoning budget's grammar was refused: {e}") from None
    return grammar


def _system(value) -> list[dict]:
    if value is None:
        return []
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
    _check_fields(block, {"type", "text", "cache_control", "citations"}, f"{at}.")
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
        _check_fields(m, {"role", "content"}, f"{at}.")
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
    """Text blocks -> user messages, tool_result blocks -> tool messages, in order."""
    out: list[dict] = []
    for i, block in enumerate(blocks):
        at = f"{where}[{i}]"
        if _block_type(block, at, ("text", "tool_result")) == "text":
            text = _text_block(block, at)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
            continue
        _check_fields(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, f"{at}.")
        if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
            raise bad(f"{at}.tool_use_id must be a non-empty string", f"{at}.tool_use_id")
        content = block.get("content")
        text = "" if content is None else _text(content, f"{at}.content")
        error = block.get("is_error")
        if error is not None and not isinstance(error, bool):
            raise bad(f"{at}.is_error must be true or false", f"{at}.is_error")
        if error:  # the template has no error flag: the model reads it in the text
            text = "Error: " + text
        out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
    return out


def _assistant_blocks(blocks: list, where: str) -> dict:
    """Text, thinking and tool_use blocks -> one assistant message."""
    texts, reasoning, calls = [], [], []
    for i, block in enumerate(blocks):
        at = f"{where}[{i}]"
        kind = _block_type(block, at, ("text", "thinking", "tool_use"))
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "thinking":
            _check_fields(block, {"type", "thinking", "signature"}, f"{at}.")
            if not isinstance(block.get("thinking"), str):
                raise bad(f"{at}.thinking must be a string", f"{at}.thinking")
            reasoning.append(block["thinking"])
        else:
            _check_fields(block, {"type", "id", "name", "input", "cache_control"}, f"{at}.")
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
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad("tools must be a list of {\"name\", \"description\", \"input_schema\"} objects", "tools")
    out = []
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"{at} must be an object", at)
        if tool.get("type") not in (None, "custom"):
            raise bad(f"{at}.type: {json.dumps(tool.get('type'))[:60]} tools (server tools) are not supported; "
                      "only client tools with an input_schema", f"{at}.type")
        _check_fields(tool, TOOL_FIELDS, f"{at}.")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad(f"{at}.name must be a non-empty string", f"{at}.name")
        if not isinstance(tool.get("input_schema"), dict):
            raise bad(f"{at}.input_schema must be a JSON schema object", f"{at}.input_schema")
        fn = {"name": tool["name"]}  # in the order OpenAI's function objects have
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise bad(f"{at}.description must be a string", f"{at}.description")
            fn["description"] = tool["description"]
        fn["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(value, tools: list[dict] | None) -> tuple[object, bool]:
    """(the OpenAI tool_choice, exactly one call to any tool)."""
    if value is None:
        return None, False
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
    _check_fields(value, {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set()),
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
    if value["name"] not in [t["function"]["name"] for t in tools]:
        raise bad(f"tool_choice names tool {value['name']!r}, which is not in tools", "tool_choice.name")
    return {"type": "function", "function": {"name": value["name"]}}, False



# ------------------------------------------------------------------ replies


def sse(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class MessagesFormat:
    """Anthropic `message` bodies and their stream of events (the format interface the
    app's _generate drives; see responses.ChatFormat)."""

    def __init__(self, model: str, req: MessagesRequest, reasoning_open: bool, prompt_tokens: int, tokenizer):
        self.id = "msg_" + uuid.uuid4().hex
        self.model = model
        self.stops = req.chat.stop
        self.max_tokens = req.chat.max_tokens
        self.prompt_tokens = prompt_tokens
        self.tokenizer = tokenizer  # to tell which stop sequence ended the text
        self.splitter = ReasoningSplitter(reasoning_open)
        self.parser = ToolCallParser(req.tools) if req.tools else None
        self.raw: list[str] = []  # the text as the engine released it
        self.content: list[dict] = []  # the blocks so far (what the events add up to)
        self.open: str | None = None  # the type of the block being written
        self.blank = ""  # whitespace held back in a text block when tools are on (see _text)
        self.calls = 0

    # ---------------------------------------------------------------- the format interface

    def collect(self, delta: Delta) -> None:
        self.stream_delta(delta, False)

    def response(self, finished: Finished) -> dict:
        self.stream_finish(finished, False)
        reason, sequence = self._stop(finished)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": self._usage(finished)}

    def stream_start(self, include_usage: bool) -> list[dict]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                 "cache_creation_input_tokens": 0}
        return [{"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}}]

    def stream_delta(self, delta: Delta, include_usage: bool) -> list[dict]:
        self.raw.append(delta.text)
        return self._pieces(self.splitter.feed(delta.text))

    def stream_finish(self, finished: Finished, include_usage: bool) -> list[dict]:
        events = self._pieces(self.splitter.finish())
        if self.parser is not None:
            events += self._content(*self.parser.finish())
        events += self._close()
        reason, sequence = self._stop(finished)
        return events + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": self._usage(finished)},
                         {"type": "message_stop"}]

    def event(self, chunk: dict) -> str:
        return sse(chunk["type"], chunk)

    def keepalive(self) -> str:
        return sse("ping", {"type": "ping"})

    def failure(self, error: APIError) -> str:
        return sse("error", error_body(error))

    def end(self) -> str:
        return ""

    # ---------------------------------------------------------------- blocks

    def _pieces(self, pieces: tuple[str, str]) -> list[dict]:
        reasoning, text = pieces
        events = []
        if reasoning:
            events += self._delta("thinking", reasoning)
        if text:
            events += self._content(*self.parser.feed(text)) if self.parser is not None else self._text(text)
        return events

    def _content(self, text: str, calls) -> list[dict]:
        events = self._text(text) if text else []
        for call in calls:
            events += self._close()
            index = len(self.content)
            block = {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
                     "input": {}}
            events.append({"type": "content_block_start", "index": index, "content_block": dict(block)})
            block["input"] = json.loads(call.arguments)
            self.content.append(block)
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
            events.append({"type": "content_block_stop", "index": index})
        return events

    def _text(self, text: str) -> list[dict]:
        """Text as it comes; with tools on, the whitespace around tool calls is dropped
        (as parse_tool_calls strips the content): a text block opens at its first
        non-blank character and blanks are held until more text follows them."""
        if self.parser is None:
            return self._delta("text", text)
        text = self.blank + text
        body = text.rstrip()
        self.blank = text[len(body):]
        if self.open != "text":
            body = body.lstrip()
        return self._delta("text", body) if body else []

    def _delta(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open != kind:
            events += self._close()
            block = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}
            events.append({"type": "content_block_start", "index": len(self.content), "content_block": dict(block)})
            self.content.append(block)
            self.open = kind
        self.content[-1][kind] += text
        key = "text_delta" if kind == "text" else "thinking_delta"
        events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                       "delta": {"type": key, kind: text}})
        return events

    def _close(self) -> list[dict]:
        self.blank = ""
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    # ---------------------------------------------------------------- the end

    def _stop(self, finished: Finished) -> tuple[str, str | None]:
        if any(block["type"] == "tool_use" for block in self.content) and finished.finish_reason == "stop":
            return "tool_use", None
        if finished.finish_reason == "length":
            if self.max_tokens is not None and finished.usage.completion_tokens < self.max_tokens:
                return "model_context_window_exceeded", None
            return "max_tokens", None
        sequence = self._stop_sequence(finished)
        return ("stop_sequence", sequence) if sequence is not None else ("end_turn", None)

    def _stop_sequence(self, finished: Finished) -> str | None:
        """The stop sequence that ended the text, if one did. The engine's Finished says
        "stop" for a stop token and a stop string alike, but a stop token counts as
        generated without being among token_ids; after a stop string, the decoded
        tokens hold it where the released text ends."""
        if finished.finish_reason != "stop" or not self.stops:
            return None
        if finished.usage.completion_tokens != len(finished.token_ids):  # a stop token ended it
            return None
        full = self.tokenizer.decode(list(finished.token_ids))
        released = len("".join(self.raw))
        hits = [(full.find(s, max(released - len(s), 0)), i) for i, s in enumerate(self.stops)]
        hits = [(at, i) for at, i in hits if at >= 0]
        return self.stops[min(hits)[1]] if hits else None

    def _usage(self, finished: Finished) -> dict:
        u = finished.usage
        return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
                "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}
