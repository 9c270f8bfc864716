"""The Responses API's reply: the generated text split into output items in order, a
`reasoning` item (the think block, as `reasoning_text` content), `message` items with
`output_text`, and `function_call` / `custom_tool_call` items (tools.py maps
the model's calls back to the tools as sent). With `include:
["reasoning.encrypted_content"]`, a finished reasoning item carries its text sealed
(seal.py). Streamed, the same split emits the semantic
events (`event: TYPE` + `data: {... "type", "sequence_number"}`); the non-streamed reply
runs the same split over the same deltas, so both give the same output. Whitespace
between text and a call belongs to neither. A finished response is stored (unless
`store: false`) with its conversation, for `previous_response_id`; while it is being
generated the store knows it too, for cancel."""

from __future__ import annotations

import json
import time
import uuid

from ...runtime.events import Delta, Finished
from ..errors import APIError
from ..reasoning import ReasoningSplitter
from ..structured import THINK_END
from ..tools.call_stream import CallStream
from ..tools.calls import ToolCallParser
from .items import output_messages
from .requests import ResponsesCall
from .seal import SEALER
from .store import ResponseStore
from .tools import call_item


class ResponseFormat:
    """The response object and its stream events (a StreamFormat and Cancellable: reply_format.py)."""

    def __init__(self, model: str, call: ResponsesCall, reasoning_open: bool, store: ResponseStore,
                 think_end_id: int | None):
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.call = call
        self.store = store
        self.think_end_id = think_end_id
        self.splitter = ReasoningSplitter(reasoning_open)
        self.calls = CallStream(ToolCallParser(call.request.tools)) if call.request.tools else None
        self.items: list[dict] = []  # the output items; the last one may be open
        self.open: dict | None = None
        self.pending = ""  # trailing whitespace of the text, held until more text or a call
        self.texts: list[str] = []
        self.sequence = 0
        self.reasoned = reasoning_open
        self.status = "in_progress"  # the response's, once it is known

    # ---------------------------------------------------------------- the split

    def _feed(self, text: str) -> list[dict]:
        reasoning, content = self.splitter.feed(text)
        return self._route(reasoning, content)

    def _route(self, reasoning: str, content: str, final: bool = False) -> list[dict]:
        """The reasoning, then the content's text and call pieces in order (tools/call_stream.py;
        `final`: the end of the text)."""
        events = self._reasoning(reasoning) if reasoning else []
        if self.calls is None:
            items = [content]
        else:
            items = self.calls.feed(content)
            if final:
                items += self.calls.finish(cut=self.status == "incomplete")
        for item in items:
            events += self._text(item) if isinstance(item, str) else self._call(item)
        return events

    def _finish(self, status: str) -> list[dict]:
        self.status = status
        events = self._route(*self.splitter.finish(), final=True)
        if self.open is not None and self.open["type"] == "message" and self.pending:
            events += self._delta(self.pending)
        self.pending = ""
        return events + self._close("incomplete" if status == "incomplete" else "completed", "final_answer")

    def _reasoning(self, text: str) -> list[dict]:
        self.reasoned = True
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self._close("completed")
            events += self._add({"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [],
                                 "content": [], "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
        self.open["content"][0]["text"] += text
        return events + [self._at({"type": "response.reasoning.delta", "content_index": 0, "delta": text})]

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

    def _call(self, piece) -> list[dict]:
        """A call's piece (tools/tools/call_stream.py): its item added at the start, its arguments as
        `response.function_call_arguments.delta` events, and at the end their `.done` and
        the item, `incomplete` when the call was cut (a custom tool's input comes whole
        at the end)."""
        if piece.kind == "start":
            self.pending = ""
            events = self._close("completed")
            head = call_item(piece.call, self.call.tools)
            key = "input" if head["type"] == "custom_tool_call" else "arguments"
            item = {"id": ("ctc_" if key == "input" else "fc_") + uuid.uuid4().hex, **head, key: "",
                    "status": "in_progress"}
            return events + self._add(item, None)
        if piece.kind == "arguments":
            if self.open["type"] == "custom_tool_call":
                return []
            self.open["arguments"] += piece.text
            return [self._at({"type": "response.function_call_arguments.delta", "delta": piece.text})]
        done = call_item(piece.call, self.call.tools)
        if done["type"] == "custom_tool_call":
            self.open["input"] = done["input"]
            events = [self._at({"type": "response.custom_tool_call_input.delta", "delta": done["input"]}),
                      self._at({"type": "response.custom_tool_call_input.done", "input": done["input"]})]
        else:
            events = [self._at({"type": "response.function_call_arguments.done", "arguments": done["arguments"],
                                "name": done["name"]})]
        return events + self._close("completed" if piece.call.whole else "incomplete")

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

    def _close(self, status: str, phase: str = "commentary") -> list[dict]:
        """Close the open item; a message gets its `phase`: the reply's last one is the
        final answer, one that more reasoning or a call follows is commentary."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1
        item["status"] = status
        if item["type"] == "message":
            item["phase"] = phase
        events = []
        if item["type"] == "reasoning" and self.call.encrypted:
            item["encrypted_content"] = SEALER.seal(item["content"][0]["text"])
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            kind = "output_text" if part["type"] == "output_text" else "reasoning"
            done = {"type": f"response.{kind}.done", "item_id": item["id"], "output_index": index,
                    "content_index": 0, "text": part["text"]}
            if kind == "output_text":
                done["logprobs"] = []
            events += [done, {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                              "content_index": 0, "part": _copy(part)}]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": _copy(item)}]

    # ---------------------------------------------------------------- the object

    def _body(self, status: str, finished: Finished | None = None, error: dict | None = None) -> dict:
        body = {"id": self.id, "object": "response", "created_at": self.created, "completed_at": None,
                "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": _copy(self.items), **self.call.echo, "store": self.call.store,
                "usage": None}
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
            self.store.put(body, self.conversation(), self.call.input)
        self.store.end(self.id, body)
        return body

    def conversation(self) -> list[dict]:
        """The conversation so far as chat messages: the request's and the output."""
        return self.call.history + output_messages(self.items)

    # ---------------------------------------------------------------- the format interface

    def submitted(self, job) -> None:
        """The engine took the request: the response can be cancelled by id from now."""
        self.store.begin(self.id, job, self._body)

    def ended(self) -> None:
        """The request's handler is done (after `_done`, or without it)."""
        self.store.end(self.id)

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

    def number(self, chunk: dict) -> dict:
        """The event with its sequence_number (the stream's next)."""
        chunk = {**chunk, "sequence_number": self.sequence}
        self.sequence += 1
        return chunk

    def event(self, chunk: dict) -> str:
        chunk = self.number(chunk)
        return f"event: {chunk['type']}\ndata: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def keepalive(self) -> str:
        return ": keep-alive\n\n"

    def failed(self, error: APIError) -> list[dict]:
        """The events of a generation that failed with `error`: an `error` event, then
        `response.failed` (the specification's order). The error event carries its fields
        both nested (the specification's `error`) and at the top (OpenAI's SDK reads them
        there); the response's error code is one of the few the SDK knows."""
        kind = "too_many_requests" if error.status == 429 else "server_error" if error.status >= 500 \
            else "invalid_request"
        code = "rate_limit_exceeded" if error.status == 429 else "server_error" if error.status >= 500 \
            else "invalid_prompt"
        fields = {"code": error.code or code, "message": error.message, "param": error.param}
        return [{"type": "error", **fields, "error": {"type": kind, **fields}},
                {"type": "response.failed",
                 "response": self._body("failed", error={"code": code, "message": error.message})}]

    def failure(self, error: APIError) -> str:
        return "".join(self.event(event) for event in self.failed(error))

    def end(self) -> str:
        return "data: [DONE]\n\n"


def format_maker(model: str, call: ResponsesCall, store: ResponseStore, tokenizer):
    """make_format(reasoning_open) for the app's generate_chat."""
    think_end_id = tokenizer.token_to_id(THINK_END)
    return lambda reasoning_open: ResponseFormat(model, call, reasoning_open, store, think_end_id)


def _copy(value):
    return json.loads(json.dumps(value))
