"""OpenAI's Responses API (issue 17) with the official openai client on the demo pair, a
plain and a speculative server: the reply equals the chat endpoint's for the same
conversation, streaming events rebuild the same response, function calls round-trip,
text.format's JSON validates with `jsonschema`, previous_response_id equals sending the
conversation whole, and hostile input gets 4xx bodies naming the field, never a 5xx.
(The reply format fed scripted deltas, no model: tests/test_responses_reply.py.)"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from responses_rig import ADD, TOOLS
from serving_rig import assert_error, demo_servers

MAX_CONTEXT = 1024
NAME = "demo"
INSTRUCTIONS = "You are terse."
CHAT_TOOLS = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
              for t in TOOLS]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def servers(demo_f32):
    with demo_servers(demo_f32, NAME, MAX_CONTEXT) as running:
        yield running


def items(response) -> list[dict]:
    """The output items without their ids (fresh per response)."""
    out = []
    for item in response.output:
        entry = item.model_dump(exclude_none=True)
        entry.pop("id")
        if entry["type"] == "function_call":
            entry.pop("call_id")
        out.append(entry)
    return out


def reasoning_text(response) -> str:
    return "".join(c.text for item in response.output if item.type == "reasoning" for c in item.content or ())


def test_create_equals_chat_and_speculation_changes_nothing(servers):
    texts = {}
    for kind, server in servers.items():
        client = server.client()
        for max_tokens in (12, 60):
            reply = client.responses.create(model=NAME, instructions=INSTRUCTIONS, input="Name three colors.",
                                            max_output_tokens=max_tokens, temperature=0)
            chat = client.chat.completions.create(
                model=NAME, max_tokens=max_tokens, temperature=0,
                messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name three colors."}])
            choice = chat.choices[0]
            assert reply.object == "response" and reply.id.startswith("resp_")
            assert reply.output_text == (choice.message.content or "")
            assert reasoning_text(reply) == (getattr(choice.message, "reasoning_content", None) or "")
            assert reply.usage.input_tokens == chat.usage.prompt_tokens
            assert reply.usage.output_tokens == chat.usage.completion_tokens
            assert reply.usage.total_tokens == chat.usage.total_tokens
            if choice.finish_reason == "length":
                assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
            else:
                assert choice.finish_reason == "stop" and reply.status == "completed"
            assert reply.instructions == INSTRUCTIONS and reply.max_output_tokens == max_tokens
            texts[kind, max_tokens] = reply.output_text
    assert texts["plain", 60] == texts["speculative", 60] and texts["plain", 12] == texts["speculative", 12]


def test_stream_events_rebuild_the_response(servers):
    for server in servers.values():
        client = server.client()
        args = {"model": NAME, "input": "Tell me about the sea.", "max_output_tokens": 50, "temperature": 0,
                    "metadata": {"run": "x"}}
        whole = client.responses.create(**args)
        events = list(client.responses.create(stream=True, **args))
        types = [e.type for e in events]
        assert types[:2] == ["response.created", "response.in_progress"]
        assert types[-1] == {"completed": "response.completed", "incomplete": "response.incomplete"}[whole.status]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert types.count("response.output_item.added") == types.count("response.output_item.done")
        final = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == final.output_text == whole.output_text
        assert items(final) == items(whole) and final.metadata == {"run": "x"}
        for field in ("input_tokens", "output_tokens", "total_tokens"):  # cached_tokens: the second is cached
            assert getattr(final.usage, field) == getattr(whole.usage, field)
        for e in events:
            if e.type == "response.output_text.done":
                assert e.text == "".join(d.delta for d in events if d.type == "response.output_text.delta"
                                         and d.item_id == e.item_id)
        with client.responses.stream(**args) as stream:  # the SDK's accumulating helper
            helper = [e for e in stream]
        assert "".join(e.delta for e in helper if e.type == "response.output_text.delta") == whole.output_text
        assert items(helper[-1].response) == items(whole)


def test_function_call_round_trip(servers):
    replies = {}
    for kind, server in servers.items():
        client = server.client()
        question = {"role": "user", "content": "What is the weather in Paris for two days?"}
        first = client.responses.create(model=NAME, input=[question], tools=TOOLS, tool_choice="required",
                                        max_output_tokens=200, temperature=0)
        calls = [item for item in first.output if item.type == "function_call"]
        assert calls and first.status == "completed"
        schemas = {t["name"]: t["parameters"] for t in TOOLS}
        for call in calls:
            assert call.call_id.startswith("call_") and call.status == "completed"
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        named = client.responses.create(model=NAME, input=[question], tools=TOOLS,
                                        tool_choice={"type": "function", "name": "add"}, max_output_tokens=200)
        assert [(i.type, i.name) for i in named.output if i.type == "function_call"] == [("function_call", "add")]
        jsonschema.validate(json.loads(named.output[-1].arguments), ADD)
        single = client.responses.create(model=NAME, input=[question], tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_output_tokens=200, temperature=0.8)
        assert len([i for i in single.output if i.type == "function_call"]) == 1 and not single.parallel_tool_calls

        streamed = list(client.responses.create(model=NAME, input=[question], tools=TOOLS, tool_choice="required",
                                                max_output_tokens=200, temperature=0, stream=True))
        args = [e for e in streamed if e.type == "response.function_call_arguments.done"]
        assert [e.arguments for e in args] == [c.arguments for c in calls]
        assert items(streamed[-1].response) == items(first)

        outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"} for c in calls]
        second = client.responses.create(model=NAME, input=[question, *first.output, *outputs], tools=TOOLS,
                                         tool_choice="none", max_output_tokens=40, temperature=0)
        assert not [i for i in second.output if i.type == "function_call"] and second.output_text
        assistant = {"role": "assistant", "content": "",
                     "tool_calls": [{"id": c.call_id, "type": "function",
                                     "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
        if reasoning_text(first):
            assistant["reasoning_content"] = reasoning_text(first)
        tool_messages = [{"role": "tool", "tool_call_id": c.call_id, "content": "sunny, 21 C"} for c in calls]
        chat = client.chat.completions.create(model=NAME, messages=[question, assistant, *tool_messages],
                                              tools=CHAT_TOOLS, tool_choice="none", max_tokens=40, temperature=0)
        assert second.output_text == chat.choices[0].message.content
        replies[kind] = [first.output[-1].arguments, second.output_text]
    assert replies["plain"] == replies["speculative"]


def test_json_schema_text_format(servers):
    outputs = {}
    for kind, server in servers.items():
        client = server.client()
        for temperature in (0, 0.9):
            reply = client.responses.create(
                model=NAME, input="Describe a person in JSON.", max_output_tokens=200, temperature=temperature,
                text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}})
            assert reply.status == "completed", reply
            jsonschema.validate(json.loads(reply.output_text), SCHEMA)
            assert reply.text.format.type == "json_schema"
            outputs[kind, temperature] = reply.output_text
        loose = client.responses.create(model=NAME, input="A JSON object.", max_output_tokens=150, temperature=0,
                                        text={"format": {"type": "json_object"}})
        assert isinstance(json.loads(loose.output_text), dict)
    assert outputs["plain", 0] == outputs["speculative", 0]


def test_previous_response_id_equals_the_whole_conversation(servers):
    server = servers["speculative"]
    client = server.client()
    common = {"model": NAME, "instructions": INSTRUCTIONS, "max_output_tokens": 30, "temperature": 0}
    first = client.responses.create(input="Hello, who are you?", **common)
    second = client.responses.create(input="And what can you do?", previous_response_id=first.id, **common)
    whole = client.responses.create(input=[{"role": "user", "content": "Hello, who are you?"}, *first.output,
                                           {"role": "user", "content": "And what can you do?"}], **common)
    assert second.previous_response_id == first.id
    assert second.output_text == whole.output_text and items(second) == items(whole)
    assert second.usage.input_tokens == whole.usage.input_tokens
    third = client.responses.create(input="Thanks.", previous_response_id=second.id, **common)
    chain = client.responses.create(input="Thanks.", previous_response_id=whole.id, **common)
    assert third.output_text == chain.output_text

    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="x", previous_response_id="resp_nope", **common)
    assert e.value.body["param"] == "previous_response_id" and "resp_nope" in e.value.body["message"]
    unstored = client.responses.create(input="x", store=False, **common)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert_error(httpx.get(server.url + "/v1/responses/resp_nope"), 404, param="response_id")


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [5]}, "input[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input[0].extra"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input[0].encrypted_content"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": -5}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "x", "temperature": 1e308}, "temperature"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "top_p": 7}, "top_p"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "instructions": ["a"]}, "instructions"),
    ({"input": "x", "tools": {"type": "function"}}, "tools"),
    ({"input": "x", "tools": [{"type": "browser"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools[0].parameters"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"properties": ["a"]}}]},
     "tools[0].parameters.properties"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [
        {"type": "function", "name": "f", "parameters": {"properties": {}, "required": "a"}}]}]},
     "tools[0].tools[0].parameters.required"),
    ({"input": "x", "tools": [TOOLS[0], TOOLS[0]]}, "tools[1].name"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format.schema"),
    ({"input": "x", "text": {"verbosity": "loud"}}, "text.verbosity"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
      "tools": TOOLS, "tool_choice": "required"}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {
        "type": "object", "dependentSchemas": {"a": {}}}}}}, "text.format.schema"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "reasoning": {"summary": "detailed"}}, "reasoning.summary"),
    ({"input": "x", "reasoning": {"effort": "low", "generate_summary": "auto"}}, "reasoning.generate_summary"),
    ({"input": "x", "reasoning": "high"}, "reasoning"),
    ({"input": "x", "frequency_penalty": 1}, "frequency_penalty"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "metadata": {"k": 5}}, "metadata.k"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "previous_response_id": 12}, "previous_response_id"),
])
def test_bad_requests_are_400_naming_the_field(servers, body, param):
    response = servers["plain"].post("/v1/responses", {"model": NAME, **body})
    assert_error(response, 400, param=param)


def test_hostile_bodies_never_get_a_5xx(servers):
    server = servers["plain"]
    url = server.url + "/v1/responses"
    raw = [b'{"input": [', b"[1, 2]", b"\xff\xfe", b"", b"null", b'"x"', nested(100_000),
           b'{"input": ' + nested(50_000) + b"}", b'{"input": "x", "max_output_tokens": 1e999}',
           b'{"input": "' + b"\\ud800" * 10 + b'"}']
    for content in raw:
        response = httpx.post(url, content=content, timeout=30)
        assert 400 <= response.status_code < 500, (content[:40], response.text)
        assert "Traceback" not in response.text
    for content in (nested(100_000), b'{"messages": [{"role": "user", "content": "\\udc00"}]}'):  # chat too
        assert_error(httpx.post(server.url + "/v1/chat/completions", content=content, timeout=30), 400)
    deep = {"input": "x"}
    for _ in range(200):
        deep = {"input": [deep]}
    for body in (deep, {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}] * 3,
                                   "type": "message", "status": None}], "metadata": None, "tools": [],
                        "max_output_tokens": 4},
                 {"model": "gpt-9", "input": "x"}):
        response = server.post("/v1/responses", body)
        assert response.status_code < 500, response.text
        if response.status_code >= 400:  # a reply's text may say anything (the demo model writes Python)
            assert "Traceback" not in response.text, response.text
    assert_error(server.post("/v1/responses", {"model": "gpt-9", "input": "x"}), 404, param="model")
    assert_error(httpx.put(url, content=b"{}"), 405)


def test_reasoning_effort_switches_qwens_thinking(servers, demo_f32):
    """reasoning.effort none / minimal renders the prompt with enable_thinking false, low
    and up with it true: the prompt the chat endpoint renders with the same switch
    (Codex CLI sends reasoning: {effort, summary: "auto"})."""
    tok = demo_f32[2]
    client = servers["plain"].client()
    for effort, thinking in (("none", False), ("minimal", False), ("low", True), ("high", True), ("max", True)):
        response = client.responses.create(model=NAME, input="Hi", max_output_tokens=1,
                                           reasoning={"effort": effort, "summary": "auto"})
        prompt = tok.encode_chat([{"role": "user", "content": "Hi"}], enable_thinking=thinking)
        assert response.usage.input_tokens == len(prompt), effort
        assert response.reasoning.effort == effort and response.reasoning.summary == "auto"
    off = tok.encode_chat([{"role": "user", "content": "Hi"}], enable_thinking=False)
    on = tok.encode_chat([{"role": "user", "content": "Hi"}], enable_thinking=True)
    assert off != on  # the demo template tells the two apart
