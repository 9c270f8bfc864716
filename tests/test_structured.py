"""Structured output (issue 16): response_format json_object / json_schema and
tool_choice required / named, enforced by llguidance through plain and speculative
decoding, on the demo pair over HTTP with the official openai client. Every output is
validated with the `jsonschema` package; greedy speculative output equals greedy plain
output under a grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest
from serving_rig import assert_error, demo_servers

MAX_CONTEXT = 1024
NAME = "demo"

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                  "id": {"type": "integer", "minimum": 0, "maximum": 9999}},
                 "required": ["name", "id"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "array_bounds": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
    "number_bounds": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 65},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
        "required": ["age", "score"], "additionalProperties": False},
    "optional_keys": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 16}, "note": {"type": "string", "maxLength": 16},
        "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["title"], "additionalProperties": False},
    "defs_ref": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 6}, {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def servers(demo_f32):
    with demo_servers(demo_f32, NAME, MAX_CONTEXT) as running:
        yield running


def ask(server, schema_name, **kw):
    client = server.client()
    return client.chat.completions.create(
        model=NAME, max_tokens=400, messages=[{"role": "user", "content": f"Answer in JSON ({schema_name})."}],
        response_format={"type": "json_schema", "json_schema": {"name": schema_name, "strict": True,
                                                                "schema": SCHEMAS[schema_name]}}, **kw)


@pytest.mark.parametrize("schema_name", list(SCHEMAS))
def test_json_schema_outputs_validate_and_speculation_changes_nothing(servers, schema_name):
    greedy = {}
    for kind, server in servers.items():
        reply = ask(server, schema_name, temperature=0)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[schema_name])
        greedy[kind] = choice.message.content
        sampled = ask(server, schema_name, temperature=0.9, seed=7).choices[0]
        assert sampled.finish_reason == "stop", sampled
        jsonschema.validate(json.loads(sampled.message.content), SCHEMAS[schema_name])
    assert greedy["plain"] == greedy["speculative"]


def test_json_object_streamed(servers):
    for server in servers.values():
        stream = server.client().chat.completions.create(
            model=NAME, max_tokens=300, stream=True, temperature=0, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "A JSON object, please."}])
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_choice_gives_valid_calls(servers, choice):
    forced = "required" if choice == "required" else {"type": "function", "function": {"name": "add"}}
    for server in servers.values():
        for temperature in (0, 0.8):
            reply = server.client().chat.completions.create(
                model=NAME, max_tokens=300, tools=TOOLS, tool_choice=forced, temperature=temperature, seed=5,
                messages=[{"role": "user", "content": "What is the weather in Paris?"}])
            out = reply.choices[0]
            assert out.finish_reason == "tool_calls", out
            assert out.message.tool_calls
            schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
            for call in out.message.tool_calls:
                assert call.function.name in schemas
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            if choice == "named":
                assert [c.function.name for c in out.message.tool_calls] == ["add"]


def test_unsupported_schema_feature_is_refused_naming_it(servers):
    server = servers["plain"]
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "dependentSchemas": {"a": {}}}
    response = server.post("/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    error = assert_error(response, 400, param="response_format.json_schema.schema")
    assert "dependentSchemas" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"x-guidance": {"lenient": True}}}}},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_structure_requests_are_400(servers, body, param):
    response = servers["plain"].post("/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "x"}], **body})
    assert_error(response, 400, param=param)


def test_a_schema_nested_too_deeply_is_a_400(demo_f32):
    from monolith.serving import structured
    from monolith.serving.errors import APIError

    schema = {"type": "object"}
    for _ in range(2000):
        schema = {"type": "object", "properties": {"a": schema}}
    form = structured.response_format({"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}})
    with pytest.raises(APIError) as e:
        structured.grammar(form, demo_f32[2], reasoning_open=False)
    assert e.value.status == 400 and "nested too deeply" in e.value.message


def allowed(guide, token: int) -> bool:
    words = guide.words()
    return words is None or bool((int(words[token // 32]) & 0xFFFFFFFF) >> (token % 32) & 1)


def push_text(guide, tok, text: str) -> bool:
    """Push `text`'s tokens while the guide allows them; False at the first it refuses."""
    for token in tok.encode(text):
        if not allowed(guide, token):
            return False
        guide.push(token)
    return True


def template_call(tok, name: str, arguments: dict) -> str:
    """What the chat template writes between <tool_call> and </tool_call> for a call."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": "x"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}]}],
        TOOLS, add_generation_prompt=False)
    return text[text.rindex("<tool_call>") + len("<tool_call>"):text.rindex("</tool_call>")]


def test_under_tool_choice_auto_the_model_answers_freely_and_a_call_it_opens_is_valid(demo_f32):
    """tool_choice "auto": nothing is constrained before the model writes the template's
    <tool_call> token (text, or the end of the turn); after it, only a call to an offered
    tool with arguments valid for its schema, as the chat template writes one, then more
    calls or the end."""
    from monolith.runtime.grammar import GrammarTokenizer
    from monolith.serving import structured

    model, _, tok = demo_f32
    structure = structured.calls_once_opened(TOOLS, tok)
    grammar = structured.grammar(structure, tok, reasoning_open=False)
    vocabulary = GrammarTokenizer.of(tok, model.args.vocab_size)
    vocabulary.check(grammar)
    opener, closer, end = (tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>", "<|im_end|>"))

    free = vocabulary.guide(grammar)
    assert push_text(free, tok, "The weather in Paris is mild.") and allowed(free, end)

    for name, arguments in (("add", {"a": 2, "b": -3}), ("get_weather", {"city": "Paris", "days": 3})):
        guide = vocabulary.guide(grammar)
        push_text(guide, tok, "Let me check.")
        guide.push(opener)
        assert guide.words() is not None and not allowed(guide, end)
        assert push_text(guide, tok, template_call(tok, name, arguments)), (name, arguments)
        assert allowed(guide, closer)
        guide.push(closer)
        assert allowed(guide, end)  # the turn may end after a call

    for name, arguments in (("get_time", {"city": "Paris"}), ("add", {"a": 2, "b": 500}),
                            ("get_weather", {"city": "Paris"})):  # no such tool; over its maximum; days missing
        guide = vocabulary.guide(grammar)
        guide.push(opener)
        assert not (push_text(guide, tok, template_call(tok, name, arguments)) and allowed(guide, closer))


def test_under_tool_choice_auto_a_schema_no_grammar_takes_leaves_calls_unconstrained(servers):
    """A tool whose schema llguidance cannot compile refuses a forced call (400 naming it),
    but under "auto" the request is served as before: the calls are left unconstrained."""
    tool = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "dependentSchemas": {"a": {}}}}}
    body = {"model": NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tools": [tool]}
    server = servers["plain"]
    assert server.post("/v1/chat/completions", body).status_code == 200
    assert server.post("/v1/chat/completions", {**body, "tool_choice": "required"}).status_code == 400
