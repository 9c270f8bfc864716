"""What a reply format is: the object app.py drives to turn one request's engine events
into the API's own reply. Each API brings its own (ChatFormat and CompletionFormat in
openai/reply.py, MessagesFormat in anthropic/reply.py, ResponseFormat in responses/reply.py,
CompactFormat in responses/compact.py); app.py knows them only through these Protocols.

A handler builds the format once the prompt is encoded, submits the request and waits
until the engine has started it (`start`), then either collects the reply (`_respond`:
`collect` for every text delta, `response` at the end) or streams it (`progress` and
`_stream`: `stream_start`, `stream_delta` for every delta, `stream_finish` at the end,
each chunk framed by `event`, quiet spells by `keepalive`, a failure by `failure`, and
`end` last). The optional hooks are called when a format has them (an isinstance check
against their Protocol)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..runtime.events import Delta, Finished
from .errors import APIError


@runtime_checkable
class ReplyFormat(Protocol):
    """A reply collected whole (the non-streamed request)."""

    def collect(self, delta: Delta) -> None:
        """Take one text delta (deltas that queued up arrive joined as one)."""

    def response(self, finished: Finished) -> dict:
        """The JSON body of the whole reply, once generation has finished."""


@runtime_checkable
class StreamFormat(ReplyFormat, Protocol):
    """A reply that can also be streamed as Server-Sent Events (a request with `stream`).
    The `stream_*` methods return chunks (dicts, not yet framed); app.py frames each with
    `event` (the WebSocket transport of the Responses API sends them unframed)."""

    def stream_start(self, include_usage: bool) -> list[dict]:
        """The chunks that open the stream, sent once the request has started."""

    def stream_delta(self, delta: Delta, include_usage: bool) -> list[dict]:
        """The chunks of one text delta."""

    def stream_finish(self, finished: Finished, include_usage: bool) -> list[dict]:
        """The chunks that close the reply, once generation has finished."""

    def event(self, chunk: dict) -> str:
        """One chunk as the stream's text."""

    def keepalive(self) -> str:
        """What is sent when nothing else was for `keepalive_seconds` (a comment)."""

    def failure(self, error: APIError) -> str:
        """The stream's text for a generation that failed after the stream began."""

    def end(self) -> str:
        """The stream's last text (after `stream_finish` or `failure`)."""


@runtime_checkable
class Resumable(Protocol):
    """A format that reports the prompt cache's hits before the first token."""

    def resumed(self, cached: int) -> None:
        """The request resumed from the cache with `cached` prompt tokens (called once,
        before any delta)."""


@runtime_checkable
class Cancellable(Protocol):
    """A format whose reply can be cancelled by id from another connection
    (responses/routes.py), and that must know when its handler is done with it."""

    def submitted(self, job) -> None:
        """The engine took the request as `job` (before it starts)."""

    def ended(self) -> None:
        """The handler is done with the request, finished or not (called once, last)."""
