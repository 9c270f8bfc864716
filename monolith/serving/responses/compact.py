"""POST /v1/responses/compact: a conversation made short by the model itself. The
conversation (a stored `previous_response_id`, then `input`, as for POST /v1/responses)
goes to the model with a request to summarize it; the reply is a compaction object whose
`output` is the window to continue from: the user's own messages, verbatim, then one
`compaction` item holding the summary, sealed (seal.py) so that only this
server reads it back. Sent back in `input`, that item becomes a user message with the
summary (items.py), and a later compaction keeps it out of the user messages it
repeats (its summary is summarized again)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Annotated, Any

from ...runtime.events import Delta, Finished
from ...sampling import SamplingParams
from ..fields import Body, Text, inert, parse
from ..reasoning import ReasoningSplitter
from ..requests import SamplingDefaults
from .requests import parse_request
from .seal import seal_summary
from .store import ResponseStore


class CompactBody(Body):
    """A compaction request: its conversation, and hints that change no summary
    (`image`: the image context policy; the kept user messages keep their images)."""

    model: Text  # required by the Open Responses specification
    input: Any = None  # as a response's (requests.py)
    previous_response_id: Any = None
    instructions: Any = None
    prompt_cache_key: Annotated[Any, inert("the prompt cache is automatic")] = None
    prompt_cache_retention: Annotated[Any, inert("the prompt cache is automatic")] = None
    prompt_cache_options: Annotated[Any, inert("the prompt cache is automatic")] = None
    safety_identifier: Annotated[Any, inert("an end-user id")] = None
    service_tier: Annotated[Any, inert("one tier here")] = None
    image: Annotated[Any, inert("the kept user messages keep their images")] = None


FIELDS = ("model", "input", "previous_response_id", "instructions")  # what the response's parser reads
SUMMARY_TOKENS = 1024  # the most tokens a summary may take
ASK = ("Summarize our conversation so far for your own later use, so that it can continue from the summary "
       "alone: the user's goals and constraints, what was decided and done, facts and tool results that still "
       "matter, and what remains to do. Write only the summary.")


def parse_compact(body: dict, defaults: SamplingDefaults, store: ResponseStore):
    """(the summary's ChatRequest, the user messages the window keeps)."""
    parse(CompactBody, body)
    call = parse_request({k: v for k, v in body.items() if k in FIELDS}, defaults, store)
    kept = [m["content"] for m in call.history if m["role"] == "user" and not m.get("compaction")]
    ask = call.request.messages + [{"role": "user", "content": ASK}]
    request = dataclasses.replace(call.request, messages=ask, max_tokens=SUMMARY_TOKENS, tools=None,
                                  params=SamplingParams(0.0), template_kwargs={"enable_thinking": False})
    return request, kept


class CompactFormat:
    """The compaction object, from the summary's deltas (a ReplyFormat, never streamed: reply_format.py)."""

    def __init__(self, kept: list, reasoning_open: bool):
        self.kept = kept
        self.splitter = ReasoningSplitter(reasoning_open)
        self.content: list[str] = []

    def collect(self, delta: Delta) -> None:
        self.content.append(self.splitter.feed(delta.text)[1])

    def response(self, finished: Finished) -> dict:
        self.content.append(self.splitter.finish()[1])
        summary = "".join(self.content).strip()
        output = [{"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "user", "status": "completed",
                   "content": input_parts(content)} for content in self.kept]
        output.append({"id": "cmp_" + uuid.uuid4().hex, "type": "compaction",
                       "encrypted_content": seal_summary(summary), "created_by": "monolith"})
        u = finished.usage
        usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                 "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": u.total_tokens}
        return {"id": "resp_" + uuid.uuid4().hex, "object": "response.compaction", "created_at": int(time.time()),
                "output": output, "usage": usage}


def input_parts(content) -> list[dict]:
    """A user message's content (a string, or text and image items: images.py) as input parts."""
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    return [{"type": "input_text", "text": part["text"]} if part["type"] == "text"
            else {"type": "input_image", "image_url": part["image"], "detail": "auto"} for part in content]
