"""Our own failures are server errors: an exception from the engine's state (here a
ValueError, the kind `Session` and the prompt cache raise) reaches the client as a 500
of type server_error in each API's own shape (OpenAI's, Anthropic's, Responses'), is
logged at ERROR with its traceback, and the engine serves the next request. Only the
boundary's own checks answer 4xx."""

from __future__ import annotations

import json
import logging

import anthropic
import httpx
import openai
import pytest
from serving_rig import NAME, Scripted, Server

from monolith.runtime.engine import Engine, Limits

BROKEN = "a saved state of 60 tokens with states after 27 rows"


def failing_once(tokens):
    """A decoder whose first call fails inside the engine, then answers `tokens`."""
    return Scripted(tokens, fail=lambda call: ValueError(BROKEN) if call == 1 else None)


@pytest.fixture()
def broken(model, tok):
    """A server whose next request fails in the engine: (server, the decoder's reply text)."""
    tokens = tok.encode("hello there", add_special_tokens=False)
    with Server(lambda: Engine(model, tok, Limits(max_context=256), decoder=failing_once(tokens))) as server:
        yield server.wait_ready(), tok.decode(tokens)


def assert_logged(caplog):
    records = [r for r in caplog.records if r.name == "monolith.serve" and r.levelno == logging.ERROR]
    assert records and records[-1].exc_info is not None and BROKEN in str(records[-1].exc_info[1])


def test_openai_chat_answers_500_server_error_and_serves_the_next(broken, caplog):
    server, text = broken
    client = server.client()
    messages = [{"role": "user", "content": "hi"}]
    with caplog.at_level(logging.ERROR, "monolith.serve"):
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model=NAME, messages=messages, max_tokens=8)
    assert e.value.status_code == 500
    error = e.value.body
    assert error["type"] == "server_error" and BROKEN not in error["message"], error
    assert_logged(caplog)
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8)
    assert reply.choices[0].message.content == text


def test_a_streamed_failure_is_a_server_error_event(broken, caplog):
    server, text = broken
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    with caplog.at_level(logging.ERROR, "monolith.serve"):
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[0]["type"] == "server_error", events
    assert_logged(caplog)


def test_anthropic_messages_answer_500_api_error(broken, caplog):
    server, text = broken
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    with caplog.at_level(logging.ERROR, "monolith.serve"):
        with pytest.raises(anthropic.InternalServerError) as e:
            client.messages.create(model=NAME, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 500 and e.value.body["error"]["type"] == "api_error", e.value.body
    assert_logged(caplog)
    reply = client.messages.create(model=NAME, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert reply.content[0].text == text


def test_responses_answer_500_server_error(broken, caplog):
    server, text = broken
    client = server.client()
    with caplog.at_level(logging.ERROR, "monolith.serve"):
        with pytest.raises(openai.InternalServerError) as e:
            client.responses.create(model=NAME, input="hi", max_output_tokens=8)
    assert e.value.status_code == 500 and e.value.body["type"] == "server_error", e.value.body
    assert_logged(caplog)
    assert client.responses.create(model=NAME, input="hi", max_output_tokens=8).output_text == text


def test_a_request_the_engine_refuses_at_the_boundary_is_still_a_400(broken):
    server, _ = broken
    r = server.post("/v1/completions", {"model": NAME, "prompt": [10**9], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


SECRET = "the user's private prompt"


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"prompt": SECRET, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET}], "model": "nope"}, 404, "model"),
    ("/v1/messages", {"messages": [{"role": "user", "content": SECRET}], "model": NAME}, 400, "max_tokens"),
    ("/v1/responses", {"input": SECRET, "model": NAME, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/nothing", {"input": SECRET}, 404, None),
])
def test_every_refusal_is_logged_at_info_with_its_reason_and_param_never_the_body(model, tok, caplog, path, body,
                                                                                   status, param):
    """Operators see why a request was refused (issue 48): the endpoint, the status, the
    param and the message, at INFO; never the body."""
    with Server(lambda: Engine(model, tok, Limits(max_context=256), decoder=Scripted([]))) as server:
        server.wait_ready()
        caplog.set_level(logging.INFO, logger="monolith.serve")
        response = server.post(path, body)
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    logged = [r.getMessage() for r in caplog.records if r.name == "monolith.serve" and r.levelno == logging.INFO
              and path in r.getMessage()]
    assert len(logged) == 1, logged
    assert str(status) in logged[0] and message in logged[0], logged
    assert param is None or f"param {param}" in logged[0], logged
    assert SECRET not in "\n".join(r.getMessage() for r in caplog.records)
