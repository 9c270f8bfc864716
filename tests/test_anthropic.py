"""Anthropic's Messages API (issue 17): /v1/messages and /v1/messages/count_tokens on the
demo pair, plain and speculative, driven by the official `anthropic` SDK. References:
the OpenAI chat endpoint's greedy answer for the same conversation, the tokenizer's own
rendering of the OpenAI-shaped conversation (count_tokens), `jsonschema` for tool inputs,
the SDK's own stream accumulator (streamed == non-streamed)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import numpy as np
import pytest
from anthropic_rig import OPENS_THINKING, TOOLS, client
from serving_rig import Scripted, Server, demo_servers

from monolith.runtime.decoder import Decoder
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.grammar import Grammar, GrammarTokenizer
from monolith.serving.anthropic.requests import (
    parse_count_tokens_request,
    parse_messages_request,
)
from monolith.serving.errors import APIError
from monolith.serving.requests import SamplingDefaults
from monolith.tokenizer import load_tokenizer

MAX_CONTEXT = 1024
NAME = "demo"
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK has no sampling arguments any more
HELLO = [{"role": "user", "content": "Tell me about the weather."}]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]


@pytest.fixture(scope="module")
def servers(demo_f32):
    with demo_servers(demo_f32, NAME, MAX_CONTEXT) as running:
        yield running


def test_create_equals_the_chat_endpoints_greedy_answer(servers):
    texts = {}
    for kind, server in servers.items():
        chat = server.client().chat.completions.create(
            model=NAME, max_tokens=24, temperature=0,
            messages=[{"role": "system", "content": "You are terse."}, *HELLO])
        reply = client(server).messages.create(model=NAME, max_tokens=24, **GREEDY, messages=HELLO,
                                               system="You are terse.")
        assert reply.type == "message" and reply.role == "assistant" and reply.model == NAME
        assert [b.type for b in reply.content] == ["text"]
        assert reply.content[0].text == chat.choices[0].message.content
        want = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
        assert reply.stop_reason == want and reply.stop_sequence is None
        u = reply.usage
        assert u.output_tokens == chat.usage.completion_tokens
        assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
        assert u.cache_creation_input_tokens == 0
        texts[kind] = reply.content[0].text
    assert texts["plain"] == texts["speculative"]


def test_system_blocks_and_text_blocks_render_as_strings(servers, demo_f32):
    tok = demo_f32[2]
    c = client(servers["plain"])
    blocks = c.messages.count_tokens(
        model=NAME, system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.",
                                                               "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    want = tok.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert blocks.input_tokens == len(want)


def test_stream_accumulates_the_non_streamed_message(servers):
    for server in servers.values():
        c = client(server)
        reply = c.messages.create(model=NAME, max_tokens=30, **GREEDY, messages=HELLO)
        with c.messages.stream(model=NAME, max_tokens=30, **GREEDY, messages=HELLO) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in reply.content]
        assert final.stop_reason == reply.stop_reason
        assert final.usage.output_tokens == reply.usage.output_tokens
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
            reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_stop_sequences_end_the_text_and_are_reported(servers):
    c = client(servers["plain"])
    full = c.messages.create(model=NAME, max_tokens=40, **GREEDY, messages=HELLO).content[0].text
    assert len(full) > 12, full
    stop = full[8:11]
    reply = c.messages.create(model=NAME, max_tokens=40, **GREEDY, messages=HELLO,
                              stop_sequences=["never-there", stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == full[:full.index(stop)]
    with c.messages.stream(model=NAME, max_tokens=40, **GREEDY, messages=HELLO, stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    short = c.messages.create(model=NAME, max_tokens=3, **GREEDY, messages=HELLO)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_tool_use_round_trip(servers, demo_f32, choice):
    tok = demo_f32[2]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    chosen = [servers["speculative"]] if choice.get("disable_parallel_tool_use") else servers.values()
    for server in chosen:
        c = client(server)
        reply = c.messages.create(model=NAME, max_tokens=300, **GREEDY, tools=TOOLS, tool_choice=choice,
                                  messages=[question])
        assert reply.stop_reason == "tool_use", reply
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert uses and all(b.type == "tool_use" for b in reply.content)
        for use in uses:
            jsonschema.validate(use.input, SCHEMAS[use.name])
            assert use.id.startswith("toolu_")
        if choice["type"] == "tool":
            assert [u.name for u in uses] == ["add"]
        if choice.get("disable_parallel_tool_use"):
            assert len(uses) == 1
        with c.messages.stream(model=NAME, max_tokens=300, **GREEDY, tools=TOOLS, tool_choice=choice,
                               messages=[question]) as stream:
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in final.content] == [(u.name, u.input) for u in uses]
        results = [{"type": "tool_result", "tool_use_id": u.id, "content": [{"type": "text", "text": "sunny"}]}
                   for u in uses]
        history = [question, {"role": "assistant", "content": reply.content}, {"role": "user", "content": results}]
        answer = c.messages.create(model=NAME, max_tokens=20, **GREEDY, tools=TOOLS,
                                   tool_choice={"type": "none"}, messages=history)
        assert [b.type for b in answer.content] == ["text"] and answer.content[0].text
        assert answer.stop_reason in ("end_turn", "max_tokens")
        # the conversation reached the template as the OpenAI-shaped messages it reads
        counted = c.messages.count_tokens(model=NAME, tools=TOOLS, messages=history).input_tokens
        calls = [{"id": u.id, "type": "function", "function": {"name": u.name, "arguments": u.input}} for u in uses]
        openai_history = [question, {"role": "assistant", "content": "", "tool_calls": calls},
                          *[{"role": "tool", "tool_call_id": u.id, "content": "sunny"} for u in uses]]
        assert counted == len(tok.encode_chat(openai_history, OPENAI_TOOLS))


def test_thinking_blocks_from_the_reasoning(demo_f32):
    model, _, tok = demo_f32
    text = "<think>\nfirst, plan\n</think>\n\nThe answer."
    decoder = Scripted(tok.encode(text), cached=7)  # as if the prompt cache had held 7 of the prompt's tokens

    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=decoder),
                model_names=(NAME,)) as server:
        c = client(server.wait_ready())
        reply = c.messages.create(model=NAME, max_tokens=200, messages=HELLO,
                                  thinking={"type": "enabled", "budget_tokens": 200})
        assert [b.type for b in reply.content] == ["thinking", "text"]
        assert reply.content[0].thinking == "first, plan\n" and reply.content[1].text == "The answer."
        assert reply.stop_reason == "end_turn"
        assert reply.usage.cache_read_input_tokens == 7
        assert reply.usage.input_tokens == len(tok.encode_chat(HELLO, enable_thinking=True)) - 7
        assert reply.usage.output_tokens == len(tok.encode(text)) + 1  # and the stop token
        with c.messages.stream(model=NAME, max_tokens=200, messages=HELLO) as stream:
            deltas = {e.delta.type for e in stream if e.type == "content_block_delta"}
            final = stream.get_final_message()
        assert deltas == {"thinking_delta", "text_delta"}
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in reply.content]


@pytest.fixture(scope="module")
def thinking_servers(synth_pair_f32):
    """A pair with a template whose generation prompt opens the think block (as Qwen3.6's
    does with thinking on): the reasoning budget can be enforced. The synthetic pair: its
    random target reasons on and on (the demo model closes an empty block at once)."""
    model, drafter, tok = synth_pair_f32
    tok = load_tokenizer(tok.path)  # a copy: the shared one is never changed
    tok.chat_template += OPENS_THINKING
    plain = Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)), model_names=(NAME,))
    spec = Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT),
                                 decoder=Decoder(model, drafter, MAX_CONTEXT)), model_names=(NAME,))
    with plain as p, spec as s:
        yield {"plain": p.wait_ready(), "speculative": s.wait_ready()}, tok


def test_thinking_budget_ends_the_reasoning(thinking_servers):
    servers, tok = thinking_servers
    thinking = {"type": "enabled", "budget_tokens": 3}
    seen = {}
    for kind, server in servers.items():
        c = client(server)
        free = c.messages.create(model=NAME, max_tokens=40, **GREEDY, messages=HELLO,
                                 thinking={"type": "enabled", "budget_tokens": 40})
        assert free.content[0].type == "thinking"
        capped = c.messages.create(model=NAME, max_tokens=40, **GREEDY, messages=HELLO, thinking=thinking)
        assert [b.type for b in capped.content][:1] == ["thinking"] and capped.content[0].thinking
        # greedy under the grammar is greedy until the budget: the same first tokens
        assert free.content[0].thinking.startswith(capped.content[0].thinking)
        assert len(tok.encode(capped.content[0].thinking)) <= 3
        assert len(tok.encode(free.content[0].thinking)) > 3  # the model would have thought on: it was cut
        assert [b.type for b in capped.content] == ["thinking", "text"] and capped.content[1].text
        with c.messages.stream(model=NAME, max_tokens=40, **GREEDY, messages=HELLO, thinking=thinking) as stream:
            assert [b.model_dump() for b in stream.get_final_message().content] == \
                [b.model_dump() for b in capped.content]
        forced = c.messages.create(model=NAME, max_tokens=300, **GREEDY, messages=HELLO, thinking=thinking,
                                   tools=TOOLS, tool_choice={"type": "tool", "name": "add"})
        assert forced.stop_reason == "tool_use" and [b.type for b in forced.content] == ["thinking", "tool_use"]
        jsonschema.validate(forced.content[1].input, SCHEMAS["add"])
        seen[kind] = [capped.model_dump()["content"], forced.content[0].thinking, forced.content[1].input]
    assert seen["plain"] == seen["speculative"]


def test_guide_budget_forces_the_start_token_and_rolls_back(demo_f32):
    tok = demo_f32[2]
    end = tok.token_to_id("</think>")
    vocab = GrammarTokenizer.of(tok, tok.vocab_size)
    guide = vocab.guide(Grammar('start: "ok"', end, budget=3))
    word = tok.encode("a")[0]
    for _ in range(3):
        assert guide.words() is None and guide.forced() is None
        guide.push(word)
    assert guide.forced() == end and np.count_nonzero(guide.words()) == 1
    with pytest.raises(RuntimeError, match="budget"):
        guide.push(word)
    guide.rollback(2)  # a speculative round's rejected proposals
    assert guide.forced() is None and guide.waited == 1
    guide.push(word)
    guide.push(word)
    assert guide.masks(1)[0].all() and guide.masks(1)[1].tolist() == guide.words().tolist()
    guide.push(guide.forced())
    assert not guide.waiting and guide.forced() is not None  # the grammar's "ok" now


def test_thinking_switch_reaches_the_template(servers, demo_f32):
    tok = demo_f32[2]
    c = client(servers["plain"])
    off = c.messages.count_tokens(model=NAME, messages=HELLO, thinking={"type": "disabled"}).input_tokens
    on = c.messages.count_tokens(model=NAME, messages=HELLO,
                                 thinking={"type": "enabled", "budget_tokens": 2048}).input_tokens
    assert off == len(tok.encode_chat(HELLO, enable_thinking=False))
    assert on == len(tok.encode_chat(HELLO, enable_thinking=True))
    with pytest.raises(anthropic.BadRequestError) as e:  # this template opens no think block: no budget
        c.messages.create(model=NAME, max_tokens=4096, messages=HELLO,
                          thinking={"type": "enabled", "budget_tokens": 1024})
    assert "budget_tokens" in e.value.message


def test_count_tokens_equals_the_prompt_tokens_usage_reports(servers):
    c = client(servers["plain"])
    msgs = [{"role": "user", "content": "Count me, please."}]
    counted = c.messages.count_tokens(model=NAME, messages=msgs, system="sys", tools=TOOLS).input_tokens
    reply = c.messages.create(model=NAME, max_tokens=2, messages=msgs, system="sys", tools=TOOLS)
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    chat = servers["plain"].client().chat.completions.create(
        model=NAME, max_tokens=2, messages=[{"role": "system", "content": "sys"}, *msgs], tools=OPENAI_TOOLS)
    assert counted == chat.usage.prompt_tokens


# ------------------------------------------------------------------ errors


def _anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    assert "Traceback" not in response.text
    return body["error"]["message"]


def test_errors_in_anthropics_shape_through_the_sdk(servers, demo_f32):
    server = servers["plain"]
    c = client(server)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-nope", max_tokens=5, messages=HELLO)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nope" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=NAME, max_tokens=5, messages=HELLO, extra_body={"frobnicate": 1})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "frobnicate" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=NAME, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "messages[0].content[0]: this model takes no images" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=NAME, max_tokens=5, messages=HELLO, tools=TOOLS, tool_choice={"type": "tool",
                                                                                          "name": "nope"})
    assert "tool_choice.name" in e.value.message or "nope" in e.value.message
    message = _anthropic_error(server.post("/v1/messages", {"model": NAME, "messages": HELLO}), 400,
                               "invalid_request_error")
    assert "max_tokens" in message
    model, _, tok = demo_f32
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)), model_names=(NAME,),
                api_key="secret") as s:
        s.wait_ready()
        with pytest.raises(anthropic.AuthenticationError) as e:
            client(s, api_key="wrong").messages.create(model=NAME, max_tokens=2, messages=HELLO)
        assert e.value.body["error"]["type"] == "authentication_error"
        assert client(s, api_key="secret").messages.count_tokens(model=NAME, messages=HELLO).input_tokens > 0
        _anthropic_error(s.post("/v1/messages/count_tokens", {"model": NAME, "messages": HELLO}), 401,
                         "authentication_error")


BASE = {"model": NAME, "max_tokens": 5, "messages": HELLO}
HOSTILE = [
    {"max_tokens": -1}, {"max_tokens": 0}, {"max_tokens": 10**30}, {"max_tokens": "5"}, {"max_tokens": True},
    {"max_tokens": 1.5}, {"temperature": 1e308}, {"temperature": -0.1}, {"temperature": "hot"},
    {"temperature": 1.5}, {"top_p": 2}, {"top_p": -1}, {"top_k": -5}, {"top_k": 1e9}, {"top_k": 10**40},
    {"stop_sequences": "x"}, {"stop_sequences": [""]}, {"stop_sequences": [1]}, {"stop_sequences": ["a"] * 99},
    {"stream": "yes"}, {"model": 7}, {"model": None}, {"messages": []}, {"messages": "hi"}, {"messages": [1]},
    {"messages": [{"role": "robot", "content": "x"}]}, {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": 5}]}, {"messages": [{"role": "user", "content": [5]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
    {"messages": [{"role": "user", "content": "x", "name": "me"}]},
    {"messages": [*HELLO, {"role": "assistant", "content": "The best answer is ("}]},
    {"system": 5}, {"system": [{"type": "image"}]}, {"system": [{"type": "text", "text": 3}]},
    {"tools": {}}, {"tools": [5]}, {"tools": [{"name": "f"}]}, {"tools": [{"name": "", "input_schema": {}}]},
    {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"tools": [{"name": "f", "input_schema": {}, "strict": True}]},
    {"tool_choice": "any"}, {"tool_choice": {"type": "any"}}, {"tool_choice": {"type": "magic"}},
    {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
    {"thinking": {"type": "enabled"}}, {"thinking": {"type": "enabled", "budget_tokens": -3}},
    {"thinking": {"type": "enabled", "budget_tokens": 10**30}}, {"thinking": {"type": "adaptive"}},
    {"thinking": "on"}, {"metadata": "x"}, {"service_tier": "auto"},
    {"messages": [{"role": "user", "content": "x" * 20000}]},
]


@pytest.mark.parametrize("change", HOSTILE, ids=[json.dumps(c)[:40] for c in HOSTILE])
def test_hostile_fields_never_5xx(servers, change):
    server = servers["plain"]
    body = {**BASE, **change}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = server.post(path, body if path == "/v1/messages" else {k: v for k, v in body.items() if k in (
            "model", "messages", "system", "tools", "tool_choice", "thinking")})
        assert r.status_code < 500, r.text
        if r.status_code != 200:  # (a reply's text may say anything: the demo model writes Python)
            _anthropic_error(r, r.status_code, {400: "invalid_request_error", 404: "not_found_error"}[r.status_code])


@pytest.mark.parametrize("schema,param", [
    ({"type": "object", "properties": ["city"]}, "tools[0].input_schema.properties"),
    ({"type": "object", "properties": {"city": "string"}}, "tools[0].input_schema.properties.city"),
    ({"type": "object", "properties": {}, "required": [1]}, "tools[0].input_schema.required"),
])
def test_a_tool_schema_the_call_parser_cannot_read_is_a_400_naming_input_schema(schema, param):
    """The parameter-schema checks every API shares (tools/specs.py), named in Anthropic's fields."""
    body = {"model": NAME, "messages": HELLO, "tools": [{"name": "get_weather", "input_schema": schema}]}
    for parse, extra in ((parse_messages_request, {"max_tokens": 5}), (parse_count_tokens_request, {})):
        with pytest.raises(APIError) as caught:
            parse({**body, **extra}, SamplingDefaults())
        assert caught.value.status == 400 and caught.value.param == param and param in caught.value.message


def test_malformed_bodies_and_deep_nesting(servers):
    server = servers["plain"]
    deep = b'{"model": "demo", "max_tokens": 5, "messages": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    nested = {**BASE, "metadata": {"user_id": "u", "x": json.loads("[" * 500 + "]" * 500)}}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for raw in (b'{"messages": [', b"[1, 2]", b"\xff\xfe", b"", b"null", b'"text"', deep):
            r = httpx.post(server.url + path, content=raw, timeout=30)
            _anthropic_error(r, 400, "invalid_request_error")
    assert server.post("/v1/messages", nested).status_code == 200  # metadata changes nothing
    huge = httpx.post(server.url + "/v1/messages", content=b"{" + b" " * (9 * 2**20) + b"}", timeout=30)
    _anthropic_error(huge, 413, "request_too_large")


def test_raw_events_pings_and_a_failure_mid_stream(demo_f32):
    model, _, tok = demo_f32
    slow = Scripted(tok.encode("late"), delay=1.0)
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=slow), model_names=(NAME,),
                keepalive_seconds=0.2) as s:
        s.wait_ready()
        with httpx.stream("POST", s.url + "/v1/messages", timeout=60,
                          json={**BASE, "max_tokens": 50, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            frames = r.read().decode().split("\n\n")
    assert frames[-1] == ""  # no [DONE]: the stream ends after message_stop
    events = []
    for frame in frames[:-1]:
        head, data = frame.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == head[7:]
        events.append(payload)
    kinds = [e["type"] for e in events]
    assert kinds.count("ping") >= 3 and kinds[0] == "message_start" and kinds[-1] == "message_stop"
    order = [k for i, k in enumerate(kinds) if k != "ping" and not (k == "content_block_delta" == kinds[i - 1])]
    assert order == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta"} and "".join(d["text"] for d in deltas) == "late"
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}

    broken = Scripted([], fail=lambda call: RuntimeError("the decoder broke"))

    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=broken), model_names=(NAME,)) as s:
        stream = client(s.wait_ready()).messages.stream(model=NAME, max_tokens=5, messages=HELLO)
        with pytest.raises(anthropic.APIStatusError) as e, stream as events:
            events.get_final_message()
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
        assert "Traceback" not in str(e.value.body) and "broke" not in str(e.value.body)
