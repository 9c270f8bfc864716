"""The Open Responses specification's own JSON schemas (tests/data/openresponses: the
published OpenAPI document, release 2026-04-24) as validators: a response object, a
streaming event (the schema its `type` names among the SSE events of POST /responses),
a WebSocket error event and a compaction. jsonschema judges; nothing here restates the
schemas."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

DOCUMENT = Path(__file__).parent / "data" / "openresponses" / "openapi.json"
ROOT = "urn:openresponses"  # the document's own id here, so that its "#/components/..." refs resolve


@cache
def _document() -> dict:
    return json.loads(DOCUMENT.read_text())


@cache
def _registry() -> Registry:
    return Registry().with_resource(ROOT, Resource(contents=_document(), specification=DRAFT202012))


@cache
def validator(schema_name: str) -> jsonschema.Draft202012Validator:
    """The validator of components.schemas[schema_name]."""
    assert schema_name in _document()["components"]["schemas"], schema_name
    return jsonschema.Draft202012Validator({"$ref": f"{ROOT}#/components/schemas/{schema_name}"},
                                           registry=_registry())


@cache
def event_schemas() -> dict[str, str]:
    """Streaming event type -> its schema's name, from POST /responses' text/event-stream."""
    content = _document()["paths"]["/responses"]["post"]["responses"]["200"]["content"]
    names = [ref["$ref"].rsplit("/", 1)[1] for ref in content["text/event-stream"]["schema"]["oneOf"]]
    schemas = _document()["components"]["schemas"]
    return {schemas[name]["properties"]["type"]["enum"][0]: name for name in names}


def check(schema_name: str, value: dict) -> None:
    """AssertionError with every violation unless `value` validates."""
    errors = sorted(validator(schema_name).iter_errors(value), key=lambda e: list(e.absolute_path))
    assert not errors, f"{schema_name}: " + "; ".join(
        f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}" for e in errors[:8])


def check_response(body: dict) -> None:
    check("ResponseResource", body)


def check_event(event: dict) -> None:
    """An SSE (or WebSocket) streaming event against the schema of its type."""
    kind = event.get("type")
    assert kind in event_schemas(), f"{kind!r} is not an Open Responses streaming event"
    check(event_schemas()[kind], event)


def check_events(events: list[dict]) -> None:
    for event in events:
        check_event(event)
    numbers = [e["sequence_number"] for e in events]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
