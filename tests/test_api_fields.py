"""docs/api-fields.md, kept true: every top-level field of the official SDKs' request
types (openai chat, completions and responses; anthropic messages and count_tokens,
beta included; ollama's chat and generate requests, their options and messages) has a
row in its API's table; each top-level row's mark is the policy the API's typed body
declares (serving/fields.py's markers), and every field a body declares has its row
(completions: its rows are declared; Ollama: its `options` too); and each row's field, sent to a live
server through the official client with the value in SAMPLES (tests/api_field_samples.py),
is accepted or refused (a 400 naming it) as the row's mark says (on a server whose model
takes images). Then what the newly
honoured OpenAI fields do, against independent references (the chat template's own
switch, the tools sent alone)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from anthropic.types import message_count_tokens_params, message_create_params
from anthropic.types.beta import message_count_tokens_params as beta_count_params
from anthropic.types.beta import message_create_params as beta_create_params
from api_field_samples import CHAT, COMPLETION, MESSAGES, RESPONSES, SAMPLES
from ollama import _types as ollama_types  # the client's typed requests
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params
from serving_rig import NAME
from vision_rig import png

from monolith.serving.anthropic.requests import MessagesBody
from monolith.serving.fields import REFUSED, policy
from monolith.serving.ollama import requests as ollama_requests
from monolith.serving.openai.requests import ChatBody, CompletionBody
from monolith.serving.responses.requests import ResponsesBody

DOC = Path(__file__).resolve().parents[1] / "docs" / "api-fields.md"
MARKS = ("honoured", "accepted, no effect", "refused")
TITLES = {"chat": "OpenAI chat completions", "completions": "OpenAI completions",
          "messages": "Anthropic messages", "responses": "OpenAI responses"}
SDK_TYPES = {
    "chat": [chat_create_params.CompletionCreateParamsStreaming,
             chat_create_params.CompletionCreateParamsNonStreaming],
    "completions": [completion_create_params.CompletionCreateParamsStreaming,
                    completion_create_params.CompletionCreateParamsNonStreaming],
    "messages": [message_create_params.MessageCreateParamsStreaming,
                 message_create_params.MessageCreateParamsNonStreaming,
                 message_count_tokens_params.MessageCountTokensParams,
                 beta_create_params.MessageCreateParamsStreaming,
                 beta_create_params.MessageCreateParamsNonStreaming,
                 beta_count_params.MessageCountTokensParams],
    "responses": [response_create_params.ResponseCreateParamsStreaming,
                  response_create_params.ResponseCreateParamsNonStreaming],
}
ROW = re.compile(r"^\| `([^`]+)` \| ([^|]+?) \|")
BODIES = {"chat": ChatBody, "completions": CompletionBody, "messages": MessagesBody, "responses": ResponsesBody}
NOT_IN_BODY = {"keep_alive"}  # read before the body is parsed (handlers.model_for)


@pytest.fixture(scope="module")
def server(vision_server):
    """The rows are sent to a server whose model takes images (serving_rig's vision_server)."""
    return vision_server


def table(api: str) -> dict[str, str]:
    """The rows of an API's table (`api`: a key of TITLES, or a table's title): field -> mark."""
    rows, inside = {}, False
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            inside = line[3:].startswith(TITLES.get(api, api))
        match = ROW.match(line) if inside else None
        if match:
            field, mark = match.group(1), match.group(2).strip()
            assert mark in MARKS, f"{api}: {field}: unknown mark {mark!r}"
            assert field not in rows, f"{api}: {field} has two rows"
            rows[field] = mark
    return rows


def sdk_fields(api: str) -> set[str]:
    return {name for kind in SDK_TYPES[api] for name in kind.__required_keys__ | kind.__optional_keys__}


@pytest.mark.parametrize("api", list(TITLES))
def test_every_sdk_field_has_a_row(api):
    rows = table(api)
    missing = sorted(sdk_fields(api) - set(rows))
    assert not missing, f"docs/api-fields.md's {TITLES[api]} table has no row for {missing}"


def top_rows(api: str) -> dict[str, str]:
    """The rows of an API's table about a top-level field of the body (not the SDK's
    headers: their rows say the SDK sends them "not in the body")."""
    header = {m.group(1) for m in map(ROW.match, DOC.read_text(encoding="utf-8").splitlines())
              if m and "not in the body" in m.string}
    return {field: mark for field, mark in table(api).items()
            if re.fullmatch(r"\w+", field) and field not in NOT_IN_BODY | header}


@pytest.mark.parametrize("api", list(TITLES))
def test_every_top_level_row_is_the_declared_policy(api):
    declared = {field: rule.mark for field, rule in policy(BODIES[api]).items()}
    rows = top_rows(api)
    wrong = {field: (mark, declared.get(field, f"undeclared: {REFUSED}")) for field, mark in rows.items()
             if declared.get(field, REFUSED) != mark}
    assert not wrong, f"docs/api-fields.md's {TITLES[api]} rows (mark, declared): {wrong}"
    if api != "completions":  # its table lists its own fields, not those it shares with chat
        missing = sorted(set(declared) - set(rows))
        assert not missing, f"docs/api-fields.md's {TITLES[api]} table has no row for the declared {missing}"


# ------------------------------------------------------------------ each row, live


def test_every_row_has_a_sample():
    for api in TITLES:
        rows = set(table(api))
        assert rows == set(SAMPLES[api]), (api, sorted(rows ^ set(SAMPLES[api])))


def cases(api: str) -> list:
    rows = table(api)
    return [pytest.param(field, mark, id=field) for field, mark in rows.items() if field in SAMPLES[api]]


def top_name(field: str) -> str:
    return re.split(r"[.\[: ]", field)[0]


def split_body(body: dict, api: str) -> tuple[dict, dict]:
    """(the keyword arguments the SDK knows, the rest as extra_body)."""
    known = sdk_fields(api)
    return ({k: v for k, v in body.items() if k in known and v is not None},
            {k: v for k, v in body.items() if k not in known})


def check(mark: str, field: str, call, error_class) -> None:
    """Run `call` (the SDK request); the row's mark says whether it must succeed."""
    try:
        reply = call()
        if isinstance(reply, (openai.Stream, anthropic.Stream)):
            list(reply)  # read it to the end
    except error_class as e:
        assert mark == "refused", f"{field} is marked {mark!r} but was refused: {e}"
        assert e.status_code == 400, e
        assert top_name(field) in str(e), f"the error does not name {top_name(field)}: {e}"
        return
    assert mark != "refused", f"{field} is marked refused but was accepted"


@pytest.mark.parametrize("field, mark", cases("chat"))
def test_chat_row(server, field, mark):
    kwargs, extra = split_body({**CHAT, **SAMPLES["chat"][field]}, "chat")
    client = server.client()
    check(mark, field, lambda: client.chat.completions.create(**kwargs, extra_body=extra), openai.APIStatusError)


@pytest.mark.parametrize("field, mark", cases("completions"))
def test_completions_row(server, field, mark):
    kwargs, extra = split_body({**COMPLETION, **SAMPLES["completions"][field]}, "completions")
    client = server.client()
    check(mark, field, lambda: client.completions.create(**kwargs, extra_body=extra), openai.APIStatusError)


@pytest.mark.parametrize("field, mark", cases("responses"))
def test_responses_row(server, field, mark):
    client = server.client()
    sample = SAMPLES["responses"][field]
    kwargs, extra = split_body({**RESPONSES, **(sample(client) if callable(sample) else sample)}, "responses")
    check(mark, field, lambda: client.responses.create(**kwargs, extra_body=extra), openai.APIStatusError)


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)


@pytest.mark.parametrize("field, mark", cases("messages"))
def test_messages_row(server, field, mark):
    kwargs, extra = split_body({**MESSAGES, **SAMPLES["messages"][field]}, "messages")
    client = claude(server)
    check(mark, field, lambda: client.beta.messages.create(**kwargs, extra_body=extra), anthropic.APIStatusError)


COUNTED = {name for kind in (message_count_tokens_params.MessageCountTokensParams,
                             beta_count_params.MessageCountTokensParams)
           for name in kind.__required_keys__ | kind.__optional_keys__}  # count_tokens' own fields


@pytest.mark.parametrize("field, mark", [case for case in cases("messages")
                                         if set(SAMPLES["messages"][case.values[0]]) <= COUNTED])
def test_count_tokens_row(server, field, mark):
    body = {k: v for k, v in {**MESSAGES, **SAMPLES["messages"][field]}.items() if k in COUNTED}
    client = claude(server)
    check(mark, field, lambda: client.beta.messages.count_tokens(**body), anthropic.APIStatusError)


# ------------------------------------------------------------------ what the newly honoured fields do

PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"], "additionalProperties": False}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


def prompt_tokens(client, **kw) -> int:
    reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                           **kw)
    return reply.usage.prompt_tokens


def test_reasoning_effort_is_the_templates_thinking_switch(server):
    """The reference: the template's own enable_thinking (the synthetic template writes an
    empty think block when it is false)."""
    client = server.client()
    off = prompt_tokens(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = prompt_tokens(client, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert off != on
    for effort in ("none", "minimal"):
        assert prompt_tokens(client, reasoning_effort=effort) == off
    for effort in ("low", "medium", "high", "xhigh", "max"):
        assert prompt_tokens(client, reasoning_effort=effort) == on
    agreed = {"chat_template_kwargs": {"enable_thinking": False}}
    assert prompt_tokens(client, reasoning_effort="none", extra_body=agreed) == off
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        prompt_tokens(client, reasoning_effort="high", extra_body=agreed)
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        prompt_tokens(client, reasoning_effort="extreme")


def test_allowed_tools_shows_only_the_allowed(server):
    """The prompt is the one rendered with the allowed tools alone; mode required calls one."""
    client = server.client()
    alone = prompt_tokens(client, tools=[NOOP])
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "noop"}}]}}
    assert prompt_tokens(client, tools=[PICK, NOOP], tool_choice=allowed) == alone != prompt_tokens(
        client, tools=[PICK, NOOP])
    required = {**allowed, "allowed_tools": {**allowed["allowed_tools"], "mode": "required"}}
    reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                           tools=[PICK, NOOP], tool_choice=required, max_tokens=100, temperature=0)
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["noop"]
    unknown = {**allowed, "allowed_tools": {"mode": "auto", "tools": [{"type": "function",
                                                                       "function": {"name": "gone"}}]}}
    with pytest.raises(openai.BadRequestError, match="gone"):
        prompt_tokens(client, tools=[PICK, NOOP], tool_choice=unknown)


def test_parallel_tool_calls_false_makes_a_forced_call_single(server):
    from monolith.serving.openai.requests import parse_chat_request  # the grammar it asks for

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [PICK], "tool_choice": "required"}
    assert not parse_chat_request(body).structure.single
    assert parse_chat_request({**body, "parallel_tool_calls": False}).structure.single
    reply = server.client().chat.completions.create(model=NAME, max_tokens=100, temperature=0,
                                                    parallel_tool_calls=False, **body)
    assert len(reply.choices[0].message.tool_calls) == 1


def test_null_means_not_given(server):
    """The openai SDK sends None as JSON null: a refused field left null is accepted."""
    client = server.client()
    reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                           audio=None, n=None, web_search_options=None, modalities=None,
                                           verbosity=None, logit_bias=None)
    assert reply.choices[0].finish_reason == "length"


def test_stream_options_without_stream(server):
    """stream_options changes nothing for a reply that is not streamed: accepted, and the
    usage is in the body as always."""
    reply = server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=1, stream_options={"include_usage": True})
    assert reply.usage.completion_tokens == 1


# ------------------------------------------------------------------ Ollama

OLLAMA = "Ollama"
OLLAMA_CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream": False,
               "options": {"num_predict": 2}}
OLLAMA_GENERATE = {"model": NAME, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
CALLED = [{"role": "user", "content": "weather?"},
          {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                            "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "content": "11 degrees", "tool_name": "get_weather", "tool_call_id": "call_1"}]
OPTION_SAMPLES = {"num_predict": 3, "num_ctx": 512, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05,
                  "seed": 3, "stop": ["\n"], "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                  "mirostat": 1, "tfs_z": 0.9, "typical_p": 0.7, "repeat_last_n": 64, "penalize_newline": True,
                  "mirostat_tau": 5.0, "mirostat_eta": 0.1, "num_keep": 4, "num_batch": 512, "num_thread": 8,
                  "num_gpu": 99, "main_gpu": 0, "low_vram": False, "numa": False, "use_mmap": True,
                  "use_mlock": False, "f16_kv": True, "logits_all": False, "vocab_only": False,
                  "embedding_only": False}


def ollama_samples() -> dict:
    """field -> (endpoint, the fields sent over the base body's)."""
    image = base64.b64encode(png(1)).decode()
    chat = {"model": {"model": NAME}, "stream": {"stream": True}, "keep_alive": {"keep_alive": "5m"},
            "format": {"format": "json"}, "think": {"think": "high"}, "logprobs": {"logprobs": True},
            "top_logprobs": {"logprobs": True, "top_logprobs": 2}, "options": {"options": {"temperature": 0.5}},
            "messages": {}, "messages[].role": {"messages": [{"role": "system", "content": "s"},
                                                             {"role": "user", "content": "hi"}]},
            "messages[].content": {}, "messages[].images": {"messages": [{"role": "user", "content": "x",
                                                                          "images": [image]}]},
            "messages[].thinking": {"messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "a", "thinking": "t"},
                                                 {"role": "user", "content": "and?"}]},
            "messages[].tool_calls": {"messages": CALLED}, "messages[].tool_name": {"messages": CALLED},
            "messages[].tool_call_id": {"messages": CALLED}, "tools": {"tools": [PICK]}}
    generate = {"prompt": {}, "system": {"system": "Be brief."}, "images": {"images": [image]},
                "raw": {"raw": True}, "suffix": {"suffix": "end"}, "template": {"template": "{{ .Prompt }}"},
                "context": {"context": [1, 2]}, "width": {"width": 64}, "height": {"height": 64},
                "steps": {"steps": 4}}
    out = {field: ("/api/chat", body) for field, body in chat.items()}
    out.update({field: ("/api/generate", body) for field, body in generate.items()})
    out.update({f"options.{name}": ("/api/chat", {"options": {name: value}}) for name, value in OPTION_SAMPLES.items()})
    return out


def test_every_ollama_field_has_a_row_and_a_sample():
    fields = set(ollama_types.ChatRequest.model_fields) | set(ollama_types.GenerateRequest.model_fields)
    fields |= {f"options.{name}" for name in ollama_types.Options.model_fields}
    fields |= {f"messages[].{name}" for name in ollama_types.Message.model_fields}
    rows = table(OLLAMA)
    assert not sorted(fields - set(rows)), f"docs/api-fields.md's Ollama table has no row for {sorted(fields - set(rows))}"
    assert set(rows) == set(ollama_samples())


def test_every_ollama_top_level_and_option_row_is_the_declared_policy():
    """As test_every_top_level_row_is_the_declared_policy, for Ollama's two bodies and
    their `options` (a body nested in them, its fields' policy declared on it)."""
    declared = {field: rule.mark for body in (ollama_requests.ChatBody, ollama_requests.GenerateBody)
                for field, rule in policy(body).items()}
    declared |= {f"options.{field}": rule.mark for field, rule in policy(ollama_requests.Options).items()}
    rows = {field: mark for field, mark in table(OLLAMA).items()
            if re.fullmatch(r"(options\.)?\w+", field) and field not in NOT_IN_BODY}
    wrong = {field: (mark, declared.get(field, f"undeclared: {REFUSED}")) for field, mark in rows.items()
             if declared.get(field, REFUSED) != mark}
    assert not wrong, f"docs/api-fields.md's Ollama rows (mark, declared): {wrong}"
    assert not sorted(set(declared) - set(rows)), f"no row for the declared {sorted(set(declared) - set(rows))}"


@pytest.mark.parametrize("field, mark", list(table(OLLAMA).items()))
def test_ollama_row(server, field, mark):
    path, sample = ollama_samples()[field]
    base = OLLAMA_CHAT if path == "/api/chat" else OLLAMA_GENERATE
    body = {**base, **sample, "options": {**base["options"], **sample.get("options", {})}}
    reply = httpx.post(server.url + path, json=body, timeout=60)
    if mark == "refused":
        assert reply.status_code == 400, f"{field} is marked refused but was accepted"
        assert set(reply.json()) == {"error"} and reply.json()["error"].startswith(field.replace("[]", "[0]"))
        return
    assert reply.status_code == 200, f"{field} is marked {mark!r} but was refused: {reply.text}"
    lines = [json.loads(line) for line in reply.text.splitlines() if line]
    assert lines[-1]["done"] and not any("error" in line for line in lines), reply.text
