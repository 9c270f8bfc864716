"""Forced tool calls with the chat template Qwen3.5/3.6 checkpoints really ship
(tests/data/qwen3.5/chat_template.jinja, byte for byte), whose calls are XML:
`<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>`.
A tiny synthetic model at temperature 1 over several seeds: a value the grammar left free
would run off. References: the `jsonschema` package (with its format checker) on the parsed
arguments, the standard library's parsers for the formats it does not check, and the
official openai and anthropic SDKs on the wire."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import jsonschema
import pytest
from serving_rig import Server

from monolith.models import load_model
from monolith.pack import build_pack
from monolith.runtime.engine import Engine
from monolith.synth import write_target
from monolith.tokenizer import load_tokenizer

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
def xml_model(tmp_path_factory):
    """(model, tokenizer) of the tiny synthetic target with the real Qwen3.5 template."""
    root = tmp_path_factory.mktemp("xml")
    checkpoint = write_target(root / "ckpt")
    shutil.copyfile(TEMPLATE, checkpoint / "chat_template.jinja")
    pack = build_pack(checkpoint, root / "pack", role="target")
    return load_model(pack, dtype="float32"), load_tokenizer(pack)


@pytest.fixture(scope="module")
def server(xml_model):
    model, tok = xml_model
    with Server(lambda: Engine(model, tok, max_context=MAX_CONTEXT), model_names=(NAME,)) as s:
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
    "unit": {"type": "string", "const": "kg"},
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


def grammar_of(tools, tok, choice="required"):
    from monolith.serving import structured

    return structured.grammar(structured.tool_choice(choice, tools), tok, reasoning_open=False)


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
    from monolith.serving.tools import parse_tool_calls

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
