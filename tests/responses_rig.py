"""What the Responses tests share: the reply format fed scripted deltas with no model
(`scripted_reply`), a reply's worth of such deltas (reasoning, text, a call), and the
strict validation of a streamed event against the openai SDK's types and the Open
Responses schema; two function tools (weather, add) with strict parameter schemas."""

from __future__ import annotations

import json
import typing

from openresponses_spec import check_event

from monolith.runtime.events import Delta, Finished, Usage
from monolith.serving.responses.requests import parse_request
from monolith.serving.responses.reply import ResponseFormat
from monolith.serving.responses.store import ResponseStore
from monolith.serving.requests import SamplingDefaults

NAME = "demo"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD}]


def scripted_reply(body: dict, deltas: list[str], reason: str, token_ids: tuple, stream: bool,
                   think_end_id: int = 7, reasoning_open: bool = False):
    """The format fed scripted deltas (no model): (events or None, the response body)."""
    store = ResponseStore()
    call = parse_request({"input": "x", **body}, SamplingDefaults(), store)
    fmt = ResponseFormat(NAME, call, reasoning_open, store, think_end_id)
    finished = Finished(reason, Usage(5, len(token_ids), 2), token_ids)
    if not stream:
        for text in deltas:
            fmt.collect(Delta(text))
        return None, fmt.response(finished)
    events = fmt.stream_start(False)
    for text in deltas:
        events += fmt.stream_delta(Delta(text), False)
    events += fmt.stream_finish(finished, False)
    frames = [fmt.event(e) for e in events]
    return [json.loads(f.split("\ndata: ", 1)[1]) for f in frames], events[-1]["response"]


DELTAS = ["<think>", "ponder", "ing</think>\n\n", "Hello", " world", "\n\n<tool_",
          'call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "\n"]


def validate_event(event: dict, spec: bool = True) -> None:
    """Validate an event strictly with the SDK's pydantic class for its type, and against
    the Open Responses schema (`spec`: not for OpenAI's extensions the specification lacks,
    such as custom and namespace tools). The two disagree on one name: raw reasoning
    streams as the specification's `response.reasoning.delta` / `.done`, which the SDK (and
    OpenAI's own API) call `response.reasoning_text.*`; the server follows the
    specification, and the SDK passes the events it does not know through untouched."""
    from openai.types.responses import ResponseStreamEvent

    if spec:
        check_event(event)
    union = typing.get_args(typing.get_args(ResponseStreamEvent)[0])  # Annotated[Union[...], discriminator]
    by_type = {typing.get_args(c.model_fields["type"].annotation)[0]: c for c in union}
    if event["type"] not in ("response.reasoning.delta", "response.reasoning.done"):
        by_type[event["type"]].model_validate(with_cache_writes(event))


def with_cache_writes(value):
    """`value` with usage.input_tokens_details.cache_write_tokens, which the server leaves
    out (the engine does not report how many prompt tokens the prompt cache stored) and
    this SDK's type requires: the only field added before validating."""
    value = json.loads(json.dumps(value))
    for body in (value, value.get("response")):
        if isinstance(body, dict) and body.get("usage"):
            assert "cache_write_tokens" not in body["usage"]["input_tokens_details"]
            body["usage"]["input_tokens_details"]["cache_write_tokens"] = 0
    return value
