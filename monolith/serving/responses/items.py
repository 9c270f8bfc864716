"""Responses API items -> chat messages: `input` (and a stored response's `output`)
as the chat path's messages. Messages with text parts (and, in user messages,
`input_image` parts), `function_call`, `function_call_output` (its output a string, or
input_text and input_image parts: images.py), `custom_tool_call`,
`custom_tool_call_output` and `reasoning` items; the items of one assistant turn
(reasoning, message, calls) become one assistant message. A call of a namespace's tool
is named as the model saw it (`flat_name`); a custom tool's call has one argument,
`input`; a reasoning item's `encrypted_content` (seal.py) is opened and stands
for its text."""

from __future__ import annotations

import json

from .. import images
from ..errors import bad
from ..fields import is_name, refuse_extra
from ..tools.calls import arguments_object
from ..tools.specs import json_arguments
from .seal import SEALER, SUMMARY_HEAD, open_summary

SEPARATOR = "."  # a namespace's tool as the model sees it: NAMESPACE.NAME (tools.py)

TEXT_PARTS = {"user": "input_text", "system": "input_text", "developer": "input_text", "assistant": "output_text"}
PHASES = ("commentary", "final_answer")  # an assistant message's phase: accepted, not rendered
PART_KEYS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs"}}
ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "namespace", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status", "name", "namespace"},
    "custom_tool_call": {"type", "call_id", "name", "namespace", "input", "id", "status"},
    "custom_tool_call_output": {"type", "call_id", "output", "id", "status", "name", "namespace"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
    "compaction": {"type", "id", "encrypted_content", "created_by"},
}


def flat_name(name: str, namespace: str | None) -> str:
    """The name the model sees of a tool (in a namespace or not)."""
    return name if namespace is None else f"{namespace}{SEPARATOR}{name}"


def items_to_messages(items: list, where: str, known_calls: set | None = None) -> list[dict]:
    """Input (or output) items -> chat messages: consecutive reasoning, assistant message
    and function_call items make one assistant message."""
    talk = _Conversation(known_calls)
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{at} must be an object", at)
        kind = item.get("type", "message" if "role" in item else None)
        if not is_name(kind, ITEM_KEYS):
            raise bad(f"{at}.type must be one of {', '.join(ITEM_KEYS)} (other item types are not supported), "
                      f"got {json.dumps(kind)[:60]}", f"{at}.type")
        refuse_extra(item, ITEM_KEYS[kind], at, f"{at} ({kind})")
        if kind == "message":
            _message(item, at, talk)
        elif kind == "compaction":  # a window from POST /v1/responses/compact: its summary, as the user's
            summary = open_summary(item.get("encrypted_content"), f"{at}.encrypted_content")
            talk.add({"role": "user", "content": SUMMARY_HEAD + summary, "compaction": True})
        elif kind == "reasoning":
            talk.flush()
            talk.turn = {"role": "assistant", "reasoning_content": _reasoning(item, at)}
        elif kind in ("function_call", "custom_tool_call"):
            _call(item, kind, at, talk)
        else:  # function_call_output, custom_tool_call_output
            call_id = string_field(item, "call_id", at)
            if call_id not in talk.known_calls:
                raise bad(f"{at}.call_id {call_id!r} answers no tool call of this conversation",
                          f"{at}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _parts(output, {"input_text"}, f"{at}.output", "tool")
            talk.add({"role": "tool", "content": text, "tool_call_id": call_id})
    talk.flush()
    return talk.messages


class _Conversation:
    """The chat messages so far, and the assistant message being assembled (`turn`)."""

    def __init__(self, known_calls: set | None):
        self.messages: list[dict] = []
        self.turn: dict | None = None
        self.known_calls = set(known_calls or ())  # the call ids an output may answer

    def flush(self) -> None:
        """The assistant message being assembled, ended."""
        if self.turn is not None:
            self.turn.setdefault("content", "")
            self.messages.append(self.turn)
            self.turn = None

    def add(self, message: dict) -> None:
        """A message that ends the assistant's turn."""
        self.flush()
        self.messages.append(message)

    def assistant(self) -> dict:
        """The assistant message being assembled (a new one if none is)."""
        self.turn = self.turn or {"role": "assistant"}
        return self.turn


def _message(item: dict, at: str, talk: _Conversation) -> None:
    role = item.get("role")
    if not is_name(role, TEXT_PARTS):
        raise bad(f"{at}.role must be one of {', '.join(TEXT_PARTS)}, got {json.dumps(role)[:60]}", f"{at}.role")
    if item.get("phase") is not None and (role != "assistant" or item["phase"] not in PHASES):
        raise bad(f"{at}.phase must be one of {', '.join(PHASES)} on an assistant message, got "
                  f"{json.dumps(item['phase'])[:60]}", f"{at}.phase")
    text = _text_content(item.get("content"), TEXT_PARTS[role], role, f"{at}.content")
    if role != "assistant":
        talk.add({"role": "system" if role == "developer" else role, "content": text})
        return
    if talk.turn is not None and (talk.turn.get("content") or talk.turn.get("tool_calls")):
        talk.flush()
    talk.assistant()["content"] = text


def _reasoning(item: dict, at: str) -> str:
    """A reasoning item's text: its encrypted_content opened, or its content (or summary) parts."""
    if item.get("encrypted_content") is not None:
        return SEALER.open(item["encrypted_content"], f"{at}.encrypted_content")
    parts = item.get("content") or item.get("summary") or []
    return _parts(parts, {"reasoning_text", "summary_text"}, f"{at}.{'content' if item.get('content') else 'summary'}")


def _call(item: dict, kind: str, at: str, talk: _Conversation) -> None:
    """A function_call or custom_tool_call, added to the assistant's turn."""
    call_id, name = string_field(item, "call_id", at), string_field(item, "name", at)
    if item.get("namespace") is not None:
        name = flat_name(name, string_field(item, "namespace", at))
    if kind == "function_call" and item.get("status") == "incomplete":  # cut by max_output_tokens
        parsed = arguments_object(string_field(item, "arguments", at, empty=True))  # the members written
    elif kind == "function_call":
        parsed = json_arguments(string_field(item, "arguments", at, empty=True), f"{at}.arguments")
    else:
        parsed = {"input": string_field(item, "input", at, empty=True)}
    talk.assistant().setdefault("tool_calls", []).append(
        {"type": "function", "id": call_id, "function": {"name": name, "arguments": parsed}})
    talk.known_calls.add(call_id)


def string_field(item: dict, name: str, at: str, empty: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not (value or empty):
        raise bad(f"{at}.{name} must be a {'' if empty else 'non-empty '}string", f"{at}.{name}")
    return value


def _text_content(value, part_type: str, role: str, where: str) -> str | list[dict]:
    if isinstance(value, str):
        return value
    return _parts(value, {part_type}, where, role)


def _parts(value, kinds: set[str], where: str, role: str | None = None) -> str | list[dict]:
    """The text of `kinds` parts joined; with a `role`, input_image parts too (the
    content then a list: images.py)."""
    if not isinstance(value, list):
        raise bad(f"{where} must be a string or a list of {' / '.join(sorted(kinds))} parts", where)
    items = []
    for i, part in enumerate(value):
        at = f"{where}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and role is not None:
            items.append(images.openai_image(part, role, at))
            continue
        if kind in images.VIDEO_PARTS:
            images.refuse_video(kind, at)
        if not is_name(kind, kinds):
            raise bad(f"{at}: only {' / '.join(sorted(kinds))} parts are supported here, got "
                      f"{json.dumps(kind)[:60]}", f"{at}.type" if isinstance(part, dict) else at)
        refuse_extra(part, PART_KEYS.get(kind, {"type", "text"}), at)
        if not isinstance(part.get("text"), str):
            raise bad(f"{at}.text must be a string", f"{at}.text")
        items.append(part["text"])
    return images.message_content(items)
