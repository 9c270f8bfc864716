"""The Responses reply format (serving/responses/reply.py) fed scripted deltas, no model:
the split of a reply into items and events validates against the official SDK's types and
the Open Responses schemas, a reply's items come back as the same chat turn, a failure
mid-stream is a response.failed event, and the SDK's stream helper rebuilds a reply with
reasoning. (The same API served live: tests/test_responses_api.py.)"""

from __future__ import annotations

import json

from openresponses_spec import check_response
from responses_rig import DELTAS, NAME, TOOLS, scripted_reply, validate_event, with_cache_writes

from monolith.runtime.events import Delta
from monolith.serving.errors import APIError
from monolith.serving.responses.requests import parse_request
from monolith.serving.responses.items import items_to_messages
from monolith.serving.responses.reply import ResponseFormat
from monolith.serving.responses.store import ResponseStore
from monolith.serving.requests import SamplingDefaults


def test_the_split_into_items_and_events_validates_against_the_sdk_types():
    """Reasoning, text and a call in one reply: the items in order, the whitespace before
    the call in neither, reasoning tokens counted to </think>; every event and the
    response validate against the SDK's own pydantic types (strictly, not constructed)."""
    from openai.types.responses import Response

    tokens = (1, 2, 3, 7, 4, 5, 6, 8, 9)  # 7 stands for </think>
    _, whole = scripted_reply({"tools": TOOLS}, DELTAS, "stop", tokens, stream=False)
    events, streamed = scripted_reply({"tools": TOOLS}, DELTAS, "stop", tokens, stream=True)
    for body in (whole, streamed):
        kinds = [(i["type"], i["status"]) for i in body["output"]]
        assert kinds == [("reasoning", "completed"), ("message", "completed"), ("function_call", "completed")]
        assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "pondering"}]
        assert body["output"][1]["content"][0]["text"] == "Hello world"
        assert (body["output"][2]["name"], json.loads(body["output"][2]["arguments"])) == ("add", {"a": 1, "b": 2})
        assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 4
        assert body["usage"]["input_tokens_details"]["cached_tokens"] == 2
    assert [i["type"] for i in whole["output"]] == [i["type"] for i in streamed["output"]]
    for event in events:
        validate_event(event)
    Response.model_validate(with_cache_writes(whole))
    check_response(whole)
    assert [e["type"] for e in events if e["type"].endswith(".delta")] == [
        "response.reasoning.delta"] * 2 + ["response.output_text.delta"] * 2 + [
        "response.function_call_arguments.delta"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning.delta") == "pondering"

    _, cut = scripted_reply({}, ["<think>", "still thinking"], "length", (1, 2, 3), stream=False)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(i["type"], i["status"]) for i in cut["output"]] == [("reasoning", "incomplete")]
    assert cut["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    events, cut = scripted_reply({}, ["Hi", " there"], "length", (1, 2), stream=True)
    assert events[-1]["type"] == "response.incomplete" and cut["output"][0]["status"] == "incomplete"
    Response.model_validate(with_cache_writes(cut))
    check_response(cut)


def test_output_items_come_back_as_the_same_chat_turn():
    """A reply's items, sent back as input, give the assistant message the chat API takes."""
    _, body = scripted_reply({"tools": TOOLS}, DELTAS, "stop", (1, 7), stream=False)
    call_id = body["output"][2]["call_id"]
    messages = items_to_messages(body["output"], "input")
    assert messages == [{"role": "assistant", "reasoning_content": "pondering", "content": "Hello world",
                         "tool_calls": [{"type": "function", "id": call_id,
                                         "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}]


def test_a_failure_mid_stream_is_a_response_failed_event():
    store = ResponseStore()
    fmt = ResponseFormat(NAME, parse_request({"input": "x"}, SamplingDefaults(), store), False, store, None)
    for event in fmt.stream_start(False) + fmt.stream_delta(Delta("Hel"), False):
        fmt.event(event)
    frames = fmt.failure(APIError(503, "the server is shutting down", code="shutting_down"))
    error, event = (json.loads(f.split("\ndata: ", 1)[1]) for f in frames.split("\n\n")[:2])
    assert frames.startswith("event: error\n") and (error["sequence_number"], event["sequence_number"]) == (5, 6)
    assert error["error"] == {"type": "server_error", "code": "shutting_down",
                              "message": "the server is shutting down", "param": None}
    assert (error["code"], error["message"]) == ("shutting_down", "the server is shutting down")
    assert event["response"]["status"] == "failed" and event["response"]["error"] == {
        "code": "server_error", "message": "the server is shutting down"}
    assert event["response"]["output"][0]["content"][0]["text"] == "Hel"
    validate_event(error)
    validate_event(event)
    assert fmt.end() == "data: [DONE]\n\n"


def test_the_sdks_stream_helper_rebuilds_a_reply_with_reasoning():
    """The SDK does not know the specification's `response.reasoning.*` events: it hands
    them on (typed as its first event class, their `type` kept) and its accumulator, the
    one `client.responses.stream()` runs, still rebuilds the whole reply from the rest."""
    from openai import NOT_GIVEN
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    events, body = scripted_reply({"tools": TOOLS}, DELTAS, "stop", (1, 2, 3, 7, 4), stream=True)
    state = ResponseStreamState(input_tools=NOT_GIVEN, text_format=NOT_GIVEN)
    handed = [out for e in events for out in state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))]
    assert [e.type for e in handed if e.type.startswith("response.reasoning")] == [
        "response.reasoning.delta", "response.reasoning.delta", "response.reasoning.done"]
    final = handed[-1].response.model_dump(exclude_none=True)
    assert [i["type"] for i in final["output"]] == [i["type"] for i in body["output"]]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "pondering"}]
