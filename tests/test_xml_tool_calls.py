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
