# ruff: noqa: F811 - pytest fixtures imported from serving_rig
"""Hostile requests the reliability run of issue 20 found to give a 500, to hold the
engine, or to reach the server from a browser page: each is refused up front with a 4xx
in the API's error shape (or bounded), and the server goes on serving."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from serving_rig import MAX_CONTEXT, NAME, Scripted, Server, assert_error

from monolith.runtime.engine import Engine, Limits
from monolith.serving.timeouts import timed_h11
from monolith.serving.tools.calls import ToolCallParser
from monolith.tokenizer import load_tokenizer

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def raw(server, path: str, content: bytes, **headers) -> httpx.Response:
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json", **headers})


@pytest.mark.parametrize("path,body", [
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 4301 + b"}"),
    ("/v1/completions", b'{"prompt": "hi", "seed": -' + b"1" * 5000 + b"}"),
    ("/v1/messages", b'{"max_tokens": ' + b"7" * 4400 + b', "messages": []}'),
])
def test_an_integer_literal_over_python_s_digit_limit_is_a_400(server, path, body):
    response = raw(server, path, body)
    assert response.status_code == 400, response.text
    assert "integer" in response.text and "Traceback" not in response.text


@pytest.mark.parametrize("key", ["self", "messages", "tools", "add_generation_prompt", "bos_token", "eos_token"])
def test_template_kwargs_that_collide_with_what_the_renderer_sets_are_400(server, key):
    response = server.post(CHAT, {"model": NAME, "messages": HI, "max_tokens": 2,
                                  "chat_template_kwargs": {key: "x"}})
    assert_error(response, 400, param="chat_template_kwargs")
    assert key in response.json()["error"]["message"]


@pytest.mark.parametrize("parameters,param", [
    ({"type": "object", "properties": ["city"]}, "tools[0].function.parameters.properties"),
    ({"type": "object", "properties": "city"}, "tools[0].function.parameters.properties"),
    ({"type": "object", "properties": {"city": "string"}}, "tools[0].function.parameters.properties.city"),
    ({"type": "object", "properties": {}, "required": "city"}, "tools[0].function.parameters.required"),
    ({"type": "object", "properties": {}, "required": [1]}, "tools[0].function.parameters.required"),
])
def test_a_tool_schema_that_is_not_a_schema_is_a_400(server, parameters, param):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    for stream in (False, True):
        response = server.post(CHAT, {"model": NAME, "messages": HI, "max_tokens": 2, "tools": tools,
                                      "stream": stream})
        assert_error(response, 400, param=param)


def test_the_tool_call_parser_survives_any_schema_it_is_given():
    """Past the boundary (schemas the request validation let through are well formed), the
    parser still never raises on a property schema that is not an object."""
    parser = ToolCallParser([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "properties": {"city": True, "days": None}}}}])
    body = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
           "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    _, calls = parser.feed(body)
    _, calls2 = parser.finish()
    found = calls + calls2
    assert [c.name for c in found] == ["get_weather"]
    assert '"city": "Paris"' in found[0].arguments and '"days": 3' in found[0].arguments


def test_a_template_that_raises_outside_jinja_s_errors_is_a_400(model, pack):
    """jinja's sandbox refuses range(10**6) with an OverflowError, not a TemplateError."""
    tok = load_tokenizer(pack)
    tok.chat_template = "{% for i in range(10**6) %}x{% endfor %}"
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT))) as s:
        s.wait_ready()
        response = s.post(CHAT, {"model": NAME, "messages": HI, "max_tokens": 2})
        assert_error(response, 400)
        assert "chat template" in response.json()["error"]["message"]
        assert s.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_max_tokens_is_capped_by_the_server_limit(model, tok):
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)), max_tokens_limit=3) as s:
        s.wait_ready()
        for body in ({"prompt": "hi", "max_tokens": 2**64}, {"prompt": "hi"}):
            response = s.post("/v1/completions", {"model": NAME, "temperature": 0, **body})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] <= 3
        response = s.post(CHAT, {"model": NAME, "messages": HI, "max_completion_tokens": 10**30})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] <= 3


def test_a_prompt_too_long_in_bytes_is_refused_before_tokenizing(model, tok, monkeypatch):
    """No tokenizer turns B bytes into fewer than B / (its longest token's bytes) tokens:
    past max_context times that, the prompt cannot fit and is not tokenized."""
    calls = []
    original = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: calls.append(len(text)) or original(text, **kw))
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT))) as s:
        s.wait_ready()
        calls.clear()
        huge = "a" * (8 * 2**20 - 100)
        for path, body in (("/v1/completions", {"prompt": huge}), (CHAT, {"messages": [{"role": "user",
                                                                                      "content": huge}]})):
            response = s.post(path, {"model": NAME, "max_tokens": 2, **body})
            assert_error(response, 400, code="context_length_exceeded")
        assert not any(n > 2**20 for n in calls), calls


@pytest.mark.parametrize("host", ["evil.example:8000", "attacker.test", "127.0.0.1.nip.io"])
def test_a_foreign_host_header_is_refused_on_loopback(server, host):
    """DNS rebinding: a page of evil.example resolves its name to 127.0.0.1."""
    response = raw(server, CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}', Host=host)
    assert_error(response, 403, code="host_not_allowed")
    assert httpx.get(server.url + "/health", headers={"Host": host}).status_code == 403


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1", "[::1]:8000"])
def test_loopback_host_headers_are_served(server, host):
    response = raw(server, "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}', Host=host)
    assert response.status_code == 200, response.text


def test_cross_origin_browser_requests_are_refused_unless_allowed(model, tok):
    body = b'{"prompt": "hi", "max_tokens": 1}'
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)),
                allowed_origins=("https://ui.example",)) as s:
        s.wait_ready()
        assert_error(raw(s, "/v1/completions", body, Origin="https://evil.example"), 403, code="origin_not_allowed")
        assert_error(raw(s, "/v1/completions", body, Origin="null"), 403, code="origin_not_allowed")
        for origin in ("https://ui.example", "http://localhost:3000", "http://127.0.0.1:5173"):
            assert raw(s, "/v1/completions", body, Origin=origin).status_code == 200, origin
        assert raw(s, "/v1/completions", body).status_code == 200  # no Origin: not a browser page


def test_a_server_bound_beyond_loopback_takes_any_host(model, tok):
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)), loopback_only=False) as s:
        s.wait_ready()
        assert raw(s, "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}', Host="box.lan:8000").status_code == 200


def test_a_request_head_that_never_ends_is_closed(model, tok):
    """Half-open connections are closed after the header timeout (one that finishes its
    head in time is served)."""
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)), http=timed_h11(0.5)) as s:
        s.wait_ready()
        stalled = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert stalled.recv(1024) == b""  # closed by the server, not by the 30 s socket timeout
        assert s.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 1}).status_code == 200


def test_a_request_body_that_never_ends_is_a_408(model, tok):
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)), body_timeout=0.5) as s:
        s.wait_ready()
        slow = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = slow.recv(4096)
            if not chunk:
                break
            reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply
        assert json.loads(body)["error"]["code"] == "request_timeout"


# ------------------------------------------------------------------ wrong types (issue 48)

RESPONSES_PATHS = ("/v1/responses", "/v1/responses/compact", "/v1/responses/input_tokens")


@pytest.mark.parametrize("path", RESPONSES_PATHS)
@pytest.mark.parametrize("item,param", [
    ({"type": {"a": 1}, "role": "user", "content": "hi"}, "input[0].type"),
    ({"type": ["message"], "role": "user", "content": "hi"}, "input[0].type"),
    ({"type": "message", "role": {"user": 1}, "content": "hi"}, "input[0].role"),
    ({"type": "message", "role": ["user"], "content": "hi"}, "input[0].role"),
    ({"type": "message", "role": "user", "content": [{"type": ["input_text"], "text": "hi"}]},
     "input[0].content[0].type"),
    ({"type": "message", "role": "user", "content": [{"type": {"t": 1}, "text": "hi"}]}, "input[0].content[0].type"),
])
def test_a_responses_item_of_the_wrong_type_is_a_400_naming_it(server, path, item, param):
    """schemathesis and a type-confusion probe found `unhashable type` 500s here."""
    assert_error(server.post(path, {"model": NAME, "input": [item]}), 400, param=param)


@pytest.mark.parametrize("field,value,param", [
    ("reasoning", {"effort": ["high"]}, "reasoning.effort"),
    ("tool_choice", {"type": ["function"], "name": "f"}, "tool_choice.type"),
    ("tool_choice", {"type": "function", "name": ["f"]}, "tool_choice.name"),
    ("tools", [{"type": {"function": 1}, "name": "f"}], "tools[0].type"),
])
def test_a_responses_field_of_the_wrong_type_is_a_400_naming_it(server, field, value, param):
    for path in RESPONSES_PATHS[::2]:  # compact takes none of these
        assert_error(server.post(path, {"model": NAME, "input": "hi", field: value}), 400, param=param)


@pytest.mark.parametrize("field,value,param", [
    ("reasoning_effort", ["high"], "reasoning_effort"),
    ("reasoning_effort", {"high": 1}, "reasoning_effort"),
    ("tool_choice", {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": ["f"]}}]}}, "tool_choice.allowed_tools.tools[0].function.name"),
])
def test_a_chat_field_of_the_wrong_type_is_a_400_naming_it(server, field, value, param):
    assert_error(server.post(CHAT, {"model": NAME, "messages": HI, "max_tokens": 1, field: value}), 400, param=param)


@pytest.mark.parametrize("messages,empty", [
    ([{"role": "user", "content": []}], 0),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}, {"role": "user", "content": "go"}], 1),
])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_an_anthropic_message_with_no_content_blocks_is_a_400_naming_it(server, path, messages, empty):
    limit = {"max_tokens": 1} if path == "/v1/messages" else {}
    response = server.post(path, {"model": NAME, **limit, "messages": messages})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert f"messages[{empty}].content" in body["error"]["message"]


def test_compaction_without_a_model_is_a_400(server):
    """The Open Responses specification requires `model` in a compaction request."""
    from openresponses_spec import _document
    schema = _document()["components"]["schemas"]["CompactResponseMethodPublicBody"]
    assert "model" in schema["required"]
    assert_error(server.post("/v1/responses/compact", {"input": "hi"}), 400, param="model")


# ------------------------------------------------------------------ the default output cap (issue 48)

QWEN36_OUTPUT_TOKENS = 32768  # Qwen3.6's model card: "an output length of 32,768 tokens for most queries"


@pytest.mark.parametrize("config,cap", [
    ({}, QWEN36_OUTPUT_TOKENS),
    ({"max_new_tokens": 5}, 5),
    ({"max_length": 7}, 7),
    ({"max_new_tokens": 9, "max_length": 6}, 6),
    ({"max_new_tokens": 10**6}, QWEN36_OUTPUT_TOKENS),
    ({"max_new_tokens": "5", "max_length": True}, QWEN36_OUTPUT_TOKENS),
])
def test_the_default_output_cap_is_qwen_s_or_the_checkpoint_s_lower_one(config, cap):
    from monolith.serving.requests import SamplingDefaults
    assert SamplingDefaults.from_generation_config(config).max_tokens == cap
    assert SamplingDefaults.from_generation_config(config, max_output_tokens=3).max_tokens == 3


def test_a_request_without_a_limit_gets_the_server_s_output_cap(model, tok):
    """With no max_tokens, every API stops at --max-output-tokens; an explicit larger
    limit is honoured (here the scripted reply's 12 tokens)."""
    reply = tok.encode("one two three four five six")
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=Scripted(reply)),
                max_output_tokens=3) as s:
        s.wait_ready()
        chat = s.post(CHAT, {"model": NAME, "messages": HI}).json()
        assert chat["usage"]["completion_tokens"] == 3 and chat["choices"][0]["finish_reason"] == "length"
        text = s.post("/v1/completions", {"model": NAME, "prompt": "hi"}).json()
        assert text["usage"]["completion_tokens"] == 3
        responses = s.post("/v1/responses", {"model": NAME, "input": "hi"}).json()
        assert responses["usage"]["output_tokens"] == 3 and responses["status"] == "incomplete"
        longer = s.post(CHAT, {"model": NAME, "messages": HI, "max_tokens": 2 * len(reply)}).json()
        assert longer["usage"]["completion_tokens"] >= len(reply) and longer["choices"][0]["finish_reason"] == "stop"
        longer = s.post("/v1/responses", {"model": NAME, "input": "hi", "max_output_tokens": 2 * len(reply)}).json()
        assert longer["usage"]["output_tokens"] >= len(reply) and longer["status"] == "completed"
