"""The Responses API against the Open Responses specification's own published schemas
(tests/openresponses_spec.py): every response object and every streaming event the
server sends for text, function calls, JSON output and a cut reply (reasoning and a
failure mid-stream, scripted: tests/test_responses_reply.py), and the SSE framing (`event:` equals the body's type; the stream ends with `[DONE]`); the
assistant `phase`; and POST /v1/responses/input_tokens against the count the chat
endpoint reports for the same conversation."""

from __future__ import annotations

import json

import httpx
import pytest
from openresponses_spec import check_events, check_response
from serving_rig import assert_error, demo_servers

NAME = "demo"
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -9, "maximum": 9},
                                        "b": {"type": "integer", "minimum": -9, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD}]
REQUESTS = {
    "text": {"input": "Name three colors.", "max_output_tokens": 40},
    "cut": {"input": "Write a long story.", "max_output_tokens": 5},
    "thinking": {"input": "What is 2+3?", "max_output_tokens": 60, "reasoning": {"effort": "high"}},
    "call": {"input": "Add 2 and 3.", "tools": TOOLS, "tool_choice": "required", "max_output_tokens": 80},
    "json": {"input": "A person.", "max_output_tokens": 60,
             "text": {"format": {"type": "json_schema", "name": "p", "schema": ADD, "strict": True}}},
    "metadata": {"input": "Hi.", "max_output_tokens": 8, "metadata": {"run": "x"}, "instructions": "Be terse.",
                 "store": False},
}


@pytest.fixture(scope="module")
def server(demo_f32):
    with demo_servers(demo_f32, NAME, 1024) as running:
        yield running["plain"]


def post(server, body: dict, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(server.url + path, json={"model": NAME, "temperature": 0, **body}, timeout=300)


def sse(server, body: dict) -> list[dict]:
    """The streamed events, each checked for its framing; the stream must end with [DONE]."""
    events, lines = [], []
    with httpx.stream("POST", server.url + "/v1/responses", json={"model": NAME, "temperature": 0, "stream": True,
                                                                   **body}, timeout=300) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line and not line.startswith(":")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    for name, data in zip(lines[:-1:2], lines[1:-1:2], strict=True):
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}", (name, event["type"])
        events.append(event)
    return events


@pytest.mark.parametrize("case", sorted(REQUESTS))
def test_every_response_and_event_validates(server, case):
    body = REQUESTS[case]
    whole = post(server, body)
    assert whole.status_code == 200, whole.text
    check_response(whole.json())
    events = sse(server, body)
    check_events(events)
    for event in events:
        if "response" in event:
            assert event["response"]["id"] == events[0]["response"]["id"]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == [i["type"] for i in whole.json()["output"]]
    assert events[0]["response"]["completed_at"] is None and final["status"] == whole.json()["status"]
    assert (final["completed_at"] is not None) == (final["status"] in ("completed", "incomplete"))
    if body.get("store", True):
        stored = httpx.get(f"{server.url}/v1/responses/{whole.json()['id']}")
        check_response(stored.json())


def test_phase_labels_commentary_and_the_final_answer(server):
    """Assistant text followed by a call in the same response is commentary; the reply's
    last message is the final answer. An assistant message sent back with its phase is
    taken as input."""
    first = post(server, REQUESTS["call"]).json()
    messages = [i for i in first["output"] if i["type"] == "message"]
    for item in messages:
        assert item["phase"] == "commentary"
    text = post(server, REQUESTS["text"]).json()
    assert [i["phase"] for i in text["output"] if i["type"] == "message"] == ["final_answer"]
    back = [{"type": "message", "role": "user", "content": "Hi."},
            {"type": "message", "role": "assistant", "phase": "final_answer",
             "content": [{"type": "output_text", "text": "Hello."}]},
            {"type": "message", "role": "user", "content": "Again."}]
    again = post(server, {"input": back, "max_output_tokens": 8})
    assert again.status_code == 200, again.text
    check_response(again.json())
    wrong = post(server, {"input": [{**back[1], "phase": "draft"}], "max_output_tokens": 8})
    assert_error(wrong, 400, param="input[0].phase")


def test_input_tokens_counts_the_prompt_a_request_takes(server):
    """The count equals the chat endpoint's prompt_tokens for the same conversation, and
    the usage of the Responses request itself (tools rendered as this API renders them)."""
    body = {"input": "Name three colors.", "instructions": "Be terse."}
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name three colors."}]
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                      json={"model": NAME, "messages": messages, "max_tokens": 1}).json()
    counted = server.client().responses.input_tokens.count(model=NAME, **body)
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", chat["usage"]["prompt_tokens"])
    body = {"input": "Add 2 and 3.", "tools": TOOLS}
    counted = server.client().responses.input_tokens.count(model=NAME, **body)
    assert counted.input_tokens == post(server, {**body, "max_output_tokens": 16}).json()["usage"]["input_tokens"]
    assert_error(post(server, {"input": []}, "/v1/responses/input_tokens"), 400, param="input")
