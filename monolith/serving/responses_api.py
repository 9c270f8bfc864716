"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) on the chat path.

A request is validated and turned into a ChatRequest (`parse_request`): `instructions`
becomes the system message; `input` (a string, or items: messages with text parts,
`function_call`, `function_call_output` and `reasoning` items) becomes chat messages, the
items of one assistant turn (reasoning, message, calls) merged into one assistant message;
`previous_response_id` puts the stored conversation (its input and output, not its
instructions, as OpenAI does) before the new input; flat function `tools` become chat
tools; `tool_choice` and `text.format` become the grammar the chat path already enforces.
Fields that would change the result and are not implemented are refused naming them.

The reply (`ResponseFormat`) is the generated text split into output items in order: a
`reasoning` item (the think block, as `reasoning_text` content), `message` items with
`output_text`, and `function_call` items. Streamed, the same split emits the semantic
events (`event: TYPE` + `data: {... "type", "sequence_number"}`); the non-streamed reply
runs the same split over the same deltas, so both give the same output. Whitespace
between text and a call belongs to neither. `parallel_tool_calls: false` makes a forced
call (`tool_choice` required) a single one; under `auto` the model's calls are returned
as it wrote them.

Responses are kept (unless `store: false`) in a bounded in-memory store, the last
`STORED_RESPONSES` with their whole conversation, for `previous_response_id` and GET.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from ..runtime.events import Delta, Finished
from ..sampling import SamplingError, SamplingParams
from .errors import APIError, bad
from .reasoning import ReasoningSplitter
from .schemas import (
    MAX_TEMPERATURE,
    ChatRequest,
    SamplingDefaults,
    _optional,
    _positive_int,
    _real,
    json_arguments,
)
from .structured import THINK_END, Structure
from .tools import ToolCallParser

STORED_RESPONSES = 256
FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
          "text", "stream", "store", "metadata", "parallel_tool_calls", "previous_response_id", "reasoning"}
# reasoning.effort -> Qwen's thinking switch (the template's enable_thinking): Qwen has no
# effort levels, only thinking on or off
THINKING = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}
INERT_FIELDS = {"user", "safety_identifier", "prompt_cache_key", "service_tier"}  # change nothing generated
NEUTRAL_VALUES = {"truncation": "disabled", "background": False, "include": [], "top_logprobs": 0}
TEXT_PARTS = {"user": "input_text", "system": "input_text", "developer": "input_text", "assistant": "output_text"}
PART_KEYS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs"}}
ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
FORMAT_KEYS = {"type", "name", "schema", "strict", "description"}


# ------------------------------------------------------------------ the store


class ResponseStore:
    """The last `size` responses: id -> (response body, the conversation as chat messages)."""

    def __init__(self, size: int = STORED_RESPONSES):
        self.size = size
        self.entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, body: dict, messages: list[dict]) -> None:
        self.entries[body["id"]] = (body, messages)
        self.entries.move_to_end(body["id"])
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def get(self, response_id: str, param: str) -> tuple[dict, list[dict]]:
        entry = self.entries.get(response_id)
        if entry is None:
            raise APIError(404, f"no response with id {response_id!r}: this server keeps the last {self.size} "
                           "stored responses in memory (not those sent with store: false, nor any from before "
                           "a restart)", param, "response_not_found")
        return entry


# ------------------------------------------------------------------ the request


@dataclass(frozen=True)
class ResponsesCall:
    request: ChatRequest
    history: list[dict]  # the conversation without the instructions: stored with the output
    echo: dict  # the request's settings as the response object reports them
    store: bool


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
            "truncation": "disabled", "reasoning": reasoning}
    return ResponsesCall(request, history, echo, keep is not False)


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
        if value is not None and (value != neutral or type(value) is not type(neutral)):
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


def items_to_messages(items: list, where: str, known_calls: set | None = None) -> list[dict]:
    """Input (or output) items -> chat messages: consecutive reasoning, assistant message
    and function_call items make one assistant message."""
    known_calls = set(known_calls or ())
    messages: list[dict] = []
    turn: dict | None = None  # the assistant message being assembled

    def flush():
        nonlocal turn
        if turn is not None:
            turn.setdefault("content", "")
            messages.append(turn)
            turn = None

    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{at} must be an object", at)
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ITEM_KEYS:
            raise bad(f"{at}.type must be one of {', '.join(ITEM_KEYS)} (other item types are not supported), "
                      f"got {json.dumps(kind)[:60]}", f"{at}.type")
        extra = sorted(set(item) - ITEM_KEYS[kind])
        if extra:
            raise bad(f"{at} ({kind}) has unsupported field(s): {', '.join(extra)}", f"{at}.{extra[0]}")
        if kind == "message":
            role = item.get("role")
            if role not in TEXT_PARTS:
                raise bad(f"{at}.role must be one of {', '.join(TEXT_PARTS)}, got {json.dumps(role)[:60]}",
                          f"{at}.role")
            text = _text_content(item.get("content"), TEXT_PARTS[role], f"{at}.content")
            if role != "assistant":
                flush()
                messages.append({"role": "system" if role == "developer" else role, "content": text})
                continue
            if turn is not None and (turn.get("content") or turn.get("tool_calls")):
                flush()
            turn = turn or {"role": "assistant"}
            turn["content"] = text
        elif kind == "reasoning":
            if item.get("encrypted_content") is not None:
                raise bad(f"{at}.encrypted_content: this server has no encrypted reasoning; send the reasoning "
                          "as content", f"{at}.encrypted_content")
            parts = item.get("content") or item.get("summary") or []
            text = _parts(parts, {"reasoning_text", "summary_text"},
                          f"{at}.{'content' if item.get('content') else 'summary'}")
            if turn is not None:
                flush()
            turn = {"role": "assistant", "reasoning_content": text}
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", at), _string(item, "name", at)
            parsed = json_arguments(_string(item, "arguments", at, empty=True), f"{at}.arguments")
            turn = turn or {"role": "assistant"}
            turn.setdefault("tool_calls", []).append(
                {"type": "function", "id": call_id, "function": {"name": name, "arguments": parsed}})
            known_calls.add(call_id)
        else:  # function_call_output
            call_id = _string(item, "call_id", at)
            if call_id not in known_calls:
                raise bad(f"{at}.call_id {call_id!r} answers no function_call of this conversation",
                          f"{at}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _parts(output, {"input_text"}, f"{at}.output")
            flush()
            messages.append({"role": "tool", "content": text, "tool_call_id": call_id})
    flush()
    return messages


def _string(item: dict, name: str, at: str, empty: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not (value or empty):
        raise bad(f"{at}.{name} must be a {'' if empty else 'non-empty '}string", f"{at}.{name}")
    return value


def _text_content(value, part_type: str, where: str) -> str:
    if isinstance(value, str):
        return value
    return _parts(value, {part_type}, where)


def _parts(value, kinds: set[str], where: str) -> str:
    if not isinstance(value, list):
        raise bad(f"{where} must be a string or a list of {' / '.join(sorted(kinds))} parts", where)
    texts = []
    for i, part in enumerate(value):
        at = f"{where}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise bad(f"{at}: only {' / '.join(sorted(kinds))} parts are supported here, got "
                      f"{json.dumps(kind)[:60]}", at)
        extra = sorted(set(part) - PART_KEYS.get(kind, {"type", "text"}))
        if extra:
            raise bad(f"{at} has unsupported field(s): {', '.join(extra)}", f"{at}.{extra[0]}")
        if not isinstance(part.get("text"), str):
            raise bad(f"{at}.text must be a string", f"{at}.text")
        texts.append(part["text"])
    return "".join(texts)


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
        name = _string(tool, "name", at)
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
    return dict(form), Structure("json", "text.format.schema", schema)


# ------------------------------------------------------------------ the reply


class ResponseFormat:
    """The response object and its stream events (the format interface of responses.py)."""

    def __init__(self, model: str, call: ResponsesCall, reasoning_open: bool, store: ResponseStore,
                 think_end_id: int | None):
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.call = call
        self.store = store
        self.think_end_id = think_end_id
        self.splitter = ReasoningSplitter(reasoning_open)
        self.parser = ToolCallParser(call.request.tools) if call.request.tools else None
        self.items: list[dict] = []  # the output items; the last one may be open
        self.open: dict | None = None
        self.pending = ""  # trailing whitespace of the text, held until more text or a call
        self.texts: list[str] = []
        self.sequence = 0
        self.reasoned = reasoning_open

    # ---------------------------------------------------------------- the split

    def _feed(self, text: str) -> list[dict]:
        reasoning, content = self.splitter.feed(text)
        return self._route(reasoning, content)

    def _route(self, reasoning: str, content: str, final: bool = False) -> list[dict]:
        events = self._reasoning(reasoning) if reasoning else []
        if self.parser is None:
            text, calls = content, []
        else:
            text, calls = self.parser.feed(content)
            if final:
                more, more_calls = self.parser.finish()
                text, calls = text + more, calls + more_calls
        events += self._text(text)
        for call in calls:
            self.pending = ""
            events += self._close("completed")
            events += self._call(call)
        return events

    def _finish(self, status: str) -> list[dict]:
        events = self._route(*self.splitter.finish(), final=True)
        if self.open is not None and self.open["type"] == "message" and self.pending:
            events += self._delta(self.pending)
        self.pending = ""
        return events + self._close("incomplete" if status == "incomplete" else "completed")

    def _reasoning(self, text: str) -> list[dict]:
        self.reasoned = True
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self._close("completed")
            events += self._add({"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [],
                                 "content": [], "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
        self.open["content"][0]["text"] += text
        return events + [self._at({"type": "response.reasoning_text.delta", "content_index": 0, "delta": text})]

    def _text(self, text: str) -> list[dict]:
        text, self.pending = self.pending + text, ""
        body = text.rstrip()
        self.pending = text[len(body):]
        if not body:
            return []
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close("completed")
            if self.items:  # after a reasoning item or a call: no leading blank lines
                body = body.lstrip()
            events += self._add({"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
                                 "status": "in_progress", "content": []},
                                {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        return events + self._delta(body)

    def _delta(self, text: str) -> list[dict]:
        self.open["content"][0]["text"] += text
        return [self._at({"type": "response.output_text.delta", "content_index": 0, "delta": text, "logprobs": []})]

    def _call(self, call) -> list[dict]:
        item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        events = self._add(item, None)
        item["arguments"] = call.arguments
        events += [self._at({"type": "response.function_call_arguments.delta", "delta": call.arguments}),
                   self._at({"type": "response.function_call_arguments.done", "arguments": call.arguments,
                             "name": call.name})]
        return events + self._close("completed")

    def _add(self, item: dict, part: dict | None) -> list[dict]:
        self.items.append(item)
        self.open = item
        events = [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}]
        if part is not None:
            item["content"].append(dict(part))
            events.append(self._at({"type": "response.content_part.added", "content_index": 0, "part": part}))
        return events

    def _at(self, event: dict) -> dict:
        """An event about the open item."""
        return {**event, "item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1
        item["status"] = status
        events = []
        if item["type"] != "function_call":
            part = item["content"][0]
            kind = "output_text" if part["type"] == "output_text" else "reasoning_text"
            done = {"type": f"response.{kind}.done", "item_id": item["id"], "output_index": index,
                    "content_index": 0, "text": part["text"]}
            if kind == "output_text":
                done["logprobs"] = []
            events += [done, {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                              "content_index": 0, "part": _copy(part)}]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": _copy(item)}]

    # ---------------------------------------------------------------- the object

    def _body(self, status: str, finished: Finished | None = None, error: dict | None = None) -> dict:
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
                else None, "model": self.model, "output": _copy(self.items), **self.call.echo,
                "store": self.call.store, "usage": None}
        if finished is not None:
            u = finished.usage
            body["usage"] = {"input_tokens": u.prompt_tokens,
                             "input_tokens_details": {"cached_tokens": u.cached_tokens},
                             "output_tokens": u.completion_tokens,
                             "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(finished)},
                             "total_tokens": u.total_tokens}
            if status in ("completed", "incomplete"):
                body["completed_at"] = int(time.time())
        return body

    def _reasoning_tokens(self, finished: Finished) -> int:
        """The generated tokens up to and with the `</think>` token (all of them when the
        block was never closed), 0 without reasoning."""
        if not self.reasoned:
            return 0
        ids = list(finished.token_ids)
        return ids.index(self.think_end_id) + 1 if self.think_end_id in ids else len(ids)

    def _done(self, finished: Finished) -> dict:
        status = {"stop": "completed", "length": "incomplete"}.get(finished.finish_reason, "cancelled")
        self.final_events = self._finish(status)
        body = self._body(status, finished)
        if self.call.store:
            self.store.put(body, self.call.history + items_to_messages(self.items, "output"))
        return body

    # ---------------------------------------------------------------- the format interface

    def collect(self, delta: Delta) -> None:
        self.texts.append(delta.text)

    def response(self, finished: Finished) -> dict:
        for text in self.texts:
            self._feed(text)
        return self._done(finished)

    def stream_start(self, include_usage: bool) -> list[dict]:
        return [{"type": "response.created", "response": self._body("in_progress")},
                {"type": "response.in_progress", "response": self._body("in_progress")}]

    def stream_delta(self, delta: Delta, include_usage: bool) -> list[dict]:
        return self._feed(delta.text)

    def stream_finish(self, finished: Finished, include_usage: bool) -> list[dict]:
        body = self._done(finished)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(body["status"],
                                                                                         "response.failed")
        return self.final_events + [{"type": kind, "response": body}]

    def event(self, chunk: dict) -> str:
        chunk = {**chunk, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {chunk['type']}\ndata: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def keepalive(self) -> str:
        return ": keep-alive\n\n"

    def failure(self, error: APIError) -> str:
        code = "rate_limit_exceeded" if error.status == 429 else "server_error" if error.status >= 500 \
            else "invalid_prompt"
        return self.event({"type": "response.failed",
                           "response": self._body("failed", error={"code": code, "message": error.message})})

    def end(self) -> str:
        return ""


def format_maker(model: str, call: ResponsesCall, store: ResponseStore, tokenizer):
    """make_format(reasoning_open) for the app's generate_chat."""
    think_end_id = tokenizer.token_to_id(THINK_END)
    return lambda reasoning_open: ResponseFormat(model, call, reasoning_open, store, think_end_id)


def _copy(value):
    return json.loads(json.dumps(value))
