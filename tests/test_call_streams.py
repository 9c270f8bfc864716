"""Tool calls in every API's stream (issue 48, defects 1-4), on the demo pair with the
issue's request (a forced call to a tool whose schema leaves `additionalProperties`
unsaid), through the official SDKs and their stream accumulators and the raw events:

1. no content before a forced call (the non-streamed reply has none);
2. a call's arguments arrive in pieces as they are generated, and the pieces add up to
   the non-streamed call exactly (openai's ChatCompletionStreamState and
   `responses.stream`, anthropic's `messages.stream`);
3. a call cut by max_tokens is still a call with the arguments written so far (the
   uncut call's prefix), finish_reason / stop_reason / status as each API says, its
   markup never text;
4. a forced call's arguments hold only the schema's keys.

References are independent of the server's own earlier output: the SDK accumulators,
the non-streamed reply to the same seeded request, the uncut reply's arguments, jiter's
partial JSON reader, llguidance's acceptance of a text."""

from __future__ import annotations

import json

import httpx
import pytest
from anthropic_rig import client as anthropic_client
from jiter import from_json
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from serving_rig import Server

from monolith.runtime.engine import Engine, Limits
from monolith.runtime.grammar import GrammarTokenizer
from monolith.serving import structured
from monolith.serving.tools.call_stream import CallStream, Piece
from monolith.serving.tools.calls import (
    ToolCallParser,
    arguments_object,
    parse_tool_calls,
)
from monolith.serving.tools.specs import forced_calls

NAME = "demo"
PARAMETERS = {"type": "object", "properties": {"directory": {"type": "string"}}}  # additionalProperties unsaid
CHAT_TOOLS = [{"type": "function", "function": {"name": "list_files", "parameters": PARAMETERS}}]
# where the demo model writes `{}` for list_files greedily, it writes both keys here
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
ASK = [{"role": "user", "content": "List files"}]
WEATHER_ASK = "What is the weather in Paris?"
CHOICES = {"chat": ["required", {"type": "function", "function": {"name": "list_files"}}],
           "anthropic": [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}],
           "responses": ["required", {"type": "function", "name": "get_weather"}]}
SEEDS = (2, 5)


@pytest.fixture(scope="module")
def server(demo_f32):
    model, _, tok = demo_f32
    with Server(lambda: Engine(model, tok, Limits(max_context=1024)), model_names=(NAME,)) as s:
        yield s.wait_ready()


def sse(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# ------------------------------------------------------------------ the pieces, without a model

TEXTS = [
    'Sure.\n<tool_call>\n{"name": "f", "arguments": {"path" : "a/\\"b\\"", "n": [1, 2.5, {"x": "é"}]}}\n</tool_call>',
    '<tool_call>\n{\n"name" : "f" , "arguments" : {\n"a" : true ,\n"b" : null }\n}\n</tool_call>\n\n',
    "<tool_call>\n<function=f>\n<parameter=path>\nsrc/a b.py\n</parameter>\n<parameter=n>\n[1, 2]\n</parameter>\n"
    "</function>\n</tool_call>",
    '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',  # arguments as a string
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "n": {"type": "array"}}}}}]


def stream_pieces(text: str, size: int, cut: bool = False) -> tuple[str, dict]:
    """The text fed `size` characters at a time: (the content, call id -> (name, the
    arguments pieces joined))."""
    stream = CallStream(ToolCallParser(TOOLS))
    items = []
    for i in range(0, len(text), size):
        items += stream.feed(text[i:i + size])
    items += stream.finish(cut)
    calls = {}
    for item in items:
        if isinstance(item, Piece):
            name, joined = calls.get(item.call.id, (item.call.name, ""))
            calls[item.call.id] = (name, joined + item.text)
    return "".join(i for i in items if isinstance(i, str)), calls


@pytest.mark.parametrize("text", TEXTS)
def test_the_pieces_add_up_to_the_call_however_the_text_is_cut(text):
    content, (call,) = parse_tool_calls(text, TOOLS)
    for size in (1, 2, 3, 7, len(text)):
        streamed, calls = stream_pieces(text, size)
        assert (streamed or None) == content and list(calls.values()) == [(call.name, call.arguments)]
    if '"arguments": {' in text or '"arguments" : {' in text:  # a JSON object: as the model wrote it
        assert call.arguments in text


def test_a_call_cut_short_keeps_what_was_written_and_never_its_markup():
    text = TEXTS[0]
    _, (whole,) = parse_tool_calls(text, TOOLS)
    start = text.index('"arguments":') + len('"arguments":')  # the call is named from here
    for end in range(len("Sure.\n<tool_call>"), len(text) - len("}\n</tool_call>")):
        content, calls = parse_tool_calls(text[:end], TOOLS, cut=True)
        assert content == "Sure."
        if end < start:  # not named yet: no call
            assert calls == []
            continue
        (call,) = calls
        assert call.name == "f" and not call.whole and whole.arguments.startswith(call.arguments)
        assert list(stream_pieces(text[:end], 3, cut=True)[1].values()) == [("f", call.arguments)]
        assert arguments_object(call.arguments) == (from_json(call.arguments.encode(), partial_mode=True)
                                                    if call.arguments else {})


def test_blanks_around_calls_are_never_content():
    for text in TEXTS[1:3]:
        assert stream_pieces("\n\n  " + text, 1)[0] == ""


# ------------------------------------------------------------------ defect 4: unsaid additionalProperties


@pytest.mark.parametrize("xml", [False, True])
def test_a_forced_call_cannot_invent_keys_but_response_format_can(demo_f32, xml_model, xml):
    model, tok = xml_model if xml else demo_f32[::2]
    gt = GrammarTokenizer.of(tok, model.args.vocab_size)
    nested = {"type": "object", "properties": {"o": {"type": "object", "properties": {"k": {"type": "string"}}}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": nested}}]
    grammar = structured.grammar(forced_calls(tools), tok, reasoning_open=False)

    def accepts(g, text):
        guide = gt.guide(g)
        for t in tok.encode(text, add_special_tokens=False):
            if not (int(guide.words()[t // 32]) >> (t % 32)) & 1:
                return False
            guide.push(t)
        return True

    def call(arguments):
        if not xml:
            return f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
        body = "".join(f"<parameter={k}>\n{json.dumps(v)}\n</parameter>\n" for k, v in arguments.items())
        return f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"

    assert accepts(grammar, call({"o": {"k": "v"}}))
    assert not accepts(grammar, call({"o": {"k": "v", "extra": 1}}))
    if not xml:
        assert not accepts(grammar, call({"o": {"k": "v"}, "extra": 1}))
    schema = structured.grammar(structured.response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": nested}}), tok, reasoning_open=False)
    assert accepts(schema, '{"o": {"k": "v", "extra": 1}, "more": 2}')


# ------------------------------------------------------------------ over HTTP: chat completions


def chat(server, choice, seed, max_tokens=80, **kw):
    body = {"model": NAME, "seed": seed, "max_tokens": max_tokens, "tool_choice": choice, "messages": ASK,
            "tools": CHAT_TOOLS, **kw}
    return server.post("/v1/chat/completions", body)


def chat_streamed(server, choice, seed, max_tokens=80):
    chunks = sse(chat(server, choice, seed, max_tokens, stream=True))
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return chunks, state.current_completion_snapshot


@pytest.mark.parametrize("choice", CHOICES["chat"])
@pytest.mark.parametrize("seed", SEEDS)
def test_chat_streams_a_forced_call_in_pieces_and_nothing_before_it(server, choice, seed):
    whole = chat(server, choice, seed).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    (call,) = whole["message"]["tool_calls"]
    assert set(json.loads(call["function"]["arguments"])) <= set(PARAMETERS["properties"])  # defect 4
    chunks, snapshot = chat_streamed(server, choice, seed)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert all(not d.get("content") for d in deltas)  # defect 1
    pieces = [tc for d in deltas for tc in d.get("tool_calls") or ()]
    assert pieces[0]["id"] and pieces[0]["type"] == "function" and pieces[0]["function"] == {
        "name": "list_files", "arguments": ""}
    assert all(set(p) == {"index", "function"} for p in pieces[1:])  # defect 2: then the arguments...
    assert len(pieces) > (3 if len(call["function"]["arguments"]) > 10 else 1)  # ...in pieces as generated
    message = snapshot.choices[0].message
    assert not message.content and snapshot.choices[0].finish_reason == "tool_calls"  # the role chunk: ""
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("list_files", call["function"]["arguments"])]


def cut_point(tokens: int, call_of) -> int:
    """The most max_tokens below the whole reply's `tokens` that cuts the call inside its
    arguments (call_of(max_tokens) -> the cut call's arguments, if some were written and
    they are not yet the whole call's)."""
    for max_tokens in range(tokens - 1, 0, -1):
        if call_of(max_tokens):
            return max_tokens
    raise AssertionError("no cut leaves a call with arguments")


@pytest.mark.parametrize("choice", CHOICES["chat"])
def test_chat_cut_call_is_a_call_with_the_arguments_so_far(server, choice):
    whole = chat(server, choice, 2).json()
    full = whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]

    def arguments(max_tokens):
        calls = chat(server, choice, 2, max_tokens).json()["choices"][0]["message"].get("tool_calls")
        return calls and calls[0]["function"]["arguments"] != full and calls[0]["function"]["arguments"]

    for max_tokens in (cut_point(whole["usage"]["completion_tokens"], arguments), 6):
        cut = chat(server, choice, 2, max_tokens).json()["choices"][0]
        assert cut["finish_reason"] == "length" and cut["message"]["content"] is None  # no markup as text
        calls = cut["message"].get("tool_calls") or []
        assert all(full.startswith(c["function"]["arguments"]) for c in calls)
        chunks, snapshot = chat_streamed(server, choice, 2, max_tokens)
        assert all(not c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])
        got = snapshot.choices[0]
        assert got.finish_reason == "length" and not got.message.content
        assert [c.function.arguments for c in got.message.tool_calls or ()] == [
            c["function"]["arguments"] for c in calls]


# ------------------------------------------------------------------ over HTTP: Anthropic Messages


@pytest.mark.parametrize("choice", CHOICES["anthropic"])
@pytest.mark.parametrize("eager", [False, True])
def test_anthropic_forced_and_cut_calls(server, choice, eager):
    sdk = anthropic_client(server)
    tools = [{**ANTHROPIC_TOOLS[0], "eager_input_streaming": True}] if eager else ANTHROPIC_TOOLS
    ask = {"model": NAME, "messages": [{"role": "user", "content": WEATHER_ASK}], "tools": tools,
           "tool_choice": choice, "extra_body": {"temperature": 0}}
    whole = sdk.messages.create(max_tokens=80, **ask)
    assert [b.type for b in whole.content] == ["tool_use"] and whole.stop_reason == "tool_use"
    assert set(whole.content[0].input) == set(WEATHER["properties"])

    def arguments(max_tokens):
        cut = sdk.messages.create(max_tokens=max_tokens, **ask)
        return [b.input for b in cut.content if b.type == "tool_use" and b.input != whole.content[0].input]

    for max_tokens in (80, cut_point(whole.usage.output_tokens, arguments), 6):
        reply = sdk.messages.create(max_tokens=max_tokens, **ask)
        assert all(b.type == "tool_use" for b in reply.content)  # never the markup as text
        assert reply.stop_reason == ("tool_use" if max_tokens == 80 else "max_tokens")
        with sdk.messages.stream(max_tokens=max_tokens, **ask) as stream:
            events = list(stream)
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in reply.content]
        assert final.stop_reason == reply.stop_reason
        pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
        assert all(e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta")
        if reply.content and (eager or max_tokens == 80):
            assert len(pieces) > (2 if eager else 0)
            assert from_json("".join(pieces).encode(), partial_mode=True) == reply.content[0].input


# ------------------------------------------------------------------ over HTTP: Responses


@pytest.mark.parametrize("choice", CHOICES["responses"])
def test_responses_stream_a_forced_call_in_pieces_and_a_cut_one_incomplete(server, choice):
    sdk = server.client()
    ask = {"model": NAME, "input": WEATHER_ASK, "tools": RESPONSES_TOOLS, "tool_choice": choice, "temperature": 0,
           "parallel_tool_calls": False}
    whole = sdk.responses.create(max_output_tokens=80, **ask)
    (item,) = whole.output
    assert item.type == "function_call" and whole.status == "completed"
    assert set(json.loads(item.arguments)) == set(WEATHER["properties"])

    def arguments(max_tokens):
        return [i.arguments for i in sdk.responses.create(max_output_tokens=max_tokens, **ask).output
                if i.type == "function_call" and i.arguments and i.arguments != item.arguments]

    for max_tokens in (80, cut_point(whole.usage.output_tokens, arguments), 6):
        reply = sdk.responses.create(max_output_tokens=max_tokens, **ask)
        assert all(i.type == "function_call" for i in reply.output)  # no output_text
        if max_tokens != 80:
            assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
            assert all(item.arguments.startswith(i.arguments) and i.status == "incomplete" for i in reply.output)
        with sdk.responses.stream(max_output_tokens=max_tokens, **ask) as stream:
            events = list(stream)
            # the SDK's helper ends at response.completed; a cut response ends at response.incomplete
            final = stream.get_final_response() if max_tokens == 80 else \
                [e for e in events if e.type == "response.incomplete"][0].response
        assert [(i.name, i.arguments, i.status) for i in final.output] == [
            (i.name, i.arguments, i.status) for i in reply.output]
        assert final.status == reply.status
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
        assert done == [i.arguments for i in reply.output] and ["".join(deltas)] == (done or [""])
        if max_tokens == 80:
            assert len(deltas) > 3
        assert not [e for e in events if e.type.startswith("response.output_text")]
