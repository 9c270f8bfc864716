"""Structured output: `response_format` and a forcing `tool_choice` (its Structure:
tools.specs.forced_calls) -> a grammar (runtime.grammar).

- `{"type": "json_object"}`: any JSON object; `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict", "description"}}`: an instance of the schema (enforced
  whatever `strict` says). llguidance compiles the schema; a keyword it does not
  implement is refused with a 400 naming it (its compiler is not lenient), never ignored.
- `tool_choice: "required"`: one or more tool calls, each to one of the tools with
  arguments valid for its `parameters`; a named function: one call to it. The calls are
  written in the chat template's own format: Qwen3's `<tool_call>{"name": ..,
  "arguments": ..}</tool_call>`, or, when the template writes `<function=`, Qwen3.5/3.6's
  `<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>`
  (parameters in the schema's order, optional ones may be left out). A string
  parameter's value is raw text that keeps its schema (`enum`, `const`, `pattern`,
  `minLength` / `maxLength`, `format`: serving/tools/xml_arguments.py) and can never hold a closing
  tag; other values are JSON. serving/tools/calls.py reads both back as written
  (`xml_arguments.is_raw_text` decides which, for both).

Whitespace between JSON tokens is bounded: unbounded whitespace lets a weak model loop
on it until max_tokens. In `response_format` JSON each gap allows one space, or a newline
and up to 20 blanks of indentation (llama.cpp's JSON grammars bound it the same way). In
forced tool calls (the JSON call and the XML format's JSON values) each gap allows at
most one blank, a space or a newline, and nothing more: the one-line form the templates
write (`{"a": 1, "b": [2, 3]}`) and an unindented one per line, at most one character
per gap. (On the demo pair, greedy: with no newline allowed, its `required` calls
repeated until max_tokens on 5 prompts of 5; a named call took 49-53 tokens with the
response_format bound, 45-48 with this one.) The output may begin with up to 4 blanks.
When the prompt leaves Qwen's reasoning open, the constraint starts after the
`</think>` token: the model reasons freely first.

- `tool_choice: "auto"` (or unset) with tools (`calls_once_opened`): nothing is
  constrained until the model writes the template's `<tool_call>` token; from there the
  output is a call to one of the tools with valid arguments, as a forced call's, then
  more calls or the end of the turn. The model decides whether to call and which tool;
  it cannot name a tool it was not offered or write arguments its schema refuses (a
  weak model otherwise invents both). llama.cpp's lazy grammars constrain "auto" the same
  way; vLLM leaves its calls unconstrained. A tool set llguidance cannot compile leaves
  the calls unconstrained (logged), instead of refusing a request that forces nothing.

In a forced call's arguments an object schema that lists `properties` and does not say
`additionalProperties` admits no other keys (`closed`), as vLLM's default grammar reads
it: instructor's and LangChain's schemas leave it unsaid and mean no others.
`response_format` schemas keep JSON Schema's meaning (unsaid: any other key).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from ..runtime.grammar import Grammar, GrammarError
from .errors import APIError, bad
from .fields import refuse_extra
from .tools import xml_arguments

WHITESPACE = r"(?:\n[ \t]{0,20}| )?"
CALL_WHITESPACE = r"[ \n]?"
LEADING = r"/[ \t\r\n]{0,4}/"
log = logging.getLogger("monolith.serve")
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
THINK_END = "</think>"
OPEN = "<tool_call>"  # the chat templates' opening tag of a call


@dataclass(frozen=True)
class Structure:
    """What the output must be: "json" (an instance of `schema`) or "tools" (calls to
    `tools`, at least one; `single`: exactly one)."""

    kind: str
    param: str  # the request field it came from, for errors
    schema: dict | None = None
    tools: tuple = ()
    single: bool = False
    grammars: tuple = ()  # (tool name, Lark grammar): a tool whose one string, `input`, is in that grammar
    lazy: bool = False  # tool_choice "auto": free until the model opens a call, which is then constrained


def response_format(value) -> Structure | None:
    """The Structure a `response_format` asks for (None: plain text)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("response_format must be an object like {\"type\": \"json_schema\", ...}", "response_format")
    kind = value.get("type", "text")
    refuse_extra(value, {"type", "json_schema"}, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structure("json", "response_format", {"type": "object"})
    if kind != "json_schema":
        raise bad(f"response_format.type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}",
                  "response_format.type")
    spec = value.get("json_schema")
    at = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad(f"{at} must be an object with a \"schema\"", at)
    refuse_extra(spec, JSON_SCHEMA_KEYS, at)
    schema = spec.get("schema")
    if not isinstance(schema, dict) and not isinstance(schema, bool):
        raise bad(f"{at}.schema must be a JSON schema (an object)", f"{at}.schema")
    for key, kind in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise bad(f"{at}.{key} must be a {kind.__name__}", f"{at}.{key}")
    return Structure("json", f"{at}.schema", schema)


def grammar(structure: Structure, tokenizer, reasoning_open: bool) -> Grammar:
    """The Grammar for `structure` with the model's tokenizer (monolith.tokenizer):
    Lark text for llguidance (with a custom tool's Lark grammar: llguidance's JSON list of
    grammars, the calls' first). Compile errors surface in `check`."""
    grammars = {name: (f"custom_{i}", lark) for i, (name, lark) in enumerate(structure.grammars)}
    if structure.kind == "json":
        body = _json(structure.schema)
    else:
        xml = "<function=" in (tokenizer.chat_template or "")
        if grammars and not xml:
            raise bad(f"the custom tool {next(iter(grammars))!r} has a Lark grammar, which can constrain its input "
                      "only in XML tool calls (Qwen3.5/3.6's template); this model's template writes JSON calls",
                      "tool_choice")
        functions = [{**tool["function"], "parameters": closed(tool["function"].get("parameters"))}
                     for tool in structure.tools]
        calls = [_xml_call(fn, i, tokenizer, grammars) if xml else _json_call(fn, i, tokenizer)
                 for i, fn in enumerate(functions)]
        rules = "\n".join(rule for _, rule in calls)
        names = " | ".join(name for name, _ in calls)
        repeat = "" if structure.single else ' ("\\n" call)*'
        first = " | ".join(f"body_{i}" for i in range(len(calls))) if structure.lazy else "call"
        body = f"({first}){repeat}\ncall: {names}\n{rules}"
    if structure.lazy:  # the grammar starts after the call's opening token, which the model chose
        text, starts_after = f"start: {body}", tokenizer.token_to_id(OPEN)
    else:
        text = f"start: {LEADING} {body}"
        starts_after = tokenizer.token_to_id(THINK_END) if reasoning_open else None
    if grammars:  # llguidance's list of grammars: the calls, then each custom tool's (`@custom_N`)
        subs = [{"name": sub, "lark_grammar": lark} for sub, lark in grammars.values()]
        text = json.dumps({"grammars": [{"lark_grammar": text}, *subs]})
    return Grammar(text, starts_after)


def calls_once_opened(tools, tokenizer) -> Structure | None:
    """tool_choice "auto" (or unset) with tools: the model answers or calls as it likes, and
    a call it opens (its template's `<tool_call>` token) is a call to one of `tools` with
    valid arguments, as a forced call is; more calls may follow it, then the turn ends.
    llama.cpp constrains "auto" calls the same way (its lazy grammars); vLLM parses them
    unconstrained. None where the vocabulary has no single opening token."""
    if not tools or tokenizer.token_to_id(OPEN) is None:
        return None
    return Structure("tools", "tools", tools=tuple(tools), lazy=True)


def constraint(structure: Structure | None, engine, reasoning_open: bool) -> Grammar | None:
    """The checked Grammar of `structure` for the engine's model (None: no structure). A
    forced structure llguidance refuses is a 400 naming the field; the calls of tool_choice
    "auto" it cannot build are left unconstrained, as before the model opens one (a tool's
    schema that no forced call could take does not refuse a request that forces nothing)."""
    if structure is None:
        return None
    try:
        built = grammar(structure, engine.tokenizer, reasoning_open)
        check(structure, built, grammar_tokenizer(engine))
    except APIError as e:
        if not structure.lazy or e.status >= 500:
            raise
        log.info("tool calls left unconstrained: %s", e.message)
        return None
    return built


def grammar_tokenizer(engine):
    """The engine's llguidance tokenizer (a 500 if llguidance cannot read the tokenizer)."""
    try:
        return engine.grammar_tokenizer
    except Exception as e:  # noqa: BLE001 - llguidance refused the tokenizer
        raise APIError(500, f"structured output is unavailable: llguidance cannot read this tokenizer: {e}",
                       "response_format") from None


def check(structure: Structure, grammar_: Grammar, grammar_tokenizer) -> None:
    """A 400 naming what llguidance refuses (e.g. an unimplemented schema keyword)."""
    try:
        grammar_tokenizer.check(grammar_)
    except GrammarError as e:
        raise APIError(400, f"{structure.param}: not supported: {_short(str(e))}", structure.param) from None


def _short(message: str) -> str:
    """llguidance's message without the grammar listing it appends (lines with "|")."""
    lines = [line.strip() for line in message.strip().splitlines()[:6] if "|" not in line and line.strip()]
    return " ".join(lines)[:500] or "the grammar is invalid"


def _json(schema, whitespace: str = WHITESPACE, param: str = "response_format") -> str:
    if schema is True:
        schema = {}
    if isinstance(schema, dict):
        if "x-guidance" in schema:  # llguidance's options (e.g. "lenient" would drop keywords silently)
            raise bad("the schema may not set x-guidance (llguidance's compiler options)", param)
        schema = {**schema, "x-guidance": {"whitespace_pattern": whitespace}}
    try:
        return "%json " + json.dumps(schema)
    except RecursionError:
        raise bad("the schema is nested too deeply", param) from None


def _tag(tokenizer, text: str) -> str:
    """A tag as its single token when the vocabulary has one (Qwen's tags are), else text."""
    token = tokenizer.token_to_id(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def _json_call(fn: dict, index: int, tokenizer) -> tuple[str, str]:
    schema = {"type": "object", "properties": {"name": {"const": fn["name"]},
                                               "arguments": fn.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
    body = _json(schema, CALL_WHITESPACE, "tools")
    rule = (f"call_{index}: {_tag(tokenizer, OPEN)} body_{index}\n"
            f"body_{index}: \"\\n\" {body} \"\\n\" {_tag(tokenizer, '</tool_call>')}")
    return f"call_{index}", rule


def _xml_call(fn: dict, index: int, tokenizer, grammars: dict) -> tuple[str, str]:
    parameters = fn.get("parameters") or {}
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise bad(f"tool {fn['name']!r}: parameters.properties must be an object and parameters.required a list",
                  "tools")
    _check_tag_name(fn["name"], f"tool {fn['name']!r}: the name")
    definitions = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    parts, rules = [], []
    for j, (key, schema) in enumerate(properties.items()):
        where = f"tool {fn['name']!r}: parameters.properties.{key}"
        _check_tag_name(key, where)
        name = f"param_{index}_{j}"
        if fn["name"] in grammars and key == "input":  # a custom tool's input: its own grammar, raw
            value = f'@{grammars[fn["name"]][0]} "\\n</parameter>\\n"'
        elif xml_arguments.is_raw_text(schema):  # the text and its closing tag, one lexeme (below)
            value = name.upper()
            rules.append(f'{value}: ({xml_arguments.lexeme(schema, where)}) "\\n</parameter>\\n"')
        else:
            value = f'{_json(_with(schema, definitions), CALL_WHITESPACE, "tools")} "\\n</parameter>\\n"'
        rules.append(f"{name}: {json.dumps(f'<parameter={key}>')} \"\\n\" {value}")
        parts.append(name if key in required else f"{name}?")
    head = json.dumps(f"\n<function={fn['name']}>\n")
    rule = (f"call_{index}: {_tag(tokenizer, OPEN)} body_{index}\n"
            f"body_{index}: {head} {' '.join(parts)} \"</function>\\n\" {_tag(tokenizer, '</tool_call>')}")
    # a lexeme is matched longest-first, so a raw text's closing tag is in its lexeme: text
    # then a separate tag would swallow it
    return f"call_{index}", "\n".join([rule, *rules])


SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "additionalProperties", "contains", "not", "if", "then",
              "else", "anyOf", "oneOf", "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def closed(schema, close: bool = True):
    """A tool's parameter schema for its call's grammar: every object schema that lists
    `properties` and does not say `additionalProperties` gets `additionalProperties:
    false` (vLLM's default grammar does the same), so a forced call cannot invent keys;
    schemas that do say it keep it. Members of an `allOf` are not closed themselves (each
    would forbid the others' keys), their own subschemas are. `response_format` schemas
    keep JSON Schema's meaning (open)."""
    if isinstance(schema, list):
        return [closed(member, close) for member in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed(member) for name, member in value.items()}
        elif key in SUBSCHEMAS:
            out[key] = closed(value)
        elif key == "allOf":
            out[key] = closed(value, close=False)
        else:
            out[key] = value
    if close and isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _with(schema, definitions: dict):
    """A parameter's schema with the parameters' `$defs` its `$ref`s point into."""
    return {**definitions, **schema} if isinstance(schema, dict) and definitions else schema


def _check_tag_name(name: str, where: str) -> None:
    """A name as a tag writes it (`<function=NAME>`, `<parameter=NAME>`) and tools/calls.py reads
    it back: no `>` or newline, no blank at either end."""
    if not isinstance(name, str) or not name or name != name.strip() or ">" in name or "\n" in name:
        raise bad(f"{where} {name!r} cannot be written in the chat template's XML tool calls "
                  "(empty, '>', a newline, or blanks at an end)", "tools")
