"""What Claude Code and the current `anthropic` SDK send to /v1/messages (issue 32), on the
demo pair, through the official SDK: the fields they add to every request, the thinking
switch and budget they ask for, structured output, context editing, the billing-header
line, exact usage in the stream, eagerly streamed tool input. References: the
tokenizer's own rendering of the OpenAI-shaped conversation, `jsonschema`, the same
request without the field, and the SDK's own stream accumulator."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from anthropic_rig import OPENS_THINKING, TOOLS, client
from serving_rig import Server, demo_servers

from monolith.runtime.engine import Engine, Limits
from monolith.serving.anthropic.context_edits import CLEARED_RESULT
from monolith.tokenizer import load_tokenizer

NAME = "demo"
MAX_CONTEXT = 2048
GREEDY = {"extra_body": {"temperature": 0}}
HELLO = [{"role": "user", "content": "Tell me about the weather."}]
BETA = ["context-management-2025-06-27"]
HINTS = dict(cache_control={"type": "ephemeral"}, metadata={"user_id": "user-1"}, service_tier="auto",
             speed="standard", inference_geo="us", diagnostics={"previous_message_id": None})
EAGER_TOOLS = [{**t, "eager_input_streaming": True, "strict": True, "cache_control": {"type": "ephemeral"},
                "defer_loading": False, "input_examples": [{"city": "Paris", "days": 2}]} for t in TOOLS]


@pytest.fixture(scope="module")
def server(demo_f32):
    with demo_servers(demo_f32, NAME, MAX_CONTEXT) as running:
        yield running["plain"]


@pytest.fixture(scope="module")
def thinking_server(synth_pair_f32):
    """A target with a template that opens the think block when thinking is on: the
    synthetic one, whose random weights reason on and on (the demo model closes an empty
    block at once)."""
    model, _, tok = synth_pair_f32
    tok = load_tokenizer(tok.path)
    tok.chat_template += OPENS_THINKING
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)), model_names=(NAME,)) as s:
        yield s.wait_ready(), tok


def tokens(tok, messages, tools=None, **kwargs) -> int:
    openai_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                      "parameters": t["input_schema"]}} for t in tools or ()]
    return len(tok.encode_chat(messages, openai_tools or None, **kwargs))


# ------------------------------------------------------------------ fields every request carries


def test_the_hints_stock_clients_send_are_accepted_and_change_nothing(server, demo_f32):
    tok = demo_f32[2]
    c = client(server)
    plain = c.messages.create(model=NAME, max_tokens=12, **GREEDY, messages=HELLO, tools=TOOLS,
                              thinking={"type": "enabled", "budget_tokens": 12})
    hinted = c.messages.create(model=NAME, max_tokens=12, **GREEDY, messages=HELLO, tools=EAGER_TOOLS,
                               thinking={"type": "adaptive"}, output_config={"effort": "high"}, **HINTS)
    assert [b.model_dump() for b in hinted.content] == [b.model_dump() for b in plain.content]
    assert hinted.usage.input_tokens + hinted.usage.cache_read_input_tokens == \
        tokens(tok, HELLO, TOOLS, enable_thinking=True)
    counted = c.messages.count_tokens(model=NAME, messages=HELLO, tools=EAGER_TOOLS, thinking={"type": "adaptive"},
                                      output_config={"effort": "high"}, cache_control={"type": "ephemeral"})
    assert counted.input_tokens == tokens(tok, HELLO, TOOLS, enable_thinking=True)


@pytest.mark.parametrize("fields, switch", [
    ({"output_config": {"effort": "low"}}, False),
    ({"output_config": {"effort": "medium"}}, True),
    ({"output_config": {"effort": "max"}, "thinking": {"type": "adaptive"}}, True),
    ({"thinking": {"type": "adaptive"}}, None),
    ({"thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "xhigh"}}, True),
    ({"thinking": {"type": "disabled"}, "output_config": {"effort": "high"}}, False),
    ({"thinking": {"type": "between_tools"}}, False),
])
def test_effort_and_thinking_set_qwens_thinking_switch(server, demo_f32, fields, switch):
    tok = demo_f32[2]
    counted = client(server).messages.count_tokens(model=NAME, messages=HELLO, **fields).input_tokens
    assert counted == tokens(tok, HELLO, **({} if switch is None else {"enable_thinking": switch}))


def test_between_tools_thinks_after_a_tool_result(server, demo_f32):
    tok = demo_f32[2]
    history = [*HELLO, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"}]}]
    openai = [*HELLO, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3"}]
    counted = client(server).messages.count_tokens(model=NAME, messages=history, tools=TOOLS,
                                                   thinking={"type": "between_tools"}).input_tokens
    assert counted == tokens(tok, openai, TOOLS, enable_thinking=True)


def test_medium_effort_caps_the_reasoning_and_display_omitted_hides_it(thinking_server):
    server, tok = thinking_server
    c = client(server)
    free = c.messages.create(model=NAME, max_tokens=16, **GREEDY, messages=HELLO, output_config={"effort": "high"})
    capped = c.messages.create(model=NAME, max_tokens=16, **GREEDY, messages=HELLO,
                               output_config={"effort": "medium"})
    assert free.content[0].type == capped.content[0].type == "thinking"
    assert len(tok.encode(free.content[0].thinking)) > 16 // 4  # the model would think on: the cap cut it
    assert len(tok.encode(capped.content[0].thinking)) <= 16 // 4
    assert free.content[0].thinking.startswith(capped.content[0].thinking)
    hidden = c.messages.create(model=NAME, max_tokens=16, **GREEDY, messages=HELLO,
                               thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "high"})
    assert hidden.content[0].type == "thinking" and hidden.content[0].thinking == ""
    assert [b.model_dump() for b in hidden.content[1:]] == [b.model_dump() for b in free.content[1:]]


def test_output_config_format_is_enforced_as_a_json_schema(server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    c = client(server)
    # sampled: a free-running answer would stray. No reasoning (it runs unconstrained), and room
    # for the most the grammar allows (each gap may hold a newline and 20 blanks: structured.py),
    # so that the reply always ends by itself
    for _ in range(3):
        reply = c.messages.create(model=NAME, max_tokens=256, messages=HELLO, extra_body={"temperature": 1},
                                  thinking={"type": "disabled"},
                                  output_config={"format": {"type": "json_schema", "schema": schema}})
        assert [b.type for b in reply.content] == ["text"] and reply.stop_reason == "end_turn", reply.content
        jsonschema.validate(json.loads(reply.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=NAME, max_tokens=5, messages=HELLO, output_config={"format": {"type": "xml"}})
    assert "output_config.format" in e.value.message


# ------------------------------------------------------------------ context editing


def _tool_history(n: int) -> tuple[list[dict], list[dict]]:
    """n tool uses with their results, in Anthropic's shape and in OpenAI's."""
    ours, theirs = [*HELLO], [*HELLO]
    for i in range(n):
        name, args = ("add", {"a": i, "b": 1}) if i % 2 == 0 else ("get_weather", {"city": "Oslo", "days": i})
        ours += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": name,
                                                     "input": args}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                               "content": f"result number {i} " * 6}]}]
        theirs += [{"role": "assistant", "content": "", "tool_calls": [
            {"id": f"toolu_{i}", "type": "function", "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "tool_call_id": f"toolu_{i}", "content": f"result number {i} " * 6}]
    return ours, theirs


def _cleared(theirs: list[dict], ids: set[str], inputs: bool = False) -> list[dict]:
    out = []
    for m in theirs:
        if m["role"] == "tool" and m["tool_call_id"] in ids:
            m = {**m, "content": CLEARED_RESULT}
        if inputs and m["role"] == "assistant" and m.get("tool_calls") and m["tool_calls"][0]["id"] in ids:
            m = {**m, "tool_calls": [{**m["tool_calls"][0], "function": {**m["tool_calls"][0]["function"],
                                                                        "arguments": {}}}]}
        out.append(m)
    return out


def test_clear_tool_uses_clears_the_oldest_results_and_reports_it(server, demo_f32):
    tok = demo_f32[2]
    c = client(server)
    ours, theirs = _tool_history(4)
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 10},
            "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["get_weather"]}
    reply = c.beta.messages.create(model=NAME, max_tokens=4, **GREEDY, messages=ours, tools=TOOLS, betas=BETA,
                                   context_management={"edits": [edit]}, thinking={"type": "disabled"})
    edited = _cleared(theirs, {"toolu_0", "toolu_2"})  # toolu_1 is excluded, toolu_3 kept
    before = tokens(tok, theirs, TOOLS, enable_thinking=False)
    after = tokens(tok, edited, TOOLS, enable_thinking=False)
    assert after < before
    assert [e.model_dump() for e in reply.context_management.applied_edits] == [
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 2, "cleared_input_tokens": before - after}]
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == after
    counted = c.beta.messages.count_tokens(model=NAME, messages=ours, tools=TOOLS, betas=BETA,
                                           context_management={"edits": [edit]}, thinking={"type": "disabled"})
    assert counted.input_tokens == after and counted.context_management.original_input_tokens == before
    with c.beta.messages.stream(model=NAME, max_tokens=4, **GREEDY, messages=ours, tools=TOOLS, betas=BETA,
                                context_management={"edits": [edit]}, thinking={"type": "disabled"}) as stream:
        events = list(stream)
    delta = [e for e in events if e.type == "message_delta"][0]
    assert [e.model_dump() for e in delta.context_management.applied_edits] == \
        [e.model_dump() for e in reply.context_management.applied_edits]


@pytest.mark.parametrize("edit, cleared", [
    ({"trigger": {"type": "input_tokens", "value": 10 ** 6}}, None),  # not triggered
    ({"trigger": {"type": "tool_uses", "value": 4}}, None),  # 4 uses: not more than 4
    ({"trigger": {"type": "tool_uses", "value": 3}}, {"toolu_0"}),  # the default keeps 3
    ({"trigger": {"type": "tool_uses", "value": 0}, "keep": {"type": "tool_uses", "value": 2},
      "clear_tool_inputs": True}, {"toolu_0", "toolu_1"}),
    ({"trigger": {"type": "tool_uses", "value": 0}, "keep": {"type": "tool_uses", "value": 0},
      "clear_at_least": {"type": "input_tokens", "value": 10 ** 5}}, None),  # cannot clear that much
])
def test_clear_tool_uses_triggers_keep_and_clear_at_least(server, demo_f32, edit, cleared):
    tok = demo_f32[2]
    ours, theirs = _tool_history(4)
    reply = client(server).beta.messages.create(
        model=NAME, max_tokens=2, messages=ours, tools=TOOLS, betas=BETA, thinking={"type": "disabled"},
        context_management={"edits": [{"type": "clear_tool_uses_20250919", **edit}]})
    edited = theirs if cleared is None else _cleared(theirs, cleared, edit.get("clear_tool_inputs", False))
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == \
        tokens(tok, edited, TOOLS, enable_thinking=False)
    applied = [e.model_dump() for e in reply.context_management.applied_edits]
    assert applied == ([] if cleared is None else [{
        "type": "clear_tool_uses_20250919", "cleared_tool_uses": len(cleared),
        "cleared_input_tokens": tokens(tok, theirs, TOOLS, enable_thinking=False)
        - tokens(tok, edited, TOOLS, enable_thinking=False)}])


def test_clear_thinking_keeps_the_last_turns_thinking(server, demo_f32):
    tok = demo_f32[2]
    ours, theirs = _tool_history(3)
    for m, n in zip([m for m in ours if m["role"] == "assistant"], range(3)):
        m["content"].insert(0, {"type": "thinking", "thinking": f"plan step {n}", "signature": ""})
    for m, n in zip([m for m in theirs if m["role"] == "assistant"], range(3)):
        m["reasoning_content"] = f"plan step {n}"
    reply = client(server).beta.messages.create(
        model=NAME, max_tokens=2, messages=ours, tools=TOOLS, betas=BETA, thinking={"type": "adaptive"},
        context_management={"edits": [{"type": "clear_thinking_20251015",
                                        "keep": {"type": "thinking_turns", "value": 1}}]})
    edited = [{k: v for k, v in m.items() if k != "reasoning_content" or v == "plan step 2"} for m in theirs]
    before, after = tokens(tok, theirs, TOOLS), tokens(tok, edited, TOOLS)
    assert [e.model_dump() for e in reply.context_management.applied_edits] == [
        {"type": "clear_thinking_20251015", "cleared_thinking_turns": 2, "cleared_input_tokens": before - after}]
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == after
    kept = client(server).beta.messages.create(
        model=NAME, max_tokens=2, messages=ours, tools=TOOLS, betas=BETA, thinking={"type": "adaptive"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    assert kept.context_management.applied_edits == []
    assert kept.usage.input_tokens + kept.usage.cache_read_input_tokens == before


@pytest.mark.parametrize("edits, culprit", [
    ([{"type": "clear_everything_20990101"}], "context_management.edits[0].type"),
    ([{"type": "clear_thinking_20251015"}, {"type": "compact_20260112"}], "context_management.edits[1].type"),
    ([{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": -1}}],
     "context_management.edits[0].keep"),
    ([{"type": "clear_tool_uses_20250919", "frobnicate": 1}], "context_management.edits[0].frobnicate"),
])
def test_unknown_or_bad_context_edits_are_400s_naming_them(server, edits, culprit):
    with pytest.raises(anthropic.BadRequestError) as e:
        client(server).messages.create(model=NAME, max_tokens=2, messages=HELLO,
                                       extra_body={"context_management": {"edits": edits}})
    assert culprit in e.value.message


# ------------------------------------------------------------------ the prompt cache and usage


def test_the_billing_header_line_is_not_part_of_the_prompt(server, demo_f32):
    tok = demo_f32[2]
    c = client(server)
    system = "You are a coding agent. " * 20

    def billed(cch: str) -> list[dict]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332.a1b; cc_entrypoint=cli; "
                                         f"cch={cch};"},
                {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]

    prompt = tokens(tok, [{"role": "system", "content": system}, *HELLO], enable_thinking=False)
    assert c.messages.count_tokens(model=NAME, system=billed("0a1b2"), messages=HELLO,
                                   thinking={"type": "disabled"}).input_tokens == prompt
    c.messages.create(model=NAME, max_tokens=2, system=billed("0a1b2"), messages=HELLO, thinking={"type": "disabled"})
    again = c.messages.create(model=NAME, max_tokens=2, system=billed("ffe31"), messages=HELLO,
                              thinking={"type": "disabled"})
    assert again.usage.cache_read_input_tokens == prompt - 1 and again.usage.input_tokens == 1


def test_message_start_and_message_delta_report_the_same_exact_usage(server):
    c = client(server)
    messages = [{"role": "user", "content": "A question asked twice, word for word."}]
    prompt = c.messages.count_tokens(model=NAME, messages=messages).input_tokens
    for turn in range(2):
        with c.messages.stream(model=NAME, max_tokens=3, **GREEDY, messages=messages) as stream:
            events = list(stream)
        start = [e for e in events if e.type == "message_start"][0].message.usage
        delta = [e for e in events if e.type == "message_delta"][0].usage
        assert start.input_tokens == delta.input_tokens and \
            start.cache_read_input_tokens == delta.cache_read_input_tokens
        assert start.input_tokens + start.cache_read_input_tokens == prompt
        if turn:  # the same prompt again: all but its last token came from the session
            assert start.cache_read_input_tokens == prompt - 1


# ------------------------------------------------------------------ eager tool input


def _tool_events(server, tools) -> tuple[list[dict], dict]:
    body = {"model": NAME, "max_tokens": 80, "temperature": 0, "stream": True, "messages": HELLO,
            "tools": tools, "tool_choice": {"type": "tool", "name": "get_weather"}, "thinking": {"type": "disabled"}}
    events = []
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    start = [e for e in events if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"]
    assert len(start) == 1
    index = start[0]["index"]
    return [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
            and e["index"] == index], start[0]["content_block"]


def test_eager_input_streaming_streams_the_input_as_the_call_is_written(server):
    whole, block = _tool_events(server, TOOLS)
    eager, eager_block = _tool_events(server, EAGER_TOOLS)
    assert len(whole) == 1 and len(eager) > 2
    assert block["name"] == eager_block["name"] == "get_weather"
    assert json.loads("".join(eager)) == json.loads(whole[0])
    jsonschema.validate(json.loads("".join(eager)), TOOLS[0]["input_schema"])
