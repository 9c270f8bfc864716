"""Forced tool calls with the chat template Qwen3.5/3.6 checkpoints really ship
(tests/data/qwen3.5/chat_template.jinja, byte for byte), whose calls are XML:
`<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>`.
A tiny synthetic model at temperature 1 over several seeds: a value the grammar left free
would run off. References: the `jsonschema` package (with its format checker) on the parsed
arguments, the standard library's parsers for the formats it does not check, and the
official openai and anthropic SDKs on the wire."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import jsonschema
import pytest
from serving_rig import Server, assert_error

from monolith.runtime.engine import Engine, Limits

TEMPLATE = Path(__file__).parent / "data" / "qwen3.5" / "chat_template.jinja"
MAX_CONTEXT = 2048
NAME = "qwen-xml"
SEEDS = range(6)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MARKUP = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")

PAINT = {"type": "function", "function": {"name": "paint", "description": "Paint a wall", "parameters": {
    "type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "dark blue"]},
                                     "coats": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["color", "coats"]}}}


@pytest.fixture(scope="module")
def server(xml_model):
    model, tok = xml_model
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)), model_names=(NAME,)) as s:
        yield s.wait_ready()


def test_the_real_template_is_what_the_tokenizer_renders(xml_model):
    _, tok = xml_model
    assert tok.chat_template == TEMPLATE.read_text(encoding="utf-8")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], [PAINT], enable_thinking=False)
    assert "<function=example_function_name>" in prompt and prompt.endswith("<think>\n\n</think>\n\n")


def forced_calls(server, tools, choice, seed, max_tokens=200):
    reply = server.client().chat.completions.create(
        model=NAME, max_tokens=max_tokens, temperature=1, seed=seed, tools=tools, tool_choice=choice,
        messages=[{"role": "user", "content": "Go."}], extra_body=NO_THINKING)
    return reply.choices[0]


def assert_valid_calls(out, tools):
    """The reply is tool calls only, each valid for its tool's parameters."""
    assert out.finish_reason == "tool_calls", out
    assert not any(tag in (out.message.content or "") for tag in MARKUP), out.message.content
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in out.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name],
                            format_checker=jsonschema.FormatChecker())
    return [json.loads(call.function.arguments) for call in out.message.tool_calls]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "paint"}}])
def test_a_string_enum_parameter_keeps_its_enum(server, choice):
    for seed in SEEDS:
        for arguments in assert_valid_calls(forced_calls(server, [PAINT], choice, seed), [PAINT]):
            assert arguments["color"] in ("red", "green", "dark blue")


# ------------------------------------------------------------------ the grammar itself

SHOP = {"type": "function", "function": {"name": "order", "parameters": {"type": "object", "properties": {
    "color": {"type": "string", "enum": ["red", "dark blue", 7]},
    "unit": {"type": "string", "const": "kg", "enum": ["kg", "lb"]},
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"},
    "note": {"type": "string", "minLength": 2, "maxLength": 4},
    "free": {"type": "string"},
    "count": {"type": "integer", "minimum": 1, "maximum": 9},
    "tags": {"type": "array", "items": {"type": "integer"}}}, "required": ["color", "unit", "sku", "note"]}}}
GOOD = {"color": "dark blue", "unit": "kg", "sku": "ABC-12", "note": "héé", "free": "a <b>\n\nc </parameter d",
        "count": 3, "tags": [1, 2]}


@pytest.fixture(scope="module")
def gt(xml_model):
    from monolith.runtime.grammar import GrammarTokenizer

    model, tok = xml_model
    return GrammarTokenizer.of(tok, model.args.vocab_size)


def grammar_of(tools, tok, single=False):
    """The grammar of a forced call: tool_choice "required" (`single`: a named tool's)."""
    from monolith.serving import structured
    from monolith.serving.tools.specs import forced_calls

    return structured.grammar(forced_calls(tools, single=single), tok, reasoning_open=False)


def accepts(gt, tok, grammar, text) -> bool:
    """Whether the grammar takes `text` whole (tokenized as the model would write it) and
    may end there."""
    guide = gt.guide(grammar)
    for t in tok.encode(text, add_special_tokens=False):
        if not _allowed(guide.words(), t):
            return False
        guide.push(t)
    return _allowed(guide.words(), tok.eos_token_ids[0])


def _allowed(words, token) -> bool:
    return bool((int(words[token // 32]) >> (token % 32)) & 1)


def xml_call(name, arguments: dict) -> str:
    """A call as the real template renders one in the history (strings raw, the rest JSON)."""
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_the_helper_writes_what_the_template_renders(xml_model):
    _, tok = xml_model
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"type": "function", "function": {"name": "order", "arguments": GOOD}}]}]
    assert xml_call("order", GOOD) in tok.apply_chat_template(history, [SHOP])


def test_raw_text_keeps_its_schema_and_reads_back_exactly(xml_model, gt):
    from monolith.serving.tools.calls import parse_tool_calls

    _, tok = xml_model
    grammar = grammar_of([SHOP], tok)
    text = xml_call("order", GOOD)
    assert accepts(gt, tok, grammar, text)
    content, calls = parse_tool_calls(text, [SHOP])
    assert content is None and json.loads(calls[0].arguments) == GOOD
    for key, bad_value in [("color", "blue"), ("color", "7"), ("color", " red"), ("unit", "kg "),
                           ("sku", "ABC-1"), ("sku", "xABC-12"), ("sku", "ABC-123"), ("note", "a"),
                           ("note", "abcde"), ("count", 10), ("tags", ["1"])]:
        assert not accepts(gt, tok, grammar, xml_call("order", {**GOOD, key: bad_value})), (key, bad_value)


@pytest.mark.parametrize("tag", ["</parameter>", "</function>", "</tool_call>"])
def test_raw_text_never_holds_a_closing_tag(xml_model, gt, tag):
    _, tok = xml_model
    grammar = grammar_of([SHOP], tok)
    for free in (f"a{tag}b", tag, f"x\n{tag}"):
        assert not accepts(gt, tok, grammar, xml_call("order", {**GOOD, "free": free}))


def test_the_no_closing_tag_regex_is_exactly_the_texts_without_one():
    """Against `tag in text`, on random texts made of the tags' pieces (Python's re runs
    the same regex syntax)."""
    import random
    import re

    from monolith.serving.tools.xml_arguments import CLOSING_TAGS, _avoiding

    regex = re.compile(_avoiding(CLOSING_TAGS), re.DOTALL)
    pieces = ["<", "/", ">", "a", "\n", *(t[:i] for t in CLOSING_TAGS for i in range(1, len(t) + 1)),
              *(t[i:] for t in CLOSING_TAGS for i in range(1, len(t)))]
    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        assert bool(regex.fullmatch(text)) == (not any(tag in text for tag in CLOSING_TAGS)), text


def test_a_json_value_may_point_into_the_parameters_defs(xml_model, gt):
    _, tok = xml_model
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}},
                                              "required": ["x"], "additionalProperties": False}},
        "properties": {"v": {"$ref": "#/$defs/point"}}, "required": ["v"]}}}
    grammar = grammar_of([tool], tok)
    assert accepts(gt, tok, grammar, xml_call("f", {"v": {"x": 3}}))
    assert not accepts(gt, tok, grammar, xml_call("f", {"v": {"y": 3}}))


def test_long_bounded_text_with_markup_in_it(xml_model, gt):
    """A long maxLength next to the closing-tag rule (a negation with a count exhausted
    llguidance's lexer at 60 characters: the matcher failed mid-generation)."""
    _, tok = xml_model
    grammar = grammar_of([one_parameter({"type": "string", "maxLength": 5000})], tok)
    text = "<div>a</div> </param <parameter=x> </tool_call </functio>\n" * 60
    assert accepts(gt, tok, grammar, xml_call("f", {"v": text[:4990]}))
    assert not accepts(gt, tok, grammar, xml_call("f", {"v": text[:4990] + "</function>"}))
    assert not accepts(gt, tok, grammar, xml_call("f", {"v": "x" * 5001}))


def test_json_values_and_json_calls_keep_whitespace_to_one_blank_per_gap(xml_model, gt, demo_f32):
    from monolith.runtime.grammar import GrammarTokenizer

    _, tok = xml_model
    grammar = grammar_of([SHOP], tok)
    head = xml_call("order", {k: GOOD[k] for k in ("color", "unit", "sku", "note")}).removesuffix(
        "</function>\n</tool_call>")

    def with_tags(tags: str) -> str:
        return f"{head}<parameter=tags>\n{tags}\n</parameter>\n</function>\n</tool_call>"

    for tags in ("[1, 2]", "[1,2]", "[\n1,\n2\n]", "[ 1 , 2 ]"):
        assert accepts(gt, tok, grammar, with_tags(tags)), tags
    for tags in ("[1,  2]", "[1,\n  2]", "[1,\t2]", "[1, \n2]", "[\n\n1]"):
        assert not accepts(gt, tok, grammar, with_tags(tags)), tags
    # the Qwen3 JSON format (the demo pair's template)
    model, _, demo_tok = demo_f32
    demo_gt = GrammarTokenizer.of(demo_tok, model.args.vocab_size)
    json_grammar = grammar_of([SHOP], demo_tok)
    call = {"name": "order", "arguments": {k: GOOD[k] for k in ("color", "unit", "sku", "note", "tags")}}
    for form in ({}, {"separators": (",", ":")}, {"indent": 0}):
        text = json.dumps(call, ensure_ascii=False, **form)
        assert accepts(demo_gt, demo_tok, json_grammar, f"<tool_call>\n{text}\n</tool_call>"), text
    for form in ({"indent": 1}, {"separators": (",  ", ": ")}, {"separators": (",\t", ": ")}):
        text = json.dumps(call, ensure_ascii=False, **form)
        assert not accepts(demo_gt, demo_tok, json_grammar, f"<tool_call>\n{text}\n</tool_call>"), text


# ------------------------------------------------------------------ formats

FORMAT_EXAMPLES = {
    "date": (["2024-02-29", "2000-02-29", "0001-01-31", "9999-12-31", "2023-04-30"],
             ["2023-02-29", "1900-02-29", "0000-01-01", "2024-04-31", "2024-13-01", "2024-1-01", "20240101"]),
    "time": (["23:59:59Z", "00:00:00.123456789+14:00", "12:30:00-05:30"],
             ["24:00:00Z", "23:59:60Z", "12:00:00", "12:00Z", "12:00:00.Z", "12:00:00.1234567890Z",
              "12:00:00z"]),
    "date-time": (["2024-02-29T12:00:00Z", "1999-12-31T23:59:59.5+01:00"],
                  ["2024-02-29 12:00:00Z", "2023-02-29T12:00:00Z", "2024-02-29T12:00:00"]),
    "duration": (["P1Y2M3DT4H5M6S", "PT1S", "P1W", "P3D", "PT2H30M", "P1M"],
                 ["P", "PT", "P1Y1W", "P1S", "P1H", "PT1D", "P1.5Y"]),
    "email": (["a.b+c@example.com", "x@localhost", "!#$%&'*+/=?^_`{|}~-@a-b.c"],
              ["a@@b", "@b.c", "a@", "a..b@c", ".a@b", "a@-b.c", "a b@c", "é@c.d", f"{'a' * 65}@b.c"]),
    "hostname": (["example.com", "a", "a-b.c0", "xn--bcher-kva.example", f"{'a' * 63}.b"],
                 ["-a.com", "a-.com", "a..b", "a.b.", "a_b.com", f"{'a' * 64}.b", ".".join(["a" * 63] * 4) + ".ab"]),
    "ipv4": (["0.0.0.0", "255.255.255.255", "192.168.1.10"],
             ["256.0.0.1", "01.2.3.4", "1.2.3", "1.2.3.4.5", "1.2.3.-4"]),
    "ipv6": (["::", "::1", "1::", "1:2:3:4:5:6:7:8", "1::8", "::ffff:1.2.3.4", "1:2:3:4:5:6:1.2.3.4", "FE80::aB"],
             ["1:2:3:4:5:6:7:8:9", "1::2::3", ":::", "fe80::1%eth0", "12345::", "1:2:3:4:5:6:7:1.2.3.4", "1:2"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000", "123E4567-E89B-12D3-A456-426614174000"],
             ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400", "g23e4567-e89b-12d3-a456-426614174000"]),
    "uri": (["https://example.com/a/b?c=d&e#f", "mailto:x@y.z", "urn:isbn:0451450523", "http://u:p@h:80/", "a:",
             "x:%41", "file:///etc/hosts"],
            ["no scheme", "1http://x", "http://a:b", "http://a b", "http://%zz", "//host/path", "http://a/<b>"]),
}


def one_parameter(schema) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": schema}, "required": ["v"]}}}


def named(tool) -> dict:
    return {"type": "function", "function": {"name": tool["function"]["name"]}}


@pytest.mark.parametrize("name", sorted(FORMAT_EXAMPLES))
def test_format_examples(xml_model, gt, name):
    _, tok = xml_model
    tool = one_parameter({"type": "string", "format": name})
    grammar = grammar_of([tool], tok, single=True)
    good, bad = FORMAT_EXAMPLES[name]
    for value in good:
        assert accepts(gt, tok, grammar, xml_call("f", {"v": value})), value
    for value in bad:
        assert not accepts(gt, tok, grammar, xml_call("f", {"v": value})), value


def format_ok(name: str, value: str) -> bool:
    """The standard library's (and jsonschema's) judgement of `value` as a `name`."""
    import datetime
    import urllib.parse

    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    if name in ("date", "email", "ipv4", "ipv6", "uuid"):
        return checker.conforms(value, name) and (name != "email" or host_ok(value.rsplit("@", 1)[1]))
    if name in ("date-time", "time"):
        moment = datetime.datetime.fromisoformat(value if name == "date-time" else "2000-01-01T" + value)
        return moment.tzinfo is not None
    if name == "hostname":
        return host_ok(value)
    if name == "uri":
        parts = urllib.parse.urlsplit(value)
        return bool(parts.scheme) and value.isascii() and " " not in value and (parts.port or 0) >= 0
    return value.startswith("P") and value[-1] in "YMWDHS"  # duration: the examples above check the rest


def host_ok(host: str) -> bool:
    labels = host.split(".")
    return len(host) <= 253 and all(
        0 < len(label) <= 63 and label.isascii() and label.replace("-", "").isalnum()
        and not label.startswith("-") and not label.endswith("-") for label in labels)


def random_text(gt, tok, grammar, rng, steps=300) -> str | None:
    """What the grammar lets through when every token is drawn uniformly among the allowed
    ones (a path a free model may take), or None if it has not ended after `steps`."""
    import numpy as np

    guide, out, eos = gt.guide(grammar), [], tok.eos_token_ids[0]
    for _ in range(steps):
        words = guide.words()
        ids = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:gt.width])
        if eos in ids:
            return tok.decode(out)
        token = int(rng.choice(ids))
        guide.push(token)
        out.append(token)
    return None


@pytest.mark.parametrize("name", sorted(FORMAT_EXAMPLES))
def test_random_paths_through_a_format_are_valid(xml_model, gt, name):
    import numpy as np

    from monolith.serving.tools.calls import parse_tool_calls

    _, tok = xml_model
    tool = one_parameter({"type": "string", "format": name})
    grammar = grammar_of([tool], tok, single=True)
    rng = np.random.default_rng(0)
    texts = [random_text(gt, tok, grammar, rng) for _ in range(40)]
    ended = [t for t in texts if t is not None]
    assert len(ended) >= 30
    for text in ended:
        content, calls = parse_tool_calls(text, [tool])
        assert content is None and len(calls) == 1, text
        value = json.loads(calls[0].arguments)["v"]
        assert format_ok(name, value), (name, value)


# ------------------------------------------------------------------ over HTTP

FORMS = {"type": "function", "function": {"name": "book", "description": "Book a slot", "parameters": {
    "type": "object", "properties": {
        "size": {"type": "string", "enum": ["S", "M", "L"]},
        "code": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
        "label": {"type": "string", "minLength": 1, "maxLength": 6},
        "day": {"type": "string", "format": "date"},
        "at": {"type": "string", "format": "date-time"},
        "host": {"type": "string", "format": "ipv4"},
        "ref": {"type": "string", "format": "uuid"},
        "seats": {"type": "integer", "minimum": 1, "maximum": 4}},
    "required": ["size", "code", "label", "day", "at", "host", "ref", "seats"]}}}


def test_every_kind_of_string_constraint_holds_over_seeds(server):
    for choice in ("required", named(FORMS)):
        for seed in SEEDS:
            for arguments in assert_valid_calls(forced_calls(server, [FORMS], choice, seed, max_tokens=400),
                                                [FORMS]):
                assert format_ok("date-time", arguments["at"]), arguments


def test_through_the_anthropic_endpoint(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (PAINT, FORMS)]
    for _ in range(3):  # the Messages API has no seed: whatever the draw, the calls hold
        reply = client.messages.create(model=NAME, max_tokens=400, tools=tools, tool_choice={"type": "any"},
                                       thinking={"type": "disabled"}, extra_body={"temperature": 1},
                                       messages=[{"role": "user", "content": "Go."}])
        assert reply.stop_reason == "tool_use", reply
        assert reply.content and all(block.type == "tool_use" for block in reply.content), reply.content
        schemas = {t["name"]: t["input_schema"] for t in tools}
        for block in reply.content:
            jsonschema.validate(block.input, schemas[block.name],
                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_an_eager_xml_call_streams_its_input_parameter_by_parameter(server):
    """tools[].eager_input_streaming with the real template's XML calls: the tool_use
    block opens when the call names its function, and its input_json_delta pieces (one
    a parameter as it closes) add up to the input the non-streamed call parses."""
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    tool = {"name": FORMS["function"]["name"], "input_schema": FORMS["function"]["parameters"],
            "eager_input_streaming": True}
    # greedy, so the pieces are the same every run (sampled without a seed, the count once fell short)
    with client.messages.stream(model=NAME, max_tokens=400, tools=[tool], thinking={"type": "disabled"},
                                tool_choice={"type": "tool", "name": tool["name"]}, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Go."}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert len(pieces) >= len(tool["input_schema"]["required"])  # at least one a parameter
    assert json.loads("".join(pieces)) == final.content[0].input
    jsonschema.validate(final.content[0].input, tool["input_schema"],
                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


@pytest.mark.parametrize("schema, named_in_message", [
    ({"type": "string", "format": "color"}, "parameters.properties.v.format 'color' is not supported"),
    ({"type": "string", "anyOf": [{"maxLength": 2}]}, "parameters.properties.v.anyOf"),
    ({"type": "string", "pattern": "(?=a)b"}, "parameters.properties.v.pattern"),
    ({"type": "string", "enum": [1, "</parameter>"]}, "parameters.properties.v.enum"),
    ({"type": "string", "const": "c", "enum": ["a", "b"]}, "parameters.properties.v.const"),
    ({"type": "string", "maxLength": -1}, "parameters.properties.v.maxLength"),
])
def test_a_string_constraint_raw_text_cannot_honour_is_a_400_naming_it(server, schema, named_in_message):
    response = server.post("/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": [one_parameter(schema)],
        "tool_choice": "required", **NO_THINKING})
    error = assert_error(response, 400, param="tools")
    assert "tool 'f'" in error["message"] and named_in_message in error["message"], error


@pytest.mark.parametrize("name, key", [("f>", "v"), ("f", "a>b"), ("f", " v"), ("f", "a\nb")])
def test_names_a_tag_cannot_carry_are_a_400(server, name, key):
    tool = {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {key: {"type": "integer"}}}}}
    response = server.post("/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required",
        **NO_THINKING})
    assert "cannot be written" in assert_error(response, 400, param="tools")["message"]
