"""Tool calls streamed in pieces, for every API's stream (openai/reply.py,
anthropic/reply.py, responses/reply.py): the generated text becomes, in order, content
strings and call pieces.

A call opens (`start`, its id and name, no arguments yet) as soon as its block names it
(serving/tools/calls.py, `ToolCallParser.writing`), its arguments follow as they are written
(`arguments` pieces), and it closes (`end`, with the whole call) when its block does.
Joined, a call's pieces are exactly its arguments (`ToolCall.arguments`), so a client
that adds them up gets the call the non-streamed reply has. A call whose tool does not
stream (`streams`: Anthropic's tools without `eager_input_streaming`) comes whole when
its block ends: start, all its arguments in one piece, end.
"""

from __future__ import annotations

from typing import NamedTuple

from .calls import ToolCall, ToolCallParser


class Piece(NamedTuple):
    kind: str  # "start", "arguments" or "end"
    call: ToolCall  # at start, the call so far (id and name); at end, the whole call
    text: str = ""  # an arguments piece


class CallStream:
    def __init__(self, parser: ToolCallParser, streams=lambda name: True):
        self.parser, self.streams = parser, streams
        self.open: ToolCall | None = None  # the call being streamed
        self.sent = ""  # its arguments sent so far

    def feed(self, text: str) -> list:
        """Content strings and Pieces, in order, for the next text."""
        return self._pieces(self.parser.read(text)) + self._progress()

    def finish(self, cut: bool = False) -> list:
        """The rest, at the end of the text (`cut`: by max_tokens, see ToolCallParser.read_end)."""
        return self._pieces(self.parser.read_end(cut))

    def _pieces(self, items: list) -> list:
        out = []
        for item in items:
            out += [item] if isinstance(item, str) else self._end(item)
        return out

    def _progress(self) -> list[Piece]:
        """The call being written: opened once named, and its arguments written since."""
        call = self.parser.writing()
        if call is None or not self.streams(call.name):
            return []
        out = []
        if self.open is None or self.open.id != call.id:
            self.open, self.sent = call, ""
            out.append(Piece("start", call))
        if call.arguments.startswith(self.sent) and len(call.arguments) > len(self.sent):
            out.append(Piece("arguments", call, call.arguments[len(self.sent):]))
            self.sent = call.arguments
        return out

    def _end(self, call: ToolCall) -> list[Piece]:
        """A call whose block ended: the rest of its arguments (all of them when it was
        not being streamed) and its end."""
        out = []
        if self.open is None or self.open.id != call.id:
            self.sent = ""
            out.append(Piece("start", call))
        self.open = None
        if call.arguments[len(self.sent):]:
            out.append(Piece("arguments", call, call.arguments[len(self.sent):]))
        return out + [Piece("end", call)]
