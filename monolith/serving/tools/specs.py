"""Tools, whichever API sends them: the one home of what every API checks in a tool and
of how the server holds it. Each API types its own wire shape (chat's in requests.py,
Anthropic's in anthropic/requests.py, the Responses API's in responses/tools.py: a name
a non-empty string, a description a string) and calls these:

- `check_parameters`: a tool's parameter schema is an object whose `properties` and
  `required` the tool-call parser can read, refused with a 400 naming it under the
  API's own path (`tools[0].function.parameters`, `tools[0].input_schema`, ...);
- `chat_tool`: the tool as the chat path holds it and the template shows it, OpenAI's
  {"type": "function", "function": {"name", "description", "parameters"}};
- `named`: the tools of one name (a tool_choice that names one);
- `forced_calls`: the Structure of a tool_choice that forces calls (structured.py):
  "required" (one or more calls to any of the tools), a named tool, or exactly one call;
- `json_arguments`: a call's arguments, JSON text in every API, as the mapping the
  templates iterate."""

from __future__ import annotations

import json

from ..errors import bad
from ..structured import Structure


def check_parameters(schema: dict, at: str) -> None:
    """The parts of a tool's parameter schema the tool-call parser reads: `properties`
    an object of schemas (objects or booleans), `required` a list of names."""
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            raise bad(f"{at}.properties must be an object of property schemas, got {json.dumps(properties)[:60]}",
                      f"{at}.properties")
        for name, prop in properties.items():
            if not isinstance(prop, (dict, bool)):
                raise bad(f"{at}.properties.{name} must be a schema object, got {json.dumps(prop)[:60]}",
                          f"{at}.properties.{name}")
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(n, str) for n in required)):
        raise bad(f"{at}.required must be a list of property names", f"{at}.required")


def chat_tool(**function) -> dict:
    """A tool as the chat path holds it: the function's fields in the order given (the
    template shows them in that order), those that are None left out."""
    return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}


def named(tools, name) -> list[dict]:
    """The chat tools called `name`."""
    return [tool for tool in tools or () if tool["function"]["name"] == name]


def forced_calls(tools, single: bool = False, grammars: dict | None = None) -> Structure:
    """The output a forcing tool_choice asks for: calls to `tools` (chat tools), at least
    one, exactly one when `single`; `grammars` (a tool's name -> its Lark grammar) for the
    custom tools among them."""
    names = {tool["function"]["name"] for tool in tools}
    kept = tuple((name, lark) for name, lark in (grammars or {}).items() if name in names)
    return Structure("tools", "tools", tools=tuple(tools), single=single, grammars=kept)


def json_arguments(text: str, where: str) -> dict:
    """A tool call's arguments, JSON text in the APIs, as the mapping templates iterate
    (empty text: no arguments)."""
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        raise bad(f"{where} is not valid JSON", where) from None
    if not isinstance(value, dict):
        raise bad(f"{where} must be a JSON object", where)
    return value
