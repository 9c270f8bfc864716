"""Qwen tool calls in generated text -> OpenAI `tool_calls`.

Qwen models write a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Qwen3) or `<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>`
(Qwen3-Coder, Qwen3.5/3.6), the function block sometimes without the wrapper.
`ToolCallParser` reads the text as it streams: content is released as soon as it
cannot be the start of a call block, and a call only once its block is complete (a
call is never streamed in pieces). A block that does not parse stays content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from .raw_text import is_raw_text

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

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallParser:
    """feed(text) -> (content, calls) as the text grows; finish() -> the rest. With
    `spans` a list, where each piece of content lies in the text fed is recorded there."""

    def __init__(self, tools: list[dict] | None = None):
        self.schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}) for t in tools or ()}
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._closer: str | None = None  # inside a block: the tag that ends it
        self.last_block = ""  # the call block that ended last
        self.at = 0  # where `_buffer` starts in all the text fed
        # with a list: (start, end) in all the text fed of each piece of content given out
        # (serving/spec_stream.py cuts how each character came by these)
        self.spans: list[tuple[int, int]] | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, calls = [], []
        while True:
            if self._closer is not None:
                end = self._buffer.find(self._closer)
                if end < 0:
                    break
                end += len(self._closer)
                block, self._closer = self._buffer[:end], None
                self.last_block = block
                parsed = self._parse_block(block)
                if parsed is None:
                    self._give(end, content)
                else:
                    calls += parsed
                    self._drop(end)
                continue
            starts = [(i, opener) for opener in OPENERS if (i := self._buffer.find(opener)) >= 0]
            if starts:
                i, opener = min(starts)
                self._give(i, content)
                self._closer = OPENERS[opener]
                continue
            self._give(len(self._buffer) - _opener_prefix_length(self._buffer), content)
            break
        self.calls += calls
        return "".join(content), calls

    @property
    def pending(self) -> str | None:
        """The text of the call block being written (None outside one)."""
        return self._buffer if self._closer is not None else None

    def partial(self, block: str) -> tuple[str | None, str]:
        """A call block's first call so far: (its name once written, its arguments as JSON
        text so far). The text only grows as the block does, and for a complete block it
        is the whole arguments object (what an eagerly streamed call sends in pieces)."""
        inner = block.removeprefix("<tool_call>").lstrip()
        if inner.startswith("{"):
            return _partial_json(inner)
        match = _FUNCTION_OPEN.match(inner)
        if match is None:
            return None, ""
        name, body = match.group(1).strip(), inner[match.end():]
        end = body.find("</function>")
        done = [m.group(0) for m in _PARAMETER.finditer(body if end < 0 else body[:end])]
        arguments = self._parse_function(name, "".join(done)).arguments
        return name, arguments if end >= 0 else arguments[:-1]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the text: an unterminated block is a call if it parses (a model may
        stop right after `</function>`), else content."""
        rest, calls = self._buffer, []
        if self._closer is not None:
            self._closer = None
            self.last_block = rest
            parsed = self._parse_block(rest)
            if parsed is not None:
                calls, rest = parsed, ""
        if rest:
            self._give(len(rest), [])
        self._drop(len(self._buffer))
        self.calls += calls
        return rest, calls

    def _drop(self, n: int) -> None:
        self._buffer, self.at = self._buffer[n:], self.at + n

    def _give(self, n: int, content: list[str]) -> None:
        """Give out the first n characters of the buffer as content."""
        content.append(self._buffer[:n])
        if n and self.spans is not None:
            self.spans.append((self.at, self.at + n))
        self._drop(n)

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
        return [ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())]

    def _parse_function(self, name: str, body: str) -> ToolCall:
        properties = self.schemas.get(name, {}).get("properties")
        properties = properties if isinstance(properties, dict) else {}
        arguments = {}
        for match in _PARAMETER.finditer(body):
            key, value = match.group(1).strip(), match.group(2)
            value = value.removeprefix("\n")
            value = value.removesuffix("\n")
            arguments[key] = _convert(value, properties.get(key))
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False), new_call_id())


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


def _opener_prefix_length(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a block opener."""
    for n in range(min(len(text), max(map(len, OPENERS)) - 1), 0, -1):
        if any(opener.startswith(text[-n:]) for opener in OPENERS):
            return n
    return 0


def parse_tool_calls(text: str, tools: list[dict] | None = None) -> tuple[str | None, list[ToolCall]]:
    """The whole text at once: (content without the call blocks, stripped, or None if
    nothing is left; the calls)."""
    parser = ToolCallParser(tools)
    head, calls = parser.feed(text)
    tail, more = parser.finish()
    content = (head + tail).strip()
    return content or None, calls + more
