"""Hypothesis strategies for every API's request bodies, built from published schemas,
not from our parsers: the Open Responses OpenAPI document (tests/data/openresponses) for
POST /v1/responses and /v1/responses/compact, and the official SDKs' own request types
(the `openai` and `anthropic` packages' TypedDicts) for chat, completions, Messages,
count_tokens and input_tokens, turned into JSON schemas (`sdk_document`).

`bodies(endpoint)` draws a body the schema describes (a few fields pinned so that some
bodies get past the model check: `pinned`), and half of the time puts a value of another
JSON type at one of its paths (`wrong_type_at_a_path`): (body, the path changed or None).
`names_a_path` says whether an error reply names a path, in each API's own shape.
Used by tests/test_request_fuzz.py (a few seconds) and bench/schema_fuzz.py (>= 10,000)."""

from __future__ import annotations

import collections.abc
import json
import re
import types
import typing
from functools import cache
from pathlib import Path

import typing_extensions
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
OPENRESPONSES = ROOT / "tests/data/openresponses/openapi.json"
MAX_DEPTH = 6  # nesting past this is cut short (recursive schemas)
FEW = 3  # optional fields in one object, at most
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
SCALARS = st.none() | st.booleans() | st.integers(-3, 40) | st.floats(-2, 4, allow_nan=False) | TEXT
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")


def _sdk_types() -> dict:
    """Endpoint -> the SDK's request TypedDict."""
    from anthropic.types import message_count_tokens_params, message_create_params
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params
    from openai.types.responses import input_token_count_params
    return {"/v1/chat/completions": chat_params.CompletionCreateParamsNonStreaming,
            "/v1/completions": completion_create_params.CompletionCreateParamsNonStreaming,
            "/v1/messages": message_create_params.MessageCreateParamsNonStreaming,
            "/v1/messages/count_tokens": message_count_tokens_params.MessageCountTokensParams,
            "/v1/responses/input_tokens": input_token_count_params.InputTokenCountParams}


SPEC_BODIES = {"/v1/responses": "CreateResponseBody", "/v1/responses/compact": "CompactResponseMethodPublicBody"}
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/responses", "/v1/responses/compact", "/v1/responses/input_tokens")


# ------------------------------------------------------------------ SDK types -> JSON schema


def _unwrap(tp):
    """(the type under Required / NotRequired / Annotated, the wire name an Annotated alias gives)."""
    alias = None
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            alias = next((m.alias for m in tp.__metadata__ if getattr(m, "alias", None)), alias)
            tp = tp.__origin__
        elif origin in (typing.Required, typing.NotRequired, typing_extensions.Required, typing_extensions.NotRequired):
            tp = typing.get_args(tp)[0]
        else:
            return tp, alias


def _type_schema(tp, schemas: dict) -> dict:
    """A Python annotation as a JSON schema; TypedDicts go into `schemas` by name ($ref)."""
    tp, _ = _unwrap(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if typing_extensions.is_typeddict(tp):
        name = f"{tp.__module__}.{tp.__qualname__}"
        if name not in schemas:
            schemas[name] = {}  # taken before its fields, so that a recursive type ends
            schemas[name].update(_typeddict_schema(tp, schemas))
        return {"$ref": f"#/components/schemas/{name}"}
    if origin in (typing.Literal, typing_extensions.Literal):
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_type_schema(a, schemas) for a in args]}
    if tp is type(None):
        return {"type": "null"}
    simple = {str: "string", bool: "boolean", int: "integer", float: "number"}
    if tp in simple:
        return {"type": simple[tp]}
    if origin in (list, tuple, set, collections.abc.Iterable, collections.abc.Sequence):
        return {"type": "array", "items": _type_schema(args[0], schemas) if args else {}}
    if origin in (dict, collections.abc.Mapping):
        return {"type": "object", "additionalProperties": _type_schema(args[1], schemas) if args else {}}
    return {}  # object, IO[bytes], PathLike, ...: any JSON value


def _required(annotation, total: bool) -> bool:
    """Required[...] marks a required key, NotRequired[...] an optional one (the SDKs'
    string annotations leave __required_keys__ empty), else the TypedDict's totality."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _required(annotation.__origin__, total)
    if origin in (typing.Required, typing_extensions.Required):
        return True
    return total and origin not in (typing.NotRequired, typing_extensions.NotRequired)


def _typeddict_schema(tp, schemas: dict) -> dict:
    hints = typing.get_type_hints(tp, include_extras=True)
    properties, required = {}, []
    for key, annotation in hints.items():
        wire = _unwrap(annotation)[1] or key
        properties[wire] = _type_schema(annotation, schemas)
        if _required(annotation, key in tp.__required_keys__):
            required.append(wire)
    return {"type": "object", "properties": properties, "required": required}


@cache
def sdk_document(endpoint: str) -> dict:
    """The SDK's request type of `endpoint` as an OpenAPI-like document: {"root": schema,
    "components": {"schemas": {...}}}."""
    schemas: dict = {}
    root = _type_schema(_sdk_types()[endpoint], schemas)
    return {"root": root, "components": {"schemas": schemas}}


@cache
def spec_document(endpoint: str) -> dict:
    document = json.loads(OPENRESPONSES.read_text())
    return {"root": {"$ref": f"#/components/schemas/{SPEC_BODIES[endpoint]}"}, **document}


def document(endpoint: str) -> dict:
    return spec_document(endpoint) if endpoint in SPEC_BODIES else sdk_document(endpoint)


# ------------------------------------------------------------------ JSON schema -> strategy


class Builder:
    """Strategies for the schemas of one document (its "#/components/schemas/..." refs)."""

    def __init__(self, doc: dict):
        self.doc = doc
        self.refs: dict = {}

    def resolve(self, schema: dict) -> dict:
        while "$ref" in schema:
            schema = self.doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def of(self, schema, depth: int = 0, pinned: dict | None = None):
        if not isinstance(schema, dict):
            return ANY_JSON
        if "$ref" in schema:
            key = (schema["$ref"], min(depth, MAX_DEPTH + 1))
            if key not in self.refs:
                self.refs[key] = st.deferred(lambda: self.of(self.resolve(schema), depth, pinned))
            return self.refs[key]
        if depth > MAX_DEPTH:
            return SCALARS
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        for word in ("anyOf", "oneOf"):
            if word in schema:
                return st.one_of([self.of(s, depth, pinned) for s in schema[word]])
        if "allOf" in schema:
            return self.of(self.merged(schema), depth, pinned)
        kind = schema.get("type")
        if isinstance(kind, list):
            return st.one_of([self.of({**schema, "type": k}, depth, pinned) for k in kind])
        return self.typed(schema, kind, depth, pinned)

    def merged(self, schema: dict) -> dict:
        out: dict = {"properties": {}, "required": []}
        for part in [self.resolve(s) for s in schema["allOf"]] + [{k: v for k, v in schema.items() if k != "allOf"}]:
            if "allOf" in part:
                part = self.merged(part)
            out["properties"].update(part.get("properties", {}))
            out["required"] += part.get("required", [])
            out.update({k: v for k, v in part.items() if k not in ("properties", "required")})
        return out if out["properties"] else {k: v for k, v in out.items() if k not in ("properties", "required")}

    def typed(self, schema: dict, kind, depth: int, pinned: dict | None):
        if kind == "object" or "properties" in schema:
            return self.object(schema, depth, pinned)
        if kind == "array":
            least = min(schema.get("minItems", 0), 2)
            return st.lists(self.of(schema.get("items", {}), depth + 1), min_size=least, max_size=max(least, 3))
        if kind == "string":
            return TEXT
        if kind == "integer":
            return st.integers(max(schema.get("minimum", -3), -3), min(schema.get("maximum", 40), 40))
        if kind == "number":
            return st.floats(max(schema.get("minimum", -2), -2), min(schema.get("maximum", 4), 4), allow_nan=False)
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        return ANY_JSON

    def object(self, schema: dict, depth: int, pinned: dict | None):
        properties = schema.get("properties", {})
        if not properties:
            extra = schema.get("additionalProperties", {})
            return st.dictionaries(TEXT, self.of(extra if isinstance(extra, dict) else {}, depth + 1), max_size=3)
        pinned = pinned or {}
        strategies = {name: pinned[name] | self.of(s, depth + 1) if name in pinned else self.of(s, depth + 1)
                      for name, s in properties.items()}
        required = set(schema.get("required", ())) | set(pinned)
        optional = sorted(set(strategies) - required)
        # a few optional fields at a time: with all of them, nearly every body would stop
        # at its first unsupported field, and nothing deeper would be reached
        return st.tuples(st.fixed_dictionaries({k: v for k, v in strategies.items() if k in required}),
                         st.lists(st.sampled_from(optional), max_size=FEW, unique=True).flatmap(
                             lambda names: st.fixed_dictionaries({k: strategies[k] for k in names}))
                         if optional else st.just({})).map(lambda parts: {**parts[0], **parts[1]})


# ------------------------------------------------------------------ bodies, wrong types


def pinned(model: str) -> dict:
    """Fields drawn from a few good values more often than from the schema: the served
    model (else nearly every body is a 404), short replies and user turns."""
    small = st.integers(1, 3)
    user = st.fixed_dictionaries({"role": st.just("user"), "content": st.just("hi") | TEXT})
    return {"model": st.just(model), "max_tokens": small, "max_completion_tokens": small,
            "max_output_tokens": small, "messages": st.lists(user, min_size=1, max_size=2),
            "input": st.just("hi"), "prompt": st.just("hi")}


def json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "number", float: "number", str: "string", list: "array", dict: "object"}[type(value)]


OF_TYPE = {"null": st.none(), "boolean": st.booleans(), "number": st.integers(-2, 2**40) | st.floats(allow_nan=False,
           allow_infinity=False), "string": TEXT, "array": st.lists(SCALARS, max_size=2),
           "object": st.dictionaries(TEXT, SCALARS, max_size=2) | st.just({"type": {"x": 1}})}


def paths(value, path=()) -> list[tuple]:
    """Every path below `value` (keys and indices)."""
    found = []
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        found.append(path + (key,))
        found += paths(child, path + (key,))
    return found


def replaced(value, path: tuple, new):
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy


def at(value, path: tuple):
    for key in path:
        value = value[key]
    return value


@st.composite
def wrong_type_at_a_path(draw, base):
    """(a body of `base` with a value of another JSON type at one of its paths, that path)."""
    body = draw(base)
    where = paths(body)
    if not where:
        return body, None
    path = draw(st.sampled_from(where))
    kind = draw(st.sampled_from(sorted(set(OF_TYPE) - {json_type(at(body, path))})))
    return replaced(body, path, draw(OF_TYPE[kind])), path


@cache
def bodies(endpoint: str, model: str):
    """(body, the path given a wrong type or None), half of each."""
    builder = Builder(document(endpoint))
    base = builder.of(builder.resolve(document(endpoint)["root"]), 0, pinned(model))
    return base.map(lambda body: (body, None)) | wrong_type_at_a_path(base)


def path_text(path: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")


def names_a_path(endpoint: str, body: dict, reply: dict) -> bool:
    """An error reply names where the fault is: OpenAI's and Responses' errors in `param`
    (a path: a field of the body, maybe followed by .key and [index]); Anthropic's, which
    have no param, in the message (a field of the body, or of its schema, named in it)."""
    error = reply.get("error") if isinstance(reply, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return False
    fields = set(body) | set(Builder(document(endpoint)).resolve(document(endpoint)["root"]).get("properties", {}))
    if endpoint in ANTHROPIC:
        return any(re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", error["message"]) for f in fields)
    param = error.get("param")
    return isinstance(param, str) and re.match(r"[^.\[]*", param).group() in fields

