"""The Responses API over a WebSocket at /v1/responses (Open Responses' WebSocket
transport), through a real uvicorn server on loopback with real clients (the official
`openai` SDK's `responses.connect()` and the `websockets` library): a turn streams the
events the SSE stream of the same request sends; turns run one after another on a socket,
a second response.create waiting for the first; previous_response_id continues a store:
false response on the same socket as sending the whole conversation does, a fresh socket
answers previous_response_not_found, and a failed continuation evicts it; bad messages
get error events naming the culprit and the socket stays usable; the connection limit
(on a clock the test moves) and the API key on the handshake; a client that leaves
cancels its response; a generation that fails mid-stream ends with response.failed."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from openresponses_spec import check, check_event
from serving_rig import Scripted, Server
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from monolith.runtime.engine import Engine, Limits
from monolith.serving.responses.websocket import LIMIT_SECONDS

MAX_CONTEXT = 1024
NAME = "demo"
KEY = "sesame"
COMMON = {"model": NAME, "instructions": "You are terse.", "max_output_tokens": 24, "temperature": 0}
ENDS = ("response.completed", "response.incomplete", "response.failed", "error")


class Clock:
    """The server's WebSocket clock: moved by the test, not by waiting."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def clock():
    return Clock()


@pytest.fixture(scope="module")
def server(demo_f32, clock):
    model, _, tok = demo_f32
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)), model_names=(NAME,), api_key=KEY,
                websocket_clock=clock) as s:
        yield s.wait_ready()


def socket(server, headers=None):
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    return connect(url, additional_headers={"Authorization": f"Bearer {KEY}"} if headers is None else headers,
                   open_timeout=30)


def send(ws, **body) -> None:
    ws.send(json.dumps({"type": "response.create", **body}))


def receive(ws) -> list[dict]:
    """The events of one turn, up to its terminal event (or its error)."""
    events = []
    while not events or events[-1]["type"] not in ENDS:
        events.append(json.loads(ws.recv(timeout=120)))
        # the specification's schemas: the transport's error envelope, or a streaming event
        check("WebSocketErrorEvent", events[-1]) if events[-1]["type"] == "error" else check_event(events[-1])
    return events


def turn(ws, **body) -> list[dict]:
    send(ws, **body)
    return receive(ws)


def text(events: list[dict]) -> str:
    response = events[-1]["response"]
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def error(events: list[dict]) -> dict:
    assert len(events) == 1 and events[0]["type"] == "error", events
    event = events[0]
    assert set(event) == {"type", "status", "error"} and event["error"]["message"], event
    return event


def test_a_turn_streams_what_sse_streams(server):
    """The official SDK's WebSocket client against its SSE stream of the same request."""
    client = server.client(api_key=KEY)
    sse = list(client.responses.create(input="Name three colors.", stream=True, **COMMON))
    with client.responses.connect() as connection:
        connection.response.create(input="Name three colors.", **COMMON)
        events = []
        for event in connection:
            events.append(event)
            if event.type in ENDS:
                break
    assert [e.type for e in events] == [e.type for e in sse]
    assert [e.sequence_number for e in events] == list(range(len(sse)))
    final, streamed = events[-1].response, sse[-1].response
    assert final.status == streamed.status and final.output_text == streamed.output_text
    assert [item.type for item in final.output] == [item.type for item in streamed.output]
    assert final.usage.output_tokens == streamed.usage.output_tokens


def test_sequential_turns_continue_a_store_false_response(server):
    """previous_response_id on the same socket, store false, equals the whole conversation
    sent over HTTP; the next response.create waits for the one in flight."""
    common = {**COMMON, "max_output_tokens": 64}  # room for the demo model's replies to end
    with socket(server) as ws:
        first = turn(ws, input="Hello, who are you?", store=False, **common)
        first_id = first[-1]["response"]["id"]
        send(ws, input="And what can you do?", store=False, previous_response_id=first_id, **common)
        send(ws, input="Hello, who are you?", store=False, **common)  # sent while the second runs
        second, third = receive(ws), receive(ws)
    for events in (first, second, third):
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert len({e[-1]["response"]["id"] for e in (first, second, third)}) == 3
    assert second[-1]["response"]["previous_response_id"] == first_id
    assert text(third) == text(first)
    whole = server.client(api_key=KEY).responses.create(
        input=[{"role": "user", "content": "Hello, who are you?"}, *first[-1]["response"]["output"],
               {"role": "user", "content": "And what can you do?"}], store=False, **common)
    assert text(second) == whole.output_text
    assert second[-1]["response"]["usage"]["input_tokens"] == whole.usage.input_tokens
    with socket(server) as fresh:  # store: false lives on its own socket only
        gone = error(turn(fresh, input="more", previous_response_id=first_id, **common))
    assert gone["status"] == 400 and gone["error"]["code"] == "previous_response_not_found"
    assert gone["error"]["param"] == "previous_response_id" and first_id in gone["error"]["message"]


def test_a_stored_response_continues_on_a_fresh_socket(server):
    with socket(server) as ws:
        first = turn(ws, input="Hi.", **{**COMMON, "max_output_tokens": 4})
    with socket(server) as ws:
        second = turn(ws, input="Bye.", previous_response_id=first[-1]["response"]["id"],
                      **{**COMMON, "max_output_tokens": 4})
    assert second[-1]["type"] == "response.incomplete"  # 4 tokens: cut short, but continued
    assert second[-1]["response"]["usage"]["input_tokens"] > first[-1]["response"]["usage"]["input_tokens"]


def test_a_failed_continuation_evicts_its_previous_response(server):
    small = {**COMMON, "max_output_tokens": 4}
    with socket(server) as ws:
        first_id = turn(ws, input="Hi.", store=False, **small)[-1]["response"]["id"]
        failed = error(turn(ws, input="Bye.", store=False, previous_response_id=first_id,
                            **{**small, "temperature": 99}))
        assert failed["status"] == 400 and failed["error"]["param"] == "temperature"
        gone = error(turn(ws, input="Bye.", store=False, previous_response_id=first_id, **small))
        assert gone["error"]["code"] == "previous_response_not_found"


@pytest.mark.parametrize("message, param", [
    ("not json", None),
    (json.dumps({"type": "response.cancel"}), "type"),
    (json.dumps({"input": "Hi."}), "type"),
    (json.dumps({"type": "response.create", "input": "Hi.", "stream": True}), "stream"),
    (json.dumps({"type": "response.create", "input": "Hi.", "background": False}), "background"),
    (json.dumps({"type": "response.create", "input": "Hi.", "stream_options": {}}), "stream_options"),
    (json.dumps({"type": "response.create", "input": "Hi.", "stream_id": "lane"}), "stream_id"),
])
def test_a_bad_message_gets_an_error_and_the_socket_stays_usable(server, message, param):
    with socket(server) as ws:
        ws.send(message)
        bad = error(receive(ws))
        assert bad["status"] == 400 and bad["error"]["param"] == param
        assert bad["error"]["type"] == "invalid_request_error"
        assert turn(ws, input="Hi.", **{**COMMON, "max_output_tokens": 2})[-1]["type"] == "response.incomplete"


def test_the_connection_limit(server, clock):
    with socket(server) as ws:
        clock.now += LIMIT_SECONDS
        limit = error(turn(ws, input="Hi.", **COMMON))
        assert limit["error"]["code"] == "websocket_connection_limit_reached"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
    with socket(server) as ws:  # a new connection has its own hour
        assert turn(ws, input="Hi.", **{**COMMON, "max_output_tokens": 2})[-1]["type"] == "response.incomplete"


@pytest.mark.parametrize("headers, status, code", [
    ({}, 401, "invalid_api_key"),
    ({"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
    ({"Authorization": f"Bearer {KEY}", "Origin": "https://elsewhere.example"}, 403, "origin_not_allowed"),
])
def test_a_refused_handshake_answers_the_http_error(server, headers, status, code):
    with pytest.raises(InvalidStatus) as refused:
        socket(server, headers)
    response = refused.value.response
    assert response.status_code == status
    assert json.loads(response.body)["error"]["code"] == code


def test_a_client_that_leaves_cancels_its_response(server):
    def cancelled():
        return server.metric('monolith_request_finished_total{finish_reason="cancelled"}',
                             headers={"Authorization": f"Bearer {KEY}"})

    before = cancelled()
    with socket(server) as ws:
        send(ws, input="Hi.", reasoning={"effort": "none"}, **{**COMMON, "max_output_tokens": 900})  # loops
        while not json.loads(ws.recv(timeout=120))["type"].endswith(".delta"):
            pass
    deadline = time.monotonic() + 30
    while cancelled() < before + 1:
        assert time.monotonic() < deadline, "the abandoned response kept running"
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_server_failure_evicts_too(demo_f32):
    """A continuation that fails mid-stream (the decoder breaks on its second call) ends
    with response.failed, as over HTTP, not telling the cause, and evicts the store: false
    response it continued."""
    model, _, tok = demo_f32
    flaky = Scripted(tok.encode("Hello."), fail=lambda call: RuntimeError("the decoder broke") if call > 1 else None)

    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=flaky), model_names=(NAME,)) as s:
        with socket(s.wait_ready()) as ws:
            first = turn(ws, input="Hi.", store=False, **COMMON)
            assert text(first) == "Hello."
            broken = turn(ws, input="Bye.", store=False, previous_response_id=first[-1]["response"]["id"], **COMMON)
            gone = error(turn(ws, input="Bye.", store=False, previous_response_id=first[-1]["response"]["id"],
                              **COMMON))
    assert [e["type"] for e in broken] == ["response.created", "response.in_progress", "response.failed"]
    assert broken[-1]["response"]["error"]["code"] == "server_error" and "broke" not in json.dumps(broken)
    assert gone["error"]["code"] == "previous_response_not_found"
