"""Responses API items, typed (`Item`), -> chat messages: `input` (and a stored response's `output`)
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
from typing import Annotated, Any, Literal

from pydantic import Field, RootModel, Tag, model_validator

from .. import images
from ..errors import bad
from ..fields import Object, Strict, Text, by_type, parse
from ..tools.calls import arguments_object
from ..tools.specs import json_arguments
from .seal import SEALER, SUMMARY_HEAD, open_summary

SEPARATOR = "."  # a namespace's tool as the model sees it: NAMESPACE.NAME (tools.py)

TEXT_PARTS = {"user": "input_text", "system": "input_text", "developer": "input_text", "assistant": "output_text"}
PHASES = ("commentary", "final_answer")  # an assistant message's phase: accepted, not rendered
NAME = Annotated[Text, Field(min_length=1)]


class TextPart(Strict):
    type: Literal["input_text", "reasoning_text", "summary_text"]
    text: Text


class OutputText(Strict):
    type: Literal["output_text"]
    text: Text
    annotations: Any = None
    logprobs: Any = None


class OtherPart(Strict, extra="allow"):
    """A part of a type no item takes: refused naming its type."""

    type: Literal["input_text", "output_text", "input_image", "reasoning_text", "summary_text"]


class VideoPart(Strict, extra="allow"):
    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, part):
        raise ValueError(f"video input ({part['type']!r} parts) is not supported; send images")


PARTS = {"input_text": "text", "reasoning_text": "text", "summary_text": "text", "output_text": "output",
         "input_image": "image", **{kind: "video" for kind in images.VIDEO_PARTS}}
# a content part (an image: images.py reads it)
Part = Annotated[Annotated[TextPart, Tag("text")] | Annotated[OutputText, Tag("output")]
                 | Annotated[Object, Tag("image")] | Annotated[VideoPart, Tag("video")]
                 | Annotated[OtherPart, Tag("other")], by_type(PARTS)]


class Message(Strict):
    type: Literal["message"] = "message"
    role: Literal[tuple(TEXT_PARTS)]
    content: Text | list[Part]
    id: Any = None
    status: Any = None
    phase: Any = None  # accepted on an assistant message, not rendered


class Call(Strict):
    """A function_call or custom_tool_call."""

    type: Literal["function_call", "custom_tool_call"]
    call_id: NAME
    name: NAME
    namespace: Text | None = None
    arguments: Text | None = None  # a function call's
    input: Text | None = None  # a custom tool call's
    id: Any = None
    status: Any = None


class CallOutput(Strict):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: NAME
    output: Text | list[Part]
    id: Any = None
    status: Any = None
    name: Any = None
    namespace: Any = None


class Reasoning(Strict):
    type: Literal["reasoning"]
    id: Any = None
    summary: list[Part] | None = None
    content: list[Part] | None = None
    encrypted_content: Any = None  # seal.py opens it
    status: Any = None


class Compaction(Strict):
    type: Literal["compaction"]
    id: Any = None
    encrypted_content: Any = None  # seal.py opens it
    created_by: Any = None


class OtherItem(Strict, extra="allow"):
    """An item of a type this server does not take: refused naming its type."""

    type: Literal["message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
                  "reasoning", "compaction"]


ITEMS = {"message": "message", "function_call": "call", "custom_tool_call": "call", "function_call_output": "output",
         "custom_tool_call_output": "output", "reasoning": "reasoning", "compaction": "compaction"}
Item = Annotated[Annotated[Message, Tag("message")] | Annotated[Call, Tag("call")]
                 | Annotated[CallOutput, Tag("output")] | Annotated[Reasoning, Tag("reasoning")]
                 | Annotated[Compaction, Tag("compaction")] | Annotated[OtherItem, Tag("other")],
                 by_type(ITEMS, implied="message")]


class Items(RootModel[list[Item]]):
    pass


def flat_name(name: str, namespace: str | None) -> str:
    """The name the model sees of a tool (in a namespace or not)."""
    return name if namespace is None else f"{namespace}{SEPARATOR}{name}"


def output_messages(items: list[dict]) -> list[dict]:
    """A response's output items (as the reply wrote them) -> chat messages."""
    return items_to_messages(items, "output")


def items_to_messages(items: list, where: str, known_calls: set | None = None) -> list[dict]:
    """Input (or output) items (`where`: their path) -> chat messages: consecutive
    reasoning, assistant message and function_call items make one assistant message."""
    talk = _Conversation(known_calls)
    for i, item in enumerate(parse(Items, items, where).root):
        at = f"{where}[{i}]"
        if isinstance(item, Message):
            _message(item, at, talk)
        elif isinstance(item, Compaction):  # a window from POST /v1/responses/compact: its summary, as the user's
            summary = open_summary(item.encrypted_content, f"{at}.encrypted_content")
            talk.add({"role": "user", "content": SUMMARY_HEAD + summary, "compaction": True})
        elif isinstance(item, Reasoning):
            talk.flush()
            talk.turn = {"role": "assistant", "reasoning_content": _reasoning(item, at)}
        elif isinstance(item, Call):
            _call(item, at, talk)
        else:  # function_call_output, custom_tool_call_output
            if item.call_id not in talk.known_calls:
                raise bad(f"{at}.call_id {item.call_id!r} answers no tool call of this conversation",
                          f"{at}.call_id")
            text = item.output if isinstance(item.output, str) else _parts(item.output, {"input_text"},
                                                                             f"{at}.output", "tool")
            talk.add({"role": "tool", "content": text, "tool_call_id": item.call_id})
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


def _message(item: Message, at: str, talk: _Conversation) -> None:
    role = item.role
    if item.phase is not None and (role != "assistant" or item.phase not in PHASES):
        raise bad(f"{at}.phase must be one of {', '.join(PHASES)} on an assistant message, got "
                  f"{json.dumps(item.phase)[:60]}", f"{at}.phase")
    content = item.content
    text = content if isinstance(content, str) else _parts(content, {TEXT_PARTS[role]}, f"{at}.content", role)
    if role != "assistant":
        talk.add({"role": "system" if role == "developer" else role, "content": text})
        return
    if talk.turn is not None and (talk.turn.get("content") or talk.turn.get("tool_calls")):
        talk.flush()
    talk.assistant()["content"] = text


def _reasoning(item: Reasoning, at: str) -> str:
    """A reasoning item's text: its encrypted_content opened, or its content (or summary) parts."""
    if item.encrypted_content is not None:
        return SEALER.open(item.encrypted_content, f"{at}.encrypted_content")
    parts = item.content or item.summary or []
    return _parts(parts, {"reasoning_text", "summary_text"}, f"{at}.{'content' if item.content else 'summary'}")


def _call(item: Call, at: str, talk: _Conversation) -> None:
    """A function_call or custom_tool_call, added to the assistant's turn."""
    name = item.name if item.namespace is None else flat_name(item.name, item.namespace)
    if item.type == "function_call":
        arguments = _given(item.arguments, "arguments", at)
        if item.status == "incomplete":  # cut by max_output_tokens
            parsed = arguments_object(arguments)  # the members written
        else:
            parsed = json_arguments(arguments, f"{at}.arguments")
    else:
        parsed = {"input": _given(item.input, "input", at)}
    talk.assistant().setdefault("tool_calls", []).append(
        {"type": "function", "id": item.call_id, "function": {"name": name, "arguments": parsed}})
    talk.known_calls.add(item.call_id)


def _given(value: str | None, name: str, at: str) -> str:
    if value is None:
        raise bad(f"{at}.{name} must be a string", f"{at}.{name}")
    return value


def _parts(parts: list, kinds: set[str], where: str, role: str | None = None) -> str | list[dict]:
    """The text of `kinds` parts joined; with a `role`, input_image parts too (the
    content then a list: images.py)."""
    items = []
    for i, part in enumerate(parts):
        at = f"{where}[{i}]"
        kind = part.type if isinstance(part, Strict) else "input_image"
        if kind == "input_image" and role is not None:
            items.append(images.openai_image(part, role, at))
            continue
        if kind not in kinds:
            raise bad(f"{at}: only {' / '.join(sorted(kinds))} parts are supported here, got {json.dumps(kind)}",
                      f"{at}.type")
        items.append(part.text)
    return images.message_content(items)
