"""Qwen tool calls in generated text -> OpenAI `tool_calls`.

Qwen models write a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Qwen3) or `<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>`
(Qwen3-Coder, Qwen3.5/3.6), the function block sometimes without the wrapper.
`ToolCallParser` reads the text as it streams: content is released as soon as it
cannot be the start of a call block (the blanks around calls, and at the ends of the
text, held back as `parse_tool_calls` strips them), and a call once its block is
complete; `writing()` is the call being written, once its block names it, with its
arguments so far (a prefix of the whole call's: `CallStream` streams them in pieces).
A JSON call's arguments are the object's text as the model wrote it, so that its pieces
add up to them exactly. A block that does not parse is still the call it names (its
arguments as far as they were written, `whole` false); one that names nothing stays
content, unless the text was cut (max_tokens): then it is dropped, never shown as text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace

from .xml_arguments import is_raw_text

OPENERS = {"<tool_call>": "</tool_call>", "<function=": "</function>"}
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_FUNCTION_OPEN = re.compile(r"<function=([^>\n]+)>")
_JSON_NAME = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's convention)
    id: str
    whole: bool = True  # False: its block was cut or did not parse; `arguments` is what was written

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallParser:
    """read(text) -> content strings and ToolCalls in order, as the text grows;
    read_end(cut) -> the rest (feed / finish: the same joined as (content, calls)). With
    `spans` a list, where each piece of content lies in the text fed is recorded there."""

    def __init__(self, tools: list[dict] | None = None):
        self.schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}) for t in tools or ()}
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._closer: str | None = None  # inside a block: the tag that ends it
        self._block_id = ""  # the id of the block's first call
        self.at = 0  # where `_buffer` starts in all the text fed
        self.said = False  # whether any content was given out
        self.blanks: list[tuple[str, int]] = []  # blanks held back: (text, where it lies in the text fed)
        # with a list: (start, end) in all the text fed of each piece of content given out
        # (serving/openai/speculation.py cuts how each character came by these)
        self.spans: list[tuple[int, int]] | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return _joined(self.read(text))

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        return _joined(self.read_end(cut))

    def read(self, text: str) -> list:
        self._buffer += text
        out: list = []
        while True:
            if self._closer is not None:
                end = self._buffer.find(self._closer)
                if end < 0:
                    break
                end += len(self._closer)
                block, self._closer = self._buffer[:end], None
                calls = self._calls(block, block.removesuffix("</tool_call>"))
                if calls is None:
                    self._give(end, out)
                else:
                    out += calls
                    self._drop(end)
                continue
            starts = [(i, opener) for opener in OPENERS if (i := self._buffer.find(opener)) >= 0]
            if starts:
                i, opener = min(starts)
                self._give(i, out)
                self._closer, self._block_id = OPENERS[opener], new_call_id()
                continue
            self._give(len(self._buffer) - _opener_prefix_length(self._buffer, OPENERS), out)
            break
        self.calls += [item for item in out if isinstance(item, ToolCall)]
        return out

    def read_end(self, cut: bool = False) -> list:
        """The end of the text (`cut`: by max_tokens): an unterminated block is a call if
        it parses (a model may stop right after `</function>`) or names one (its arguments
        so far), else content, or nothing when the text was cut. Blanks held are dropped."""
        out: list = []
        if self._closer is not None:
            self._closer = None
            calls = self._calls(self._buffer, self._buffer)
            if calls is not None:
                out += calls
                self._drop(len(self._buffer))
            elif cut:
                self._drop(len(self._buffer))
        self._give(len(self._buffer), out)
        self.blanks = []
        self.calls += [item for item in out if isinstance(item, ToolCall)]
        return out

    def writing(self) -> ToolCall | None:
        """The call being written, once its block names it: its arguments so far (only
        growing, a prefix of the whole call's), the id the call will have, `whole` false."""
        if self._closer is None:
            return None
        text = self._buffer[:len(self._buffer) - _opener_prefix_length(self._buffer, {self._closer: ""})]
        name, arguments = self.partial(text)
        return None if name is None else ToolCall(name, arguments, self._block_id, whole=False)

    def partial(self, block: str) -> tuple[str | None, str]:
        """A call block's first call so far: (its name once written, its arguments as JSON
        text so far). The text only grows as the block does, and for a complete block it
        is the whole arguments object."""
        inner = block.removeprefix("<tool_call>").lstrip()
        if inner.startswith("{"):
            return _partial_json(inner)
        match = _FUNCTION_OPEN.match(inner)
        if match is None:
            return None, ""
        name, body = match.group(1).strip(), inner[match.end():]
        end = body.find("</function>")
        arguments = self._function_arguments(name, body if end < 0 else body[:end])
        return name, arguments if end >= 0 else arguments[:-1]

    def _calls(self, block: str, written: str) -> list[ToolCall] | None:
        """The calls of a block (the first with the block's id): parsed, or the call it
        names with its arguments as far as `written` goes; None: it names none."""
        calls = self._parse_block(block)
        if calls:
            return [replace(calls[0], id=self._block_id), *calls[1:]]
        name, arguments = self.partial(written)
        return None if name is None else [ToolCall(name, arguments, self._block_id, whole=False)]

    def _drop(self, n: int) -> None:
        self._buffer, self.at = self._buffer[n:], self.at + n

    def _give(self, n: int, out: list) -> None:
        """Give out the first n characters of the buffer as content: blanks at the start
        of the text are dropped, blanks at the end held until more content follows."""
        text, at = self._buffer[:n], self.at
        self._drop(n)
        if not self.said:
            body = text.lstrip()
            text, at = body, at + len(text) - len(body)
        body = text.rstrip()
        if body:
            for blank, where in self.blanks:
                self._out(blank, where, out)
            self.blanks = []
            self._out(body, at, out)
            self.said = True
        if len(body) < len(text):
            self.blanks.append((text[len(body):], at + len(body)))

    def _out(self, text: str, at: int, out: list) -> None:
        out.append(text)
        if self.spans is not None:
            self.spans.append((at, at + len(text)))

    # ---------------------------------------------------------------- blocks

    def _parse_block(self, block: str) -> list[ToolCall] | None:
        inner = block
        if inner.startswith("<tool_call>"):
            inner = inner[len("<tool_call>"):]
            inner = inner.removesuffix("</tool_call>")
        inner = inner.strip()
        if inner.startswith("{"):
            return self._parse_json(inner)
        calls = []
        pos = 0
        for match in _FUNCTION.finditer(inner):
            if inner[pos:match.start()].strip():
                return None
            calls.append(self._parse_function(match.group(1).strip(), match.group(2)))
            pos = match.end()
        if not calls or inner[pos:].strip():
            return None
        return calls

    def _parse_json(self, inner: str) -> list[ToolCall] | None:
        try:
            value = json.loads(inner)
        except (ValueError, RecursionError):  # not JSON, or an integer past Python's digit limit
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return None
        if not isinstance(arguments, dict):
            return None
        name, written = _partial_json(inner)  # the object's text as written, when it is one
        if name != value["name"] or not written.startswith("{") or json.loads(written) != arguments:
            written = json.dumps(arguments, ensure_ascii=False)
        return [ToolCall(value["name"], written, new_call_id())]

    def _parse_function(self, name: str, body: str) -> ToolCall:
        return ToolCall(name, self._function_arguments(name, body), new_call_id())

    def _function_arguments(self, name: str, body: str) -> str:
        """The complete parameters of a function block as a JSON object's text, member by
        member in the order written (so the text of fewer parameters is its prefix)."""
        properties = self.schemas.get(name, {}).get("properties")
        properties = properties if isinstance(properties, dict) else {}
        members = []
        for match in _PARAMETER.finditer(body):
            key, value = match.group(1).strip(), match.group(2)
            value = value.removeprefix("\n")
            value = value.removesuffix("\n")
            members.append(f"{json.dumps(key, ensure_ascii=False)}: "
                           f"{json.dumps(_convert(value, properties.get(key)), ensure_ascii=False)}")
        return "{" + ", ".join(members) + "}"


def _convert(value: str, schema) -> object:
    """A parameter's text as its schema says: a string's stays text (is_raw_text); other
    values (and those of an unknown parameter) are read as JSON when they parse."""
    if is_raw_text(schema):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value


def _partial_json(inner: str) -> tuple[str | None, str]:
    """(name, arguments so far) of a `{"name": .., "arguments": {..}}` call being written:
    the arguments object's text up to where it ends (the outer object's end is not its)."""
    match = _JSON_NAME.match(inner)
    if match is None:
        return None, ""
    name, rest = json.loads(match.group(1)), inner[match.end():]
    if not rest.startswith("{"):  # arguments as a string: only whole
        return name, ""
    depth, quoted, escaped = 0, False, False
    for i, ch in enumerate(rest):
        if quoted:
            escaped, quoted = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return name, rest[:i + 1]
    return name, rest


def _opener_prefix_length(text: str, tags) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    for n in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in tags):
            return n
    return 0


def _joined(items: list) -> tuple[str, list[ToolCall]]:
    """read()'s items as (the content joined, the calls)."""
    return ("".join(item for item in items if isinstance(item, str)),
            [item for item in items if isinstance(item, ToolCall)])


def parse_tool_calls(text: str, tools: list[dict] | None = None,
                     cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """The whole text at once (`cut`: by max_tokens): (content without the call blocks,
    stripped, or None if nothing is left; the calls)."""
    parser = ToolCallParser(tools)
    head, calls = parser.feed(text)
    tail, more = parser.finish(cut)
    content = (head + tail).strip()
    return content or None, calls + more


def arguments_object(arguments: str) -> dict:
    """A call's arguments as an object: parsed, or for arguments cut short, the members
    written so far (complete values only, open objects and lists closed: what the SDKs'
    partial JSON readers make of the streamed pieces)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        value = _partial_object(arguments)
    return value if isinstance(value, dict) else {}


_JSON_TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*")|(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null)|([{}\[\],:]))')


def _partial_object(text: str):
    """The longest prefix of `text` that ends after a complete value or an opening
    bracket, its open brackets closed, parsed (None when there is none), as jiter's
    partial mode reads it (the SDKs' stream accumulators use it)."""
    stack, keyed, best, before, pos = [], False, None, None, 0
    while (match := _JSON_TOKEN.match(text, pos)) is not None:
        string, scalar, mark = match.groups()
        if mark in ("{", "["):
            stack.append("}" if mark == "{" else "]")
        elif mark in ("}", "]"):
            if not stack:
                break
            stack.pop()
        pos, was_key = match.end(), string is not None and stack and stack[-1] == "}" and not keyed
        keyed = mark == ":" or (keyed and mark is None and was_key)
        if mark in (None, "{", "[", "}", "]") and not was_key:
            before, best = best, text[:pos] + "".join(reversed(stack))
        elif was_key:
            keyed = False
    if best is not None and scalar is not None and scalar[-1].isdigit() and text[pos:].strip():
        best = before  # a number an unreadable character follows ("1."): it was going on
    try:
        return None if best is None else json.loads(best)
    except (ValueError, RecursionError):
        return None if best is None else json.loads(best)
    except (ValueError, RecursionError):
        return None
