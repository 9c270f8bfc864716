"""Tools, whichever API sends them: the one home of what every API checks in a tool and
of how the server holds it. Each API reads its own wire shape (chat's in requests.py,
Anthropic's in anthropic/requests.py, the Responses API's in responses/tools.py) and calls these:

- `tool_entries`: the entries of a `tools` list, each with its path (`tools[0]`);
- `tool_fields`: a tool's name (a non-empty string), description (a string, if given)
  and parameter schema (an object whose `properties` and `required` the tool-call
  parser can read: `check_parameters`), each refused with a 400 naming it under the
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


def tool_entries(value, shape: str) -> list[tuple[str, object]]:
    """(path, entry) for each entry of a `tools` list (None: no tools); a 400 if `tools`
    is not a list (`shape` words what its entries must be)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad(f"tools must be a list of {shape}", "tools")
    return [(f"tools[{i}]", tool) for i, tool in enumerate(value)]


def tool_fields(tool: dict, at: str, schema_key: str | None = "parameters",
                schema_required: bool = False) -> tuple[str, str | None, dict | None]:
    """(name, description, parameter schema) of the tool object at `at`, checked; the
    schema is `tool[schema_key]` (None: the tool has none, as a custom tool)."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"{at}.name must be a non-empty string", f"{at}.name")
    schema = tool.get(schema_key) if schema_key else None
    if schema_key:
        if (schema is not None or schema_required) and not isinstance(schema, dict):
            raise bad(f"{at}.{schema_key} must be a JSON schema object", f"{at}.{schema_key}")
        check_parameters(schema or {}, f"{at}.{schema_key}")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise bad(f"{at}.description must be a string", f"{at}.description")
    return name, description, schema


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
