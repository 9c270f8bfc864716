"""Anthropic `message` bodies and their stream of events (a StreamFormat, the Protocol
app.py drives: reply_format.py).

Content blocks come in the order the model wrote them: `thinking` from the reasoning
split (with `thinking.display: "omitted"` the block stays empty), `text`, `tool_use`
with the parsed input. A tool whose `eager_input_streaming` is set has its block opened
as soon as the call names it and its input streamed as `input_json_delta` pieces while
the call is written; other calls are sent whole when they end (tools/tools/call_stream.py). A call
cut by max_tokens is still a tool_use block, its input the members written so far, and
the message stops with `max_tokens`; its markup is never text. Usage: `input_tokens`
(prompt tokens that were prefilled), `cache_read_input_tokens` (the prompt cache's hits:
known once the engine has resumed the sequence, so `message_start` already has the
exact figures `message_delta` repeats) and `cache_creation_input_tokens` (0: nothing is
billed for writing the cache). With `context_management`, the applied edits are in the
message and in `message_delta`. The non-streamed body is built from the same events as
the stream, so both give the same message.
"""

from __future__ import annotations

import json
import uuid

from ...runtime.events import Delta, Finished
from ..errors import APIError
from ..reasoning import ReasoningSplitter
from ..tools.call_stream import CallStream
from ..tools.calls import ToolCallParser, arguments_object

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(e: APIError) -> dict:
    kind = ERROR_TYPES.get(e.status) or ("api_error" if e.status >= 500 else "invalid_request_error")
    if e.code == "model_load_failed":
        kind = "api_error"
    return {"type": "error", "error": {"type": kind, "message": e.message},
            "request_id": "req_" + uuid.uuid4().hex[:24]}


def sse(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class MessagesFormat:
    def __init__(self, model: str, req, reasoning_open: bool, prompt_tokens: int, tokenizer,
                 applied_edits: list[dict] | None = None):
        self.id = "msg_" + uuid.uuid4().hex
        self.model = model
        self.stops = req.chat.stop
        self.max_tokens = req.chat.max_tokens
        self.prompt_tokens = prompt_tokens
        self.cached = 0  # prompt tokens the prompt cache held (resumed())
        self.tokenizer = tokenizer  # to tell which stop sequence ended the text
        self.splitter = ReasoningSplitter(reasoning_open)
        eager = req.eager
        self.calls = CallStream(ToolCallParser(req.tools), lambda name: name in eager) if req.tools else None
        self.show_thinking = req.thinking.show
        self.applied_edits = applied_edits  # None: the request had no context_management
        self.raw: list[str] = []  # the text as the engine released it
        self.content: list[dict] = []  # the blocks so far (what the events add up to)
        self.open: str | None = None  # the type of the block being written
        self.blank = ""  # whitespace held back in a text block when tools are on (see _text)

    # ---------------------------------------------------------------- the format interface

    def resumed(self, cached: int) -> None:
        """The engine resumed the sequence with `cached` prompt tokens from the cache."""
        self.cached = cached

    def collect(self, delta: Delta) -> None:
        self.stream_delta(delta, False)

    def response(self, finished: Finished) -> dict:
        self.stream_finish(finished, False)
        reason, sequence = self._stop(finished)
        body = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": self._usage(finished)}
        return body | self._edits()

    def stream_start(self, include_usage: bool) -> list[dict]:
        usage = {"input_tokens": self.prompt_tokens - self.cached, "output_tokens": 0,
                 "cache_read_input_tokens": self.cached, "cache_creation_input_tokens": 0}
        return [{"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}}]

    def stream_delta(self, delta: Delta, include_usage: bool) -> list[dict]:
        self.raw.append(delta.text)
        return self._pieces(self.splitter.feed(delta.text))

    def stream_finish(self, finished: Finished, include_usage: bool) -> list[dict]:
        events = self._pieces(self.splitter.finish())
        if self.calls is not None:
            events += self._content(self.calls.finish(cut=finished.finish_reason == "length"))
        events += self._close()
        reason, sequence = self._stop(finished)
        return events + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": self._usage(finished)} | self._edits(),
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
            events += self._delta("thinking", reasoning if self.show_thinking else "")
        if text:
            events += self._content(self.calls.feed(text)) if self.calls is not None else self._text(text)
        return events

    def _content(self, items: list) -> list[dict]:
        """Text and call pieces in order (tools/tools/call_stream.py): a call is a tool_use block, its
        input streamed as input_json_delta pieces; its `input` the arguments as an object
        (for a call cut short, the members written: tools.arguments_object)."""
        events = []
        for item in items:
            if isinstance(item, str):
                events += self._text(item)
            elif item.kind == "start":
                events += self._close()
                block = {"type": "tool_use", "id": "toolu_" + item.call.id.removeprefix("call_"),
                         "name": item.call.name, "input": {}}
                self.content.append(block)
                events.append({"type": "content_block_start", "index": len(self.content) - 1,
                               "content_block": dict(block)})
                self.open = "tool_use"
            elif item.kind == "arguments":
                events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                               "delta": {"type": "input_json_delta", "partial_json": item.text}})
            else:
                self.content[-1]["input"] = arguments_object(item.call.arguments)
                events += self._close()
        return events

    def _text(self, text: str) -> list[dict]:
        """Text as it comes; with tools on, the whitespace around tool calls is dropped
        (as parse_tool_calls strips the content): a text block opens at its first
        non-blank character and blanks are held until more text follows them."""
        if self.calls is None:
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
        if not text:
            return events
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

    def _edits(self) -> dict:
        return {} if self.applied_edits is None else {"context_management": {"applied_edits": self.applied_edits}}
