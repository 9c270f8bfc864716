"""What stock Codex CLI sends to /v1/responses (issue 33), against independent references:
the official openai SDK's types on the wire, `cryptography`'s Fernet with the key file
read directly, `jsonschema`, Python's `re` and llguidance itself for a custom tool's
grammar, and the same request without the feature (the prompt's token count). Client
hints and metadata are accepted and a `null` is "not given"; reasoning is sealed into
`encrypted_content` and opened when it comes back; namespace tools are flattened and
their calls come back apart; custom tools take one free-form string, constrained by
their grammar when forced; hosted tools are left out and said so; tool outputs take
Codex's extra fields and lists of parts. Bad input is a 400 naming the culprit."""

from __future__ import annotations

import json
import logging
import re
import stat

import httpx
import jsonschema
import llguidance
import pytest
from cryptography.fernet import Fernet
from responses_rig import DELTAS, TOOLS, scripted_reply, validate_event, with_cache_writes
from serving_rig import Server, assert_error

from monolith.runtime.engine import Engine, Limits
from monolith.serving.responses.items import items_to_messages
from monolith.serving.responses.seal import key_path

NAME = "demo"
ENCRYPTED = ["reasoning.encrypted_content"]
SAMPLES = 4  # forced calls at temperature 1 (this API takes no seed): each must hold
CLIENT_METADATA = {"x-codex-installation-id": "i-1", "session_id": "s-1", "turn_id": "t-1"}
NAMESPACE = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
     "parameters": {"type": "object", "properties": {"target": {"type": "string", "enum": ["a1", "a2"]}},
                    "required": ["target"], "additionalProperties": False}}]}
CODE = {"type": "custom", "name": "code", "description": "A ticket code.",
        "format": {"type": "grammar", "syntax": "regex", "definition": "[A-Z]{2}-[0-9]{3}"}}
# a patch in the spirit of Codex's apply_patch grammar, bounded so that a random model ends it
PATCH_GRAMMAR = r'''start: "*** Begin Patch" LF hunk{1,2} "*** End Patch" LF
hunk: "*** Add File: " NAME LF line{1,3}
line: "+" WORD LF
NAME: /[a-z]{1,8}\.txt/
WORD: /[a-z ]{0,12}/
%import common.LF
'''
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}


@pytest.fixture(scope="module")
def server(demo_f32):
    model, _, tok = demo_f32
    with Server(lambda: Engine(model, tok, Limits(max_context=2048)), model_names=(NAME,)) as s:
        yield s.wait_ready()


def create(server, **body) -> httpx.Response:
    return server.post("/v1/responses", {"model": NAME, "max_output_tokens": 8, **body})


def ok(response: httpx.Response) -> dict:
    from openai.types.responses import Response

    assert response.status_code == 200, response.text
    Response.model_validate(with_cache_writes(response.json()))
    return response.json()


def prompt_tokens(server, **body) -> int:
    return ok(create(server, max_output_tokens=1, **body))["usage"]["input_tokens"]


# ------------------------------------------------------------------ 1: hints, null


def test_client_hints_are_accepted_and_null_is_not_given(server):
    client = server.client()
    reply = client.responses.create(
        model=NAME, input="hi", max_output_tokens=2, include=["web_search_call.results"], store=False,
        prompt_cache_key="s-1", prompt_cache_retention="24h", text={"verbosity": "low"},
        extra_body={"client_metadata": CLIENT_METADATA})
    assert reply.status in ("completed", "incomplete") and reply.text.verbosity == "low"
    nulls = {key: None for key in ("conversation", "truncation", "background", "include", "tools", "text",
                                   "client_metadata", "prompt", "top_logprobs")}
    assert prompt_tokens(server, input="hi", **nulls) == prompt_tokens(server, input="hi")


@pytest.mark.parametrize("body, param", [
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"include": ["reasoning.everything"]}, "include"),
    ({"include": "reasoning.encrypted_content"}, "include"),
    ({"text": {"verbosity": "terse"}}, "text.verbosity"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"tools": [{"type": "function", "name": "agents.close_agent"}, NAMESPACE]}, "tools[1].tools[0].name"),
    ({"tools": [{**NAMESPACE, "tools": [{"type": "web_search"}]}]}, "tools[0].tools[0].type"),
    ({"tools": [{**CODE, "format": {"type": "grammar", "syntax": "regex", "definition": "[a-"}}]},
     "tools[0].format.definition"),
    ({"tools": [{**PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "start: nope"}}]},
     "tools[0].format.definition"),
    ({"tools": [{**CODE, "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}]},
     "tools[0].format.syntax"),
    ({"tools": [CODE], "tool_choice": {"type": "custom", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [PATCH], "tool_choice": {"type": "custom", "name": "apply_patch"}}, "tool_choice"),  # JSON calls
])
def test_bad_requests_are_400_naming_the_culprit(server, body, param):
    assert_error(create(server, input="x", **body), 400, param=param)


# ------------------------------------------------------------------ 2: encrypted reasoning


def test_reasoning_is_sealed_with_the_servers_key_and_opened_when_it_comes_back():
    """Each reasoning item carries its text sealed under the key file (0600, in the cache
    directory), non-streamed and streamed alike; the item sent back with its text removed
    is the same chat turn as the plain one."""
    for stream in (False, True):
        events, body = scripted_reply({"include": ENCRYPTED, "store": False, "tools": TOOLS}, DELTAS, "stop",
                                      (1, 7), stream=stream)
        reasoning = body["output"][0]
        assert Fernet(key_path().read_bytes()).decrypt(reasoning["encrypted_content"].encode()) == b"pondering"
        for event in events or ():
            validate_event(event)
        plain = items_to_messages(body["output"], "input")
        blind = {**reasoning, "content": [], "summary": []}
        assert items_to_messages([blind, *body["output"][1:]], "input") == plain
    assert stat.S_IMODE(key_path().stat().st_mode) == 0o600
    _, bare = scripted_reply({"tools": TOOLS}, DELTAS, "stop", (1, 7), stream=False)
    assert "encrypted_content" not in bare["output"][0]


def test_an_encrypted_reasoning_item_renders_as_its_text(server):
    _, body = scripted_reply({"include": ENCRYPTED, "store": False}, ["<think>mull</think>\n\nYes."], "stop",
                             (1, 7), stream=False)
    sealed = body["output"][0]["encrypted_content"]

    def conversation(reasoning: dict) -> list:
        return [{"role": "user", "content": "Well?"}, {"type": "reasoning", "summary": [], **reasoning},
                {"role": "assistant", "content": "Yes."}]

    as_text = prompt_tokens(server, input=conversation({"content": [{"type": "reasoning_text", "text": "mull"}]}))
    assert prompt_tokens(server, input=conversation({"encrypted_content": sealed})) == as_text
    assert prompt_tokens(server, input=conversation({"content": [{"type": "reasoning_text", "text": "x"}]})) \
        != as_text
    tampered = sealed[:-6] + ("A" if sealed[-6] != "A" else "B") + sealed[-5:]
    foreign = Fernet(Fernet.generate_key()).encrypt(b"mull").decode()
    for blob in (tampered, foreign, "not a token"):
        assert_error(create(server, input=conversation({"encrypted_content": blob})), 400,
                     param="input[1].encrypted_content")


# ------------------------------------------------------------------ 3: namespace tools


def test_a_namespace_tool_is_called_by_its_name_and_namespace(server):
    out = ok(create(server, input="Close it.", tools=[NAMESPACE], tool_choice="required", max_output_tokens=60,
                    parallel_tool_calls=False))["output"]
    calls = [item for item in out if item["type"] == "function_call"]
    assert [(c["name"], c["namespace"]) for c in calls] == [("close_agent", "agents")], out
    jsonschema.validate(json.loads(calls[0]["arguments"]), NAMESPACE["tools"][0]["parameters"])
    # the call comes back with its output as Codex sends it: extra fields, a list of parts
    result = {"type": "function_call_output", "id": "fco_1", "call_id": calls[0]["call_id"], "status": "completed",
              "name": "close_agent", "namespace": "agents"}
    history = [{"role": "user", "content": "Close it."}, calls[0]]
    as_parts = prompt_tokens(server, tools=[NAMESPACE], input=history + [
        {**result, "output": [{"type": "input_text", "text": "closed "}, {"type": "input_text", "text": "a1"}]}])
    assert prompt_tokens(server, tools=[NAMESPACE], input=history + [{**result, "output": "closed a1"}]) == as_parts


# ------------------------------------------------------------------ 4: custom tools


def test_a_forced_regex_custom_call_matches_its_pattern(server):
    client = server.client()
    for _ in range(SAMPLES):
        reply = client.responses.create(model=NAME, input="Ticket?", tools=[CODE], max_output_tokens=60,
                                        tool_choice={"type": "custom", "name": "code"}, temperature=1)
        calls = [item for item in reply.output if item.type == "custom_tool_call"]
        assert len(calls) == 1 and calls[0].name == "code", reply.output
        assert re.fullmatch(CODE["format"]["definition"], calls[0].input), calls[0].input
    # its output comes back on the next turn
    history = [{"role": "user", "content": "Ticket?"}, calls[0].model_dump(exclude_none=True),
               {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "filed"}]
    assert ok(create(server, input=history, tools=[CODE]))["status"] in ("completed", "incomplete")


def test_a_custom_call_streams_as_the_sdk_types_it():
    deltas = ['<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n"}}\n</tool_call>']
    events, body = scripted_reply({"tools": [PATCH, NAMESPACE]}, deltas, "stop", (1,), stream=True)
    for event in events:  # custom and namespace tools are OpenAI's: the specification defines neither
        validate_event(event, spec=False)
    item = body["output"][0]
    assert (item["type"], item["name"], item["input"]) == ("custom_tool_call", "apply_patch", "*** Begin Patch\n")
    assert [e["input"] for e in events if e["type"] == "response.custom_tool_call_input.done"] == [item["input"]]
    assert items_to_messages([item], "input")[0]["tool_calls"][0]["function"] == {
        "name": "apply_patch", "arguments": {"input": "*** Begin Patch\n"}}


@pytest.fixture(scope="module")
def xml_server(xml_model):
    """A server on the tiny target with the Qwen3.5 template (XML calls: raw-text inputs)."""
    model, tok = xml_model
    with Server(lambda: Engine(model, tok, Limits(max_context=2048)), model_names=(NAME,)) as s:
        yield s.wait_ready(), (tok.path / "tokenizer.json").read_text(encoding="utf-8")


def test_a_forced_lark_custom_call_is_in_its_grammar(xml_server):
    """At temperature 1, several samples: llguidance, given the grammar alone, accepts
    every input whole."""
    server, tokenizer_json = xml_server
    tokenizer = llguidance.LLTokenizer(tokenizer_json)
    for _ in range(SAMPLES):
        body = ok(server.post("/v1/responses", {
            "model": NAME, "input": "Add a file.", "tools": [PATCH], "temperature": 1,
            "tool_choice": {"type": "custom", "name": "apply_patch"}, "max_output_tokens": 400,
            "reasoning": {"effort": "none"}}))
        calls = [item for item in body["output"] if item["type"] == "custom_tool_call"]
        assert len(calls) == 1, body["output"]
        matcher = llguidance.LLMatcher(tokenizer, PATCH_GRAMMAR, log_level=0)
        tokens = tokenizer.tokenize_str(calls[0]["input"])
        assert all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting(), calls[0]["input"]


# ------------------------------------------------------------------ 5: hosted tools


def test_hosted_tools_are_left_out_and_said_so(server, caplog):
    function = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    hosted = [{"type": "web_search", "external_web_access": False},
              {"type": "code_interpreter", "container": {"type": "auto"}},
              {"type": "web_search"}]
    with caplog.at_level(logging.INFO, logger="monolith.serve"):
        response = create(server, input="hi", tools=[hosted[0], function, *hosted[1:]], max_output_tokens=1)
    assert response.headers["x-monolith-omitted-tools"] == "web_search, code_interpreter"
    assert any("web_search, code_interpreter" in r.getMessage() for r in caplog.records)
    assert ok(response)["usage"]["input_tokens"] == prompt_tokens(server, input="hi", tools=[function])
    assert "x-monolith-omitted-tools" not in create(server, input="hi", tools=[function]).headers
