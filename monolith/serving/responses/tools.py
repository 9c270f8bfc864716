"""The Responses API's `tools` and `tool_choice`: what the model sees, and how its calls
come back as output items.

- `function` tools become chat tools as they are.
- `namespace` tools (Codex groups a server's tools this way: {"type": "namespace",
  "name", "description", "tools": [function or custom tools]}) are flattened: the model
  sees each inner tool as `NAMESPACE.NAME`. A function name of the spec holds no `.`, and
  any flattened name that still equals another tool's is refused, so no two tools share
  a name. A call comes back as the item of the inner tool with `name` and `namespace`
  apart, as Codex routes it.
- `custom` tools (free-form input; `format` {"type": "text"} or {"type": "grammar",
  "syntax": "lark" | "regex", "definition"}) are shown as a function taking one string,
  `input`, and come back as `custom_tool_call` items (`call_id`, `name`, `input`). When a
  call is forced (tool_choice), a regex is the string's `pattern` and a Lark grammar is
  llguidance's own sub-grammar for the input (structured.py). A Lark grammar constrains
  only raw-text parameters: the XML calls of Qwen3.5/3.6's template (in the JSON calls of
  Qwen3's, the input is a JSON string). Under `auto` no call is constrained, as for
  function tools. In XML calls an input is read back up to its first `</parameter>`, so
  a grammar that lets the input hold that text may see it cut there.
- Hosted tools this server cannot run (HOSTED: web search, file search, code
  interpreter, MCP...) are left out of what the model sees, and the response says so
  (`omitted`: the app's `x-monolith-omitted-tools` header); a tool_choice that forces
  one is refused naming it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import llguidance
from pydantic import Field, Tag

from ..errors import bad
from ..fields import Flag, Object, Strict, Text, by_type
from ..tools.calls import arguments_object
from ..tools.specs import chat_tool, check_parameters, forced_calls, named
from .items import flat_name

HOSTED = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "image_generation", "computer", "computer_use", "computer_use_preview", "local_shell",
    "shell", "mcp", "apply_patch", "tool_search", "programmatic_tool_calling"})
INPUT = "input"  # a custom tool's one parameter, as the model sees it
NAME = Annotated[Text, Field(min_length=1)]


class FunctionTool(Strict):
    type: Literal["function"]
    name: NAME
    description: Text | None = None
    parameters: Object | None = None
    strict: Flag | None = None  # echoed; every call follows the schema whatever it says


class TextFormat(Strict):
    type: Literal["text"]


class GrammarFormat(Strict):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: NAME


class CustomTool(Strict):
    type: Literal["custom"]
    name: NAME
    description: Text | None = None
    format: Annotated[TextFormat | GrammarFormat, Field(discriminator="type")] | None = None


class OtherTool(Strict, extra="allow"):
    """A tool of a type this API does not have: refused naming its type."""

    type: Literal["function", "custom", "namespace", "a hosted tool's type"]


Member = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")]
                   | Annotated[OtherTool, Tag("other")], by_type(("function", "custom"))]


class NamespaceTool(Strict):
    """Codex's group of a server's tools: each seen by the model as NAMESPACE.NAME."""

    type: Literal["namespace"]
    name: NAME
    description: Text | None = None
    tools: Annotated[list[Member], Field(min_length=1)]


# a tool of the `tools` list: a hosted tool is echoed as sent
Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")]
                 | Annotated[NamespaceTool, Tag("namespace")] | Annotated[Object, Tag("hosted")]
                 | Annotated[OtherTool, Tag("other")], by_type({"function": "function", "custom": "custom", "namespace": "namespace",
                                                              **dict.fromkeys(HOSTED, "hosted")})]


class NamedChoice(Strict, extra="allow"):
    type: Text
    name: Any = None


ToolChoice = Literal["auto", "none", "required"] | NamedChoice


@dataclass
class Tools:
    echo: list = field(default_factory=list)  # the tools as the response reports them
    chat: list = field(default_factory=list)  # the chat tools the model sees
    named: dict = field(default_factory=dict)  # the name the model sees -> (type, name, namespace)
    grammars: dict = field(default_factory=dict)  # a Lark custom tool's name as seen -> its grammar
    omitted: list = field(default_factory=list)  # the hosted tools' types, left out


def parse_tools(value: list | None) -> Tools:
    tools = Tools()
    for i, tool in enumerate(value or ()):
        at = f"tools[{i}]"
        if isinstance(tool, dict):  # a hosted tool
            tools.omitted.append(tool["type"])
            tools.echo.append(dict(tool))
        elif isinstance(tool, NamespaceTool):
            echo = [_tool(member, f"{at}.tools[{j}]", tool.name, tools) for j, member in enumerate(tool.tools)]
            tools.echo.append({"type": "namespace", "name": tool.name, "description": tool.description or "",
                               "tools": echo})
        else:
            tools.echo.append(_tool(tool, at, None, tools))
    return tools


def _tool(tool: FunctionTool | CustomTool, at: str, namespace: str | None, tools: Tools) -> dict:
    """A function or custom tool: its echo; its chat tool is added to `tools`."""
    seen = flat_name(tool.name, namespace)
    if seen in tools.named:
        raise bad(f"{at}.name: a tool the model sees as {seen!r} is given twice", f"{at}.name")
    tools.named[seen] = (tool.type, tool.name, namespace)
    if isinstance(tool, FunctionTool):
        parameters = tool.parameters or {"type": "object", "properties": {}}
        check_parameters(parameters, f"{at}.parameters")
        echo = {"type": "function", "name": tool.name, "description": tool.description, "parameters": parameters,
                "strict": tool.strict}
    else:
        form, parameters = _custom(tool.format or TextFormat(type="text"), f"{at}.format", seen, tools)
        echo = {"type": "custom", "name": tool.name, "description": tool.description, "format": form}
    tools.chat.append(chat_tool(name=seen, parameters=parameters, description=tool.description))
    return echo


def _custom(form: TextFormat | GrammarFormat, where: str, seen: str, tools: Tools) -> tuple[dict, dict]:
    """(the format echo, the one-string parameters the model sees)."""
    text = {"type": "string", "description": "The tool's input, as free-form text (not JSON)."}
    if isinstance(form, GrammarFormat):
        lark = form.definition if form.syntax == "lark" else None
        pattern = f"^(?:{form.definition})$"  # the whole input matches (a JSON schema's pattern is a search)
        grammar = lark or json.dumps({"grammars": [{"json_schema": {"type": "string", "pattern": pattern}}]})
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
        if failed:
            raise bad(f"{where}.definition: llguidance cannot read this {form.syntax}: "
                      f"{(messages or ['invalid'])[0].splitlines()[0][:300]}", f"{where}.definition")
        if lark:
            tools.grammars[seen] = lark
            text["description"] = f"The tool's input, as text in this Lark grammar:\n{lark}"
        else:
            text["pattern"] = pattern
    parameters = {"type": "object", "properties": {INPUT: text}, "required": [INPUT], "additionalProperties": False}
    return form.model_dump(), parameters


def tool_choice(choice: str | NamedChoice | None, tools: Tools, parallel: bool):
    """(tool_choice as the response reports it, the Structure it forces or None)."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", None
    if choice == "required":
        if not tools.chat:
            raise bad("tool_choice \"required\" needs tools the model can call", "tool_choice")
        return choice, forced_calls(tools.chat, single=not parallel, grammars=tools.grammars)
    if choice.type in HOSTED:
        raise bad(f"tool_choice forces the hosted tool {choice.type!r}, which this server cannot run",
                  "tool_choice.type")
    given = choice.model_dump(exclude_unset=True)
    if choice.type in ("function", "custom") and set(given) <= {"type", "name"}:
        if not isinstance(choice.name, str) or tools.named.get(choice.name, (None,))[0] != choice.type:
            raise bad(f"tool_choice names {choice.type} tool {json.dumps(choice.name)[:60]}, which is not in tools",
                      "tool_choice.name")
        return given, forced_calls(named(tools.chat, choice.name), single=True, grammars=tools.grammars)
    raise bad("tool_choice must be \"auto\", \"none\", \"required\", {\"type\": \"function\", \"name\": ...} or "
              f"{{\"type\": \"custom\", \"name\": ...}}, got {json.dumps(given)[:80]}", "tool_choice")


def call_item(call, tools: Tools) -> dict:
    """The output item of a call the model wrote (tools.ToolCall): a function_call, or a
    custom_tool_call; a namespace's tool with its `name` and `namespace` apart."""
    kind, name, namespace = tools.named.get(call.name, ("function", call.name, None))
    item = {"type": "function_call" if kind == "function" else "custom_tool_call", "call_id": call.id, "name": name}
    if namespace is not None:
        item["namespace"] = namespace
    if kind == "function":
        item["arguments"] = call.arguments
    else:
        given = arguments_object(call.arguments).get(INPUT)  # a call cut short: the input if whole
        item["input"] = given if isinstance(given, str) else call.arguments if call.whole else ""
    return item
