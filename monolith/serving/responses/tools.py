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

import llguidance

from ..errors import bad
from ..fields import is_name, refuse_extra
from ..tools.calls import arguments_object
from ..tools.specs import chat_tool, forced_calls, named, tool_entries, tool_fields
from .items import flat_name, string_field

HOSTED = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "image_generation", "computer", "computer_use", "computer_use_preview", "local_shell",
    "shell", "mcp", "apply_patch", "tool_search", "programmatic_tool_calling"})
FUNCTION_KEYS = {"type", "name", "description", "parameters", "strict"}
CUSTOM_KEYS = {"type", "name", "description", "format"}
NAMESPACE_KEYS = {"type", "name", "description", "tools"}
INPUT = "input"  # a custom tool's one parameter, as the model sees it


@dataclass
class Tools:
    echo: list = field(default_factory=list)  # the tools as the response reports them
    chat: list = field(default_factory=list)  # the chat tools the model sees
    named: dict = field(default_factory=dict)  # the name the model sees -> (type, name, namespace)
    grammars: dict = field(default_factory=dict)  # a Lark custom tool's name as seen -> its grammar
    omitted: list = field(default_factory=list)  # the hosted tools' types, left out


def parse_tools(value) -> Tools:
    tools = Tools()
    for at, tool in tool_entries(value, "tool objects"):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if is_name(kind, HOSTED):
            tools.omitted.append(kind)
            tools.echo.append(dict(tool))
        elif kind == "namespace":
            _namespace(tool, at, tools)
        elif kind in ("function", "custom"):
            tools.echo.append(_tool(tool, at, None, tools))
        else:
            raise bad(f"{at}.type must be function, custom, namespace or a hosted tool's type, got "
                      f"{json.dumps(kind)[:60]}", f"{at}.type")
    return tools


def _namespace(tool: dict, at: str, tools: Tools) -> None:
    refuse_extra(tool, NAMESPACE_KEYS, at)
    name = string_field(tool, "name", at)
    if tool.get("description") is not None and not isinstance(tool["description"], str):
        raise bad(f"{at}.description must be a string", f"{at}.description")
    inner = tool.get("tools")
    if not isinstance(inner, list) or not inner:
        raise bad(f"{at}.tools must be a non-empty list of function or custom tools", f"{at}.tools")
    echo = []
    for j, member in enumerate(inner):
        where = f"{at}.tools[{j}]"
        kind = member.get("type") if isinstance(member, dict) else None
        if kind not in ("function", "custom"):
            raise bad(f"{where}.type must be function or custom, got {json.dumps(kind)[:60]}", f"{where}.type")
        echo.append(_tool(member, where, name, tools))
    tools.echo.append({"type": "namespace", "name": name, "description": tool.get("description") or "", "tools": echo})


def _tool(tool: dict, at: str, namespace: str | None, tools: Tools) -> dict:
    """A function or custom tool: its echo; its chat tool is added to `tools`."""
    kind = tool["type"]
    refuse_extra(tool, FUNCTION_KEYS if kind == "function" else CUSTOM_KEYS, at)
    name, description, parameters = tool_fields(tool, at, "parameters" if kind == "function" else None)
    seen = flat_name(name, namespace)
    if seen in tools.named:
        raise bad(f"{at}.name: a tool the model sees as {seen!r} is given twice", f"{at}.name")
    tools.named[seen] = (kind, name, namespace)
    if kind == "function":
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise bad(f"{at}.strict must be true or false", f"{at}.strict")
        parameters = parameters or {"type": "object", "properties": {}}
        echo = {"type": "function", "name": name, "description": description, "parameters": parameters,
                "strict": tool.get("strict")}
    else:
        form, parameters = _custom(tool, at, seen, tools)
        echo = {"type": "custom", "name": name, "description": description, "format": form}
    tools.chat.append(chat_tool(name=seen, parameters=parameters, description=description))
    return echo


def _custom(tool: dict, at: str, seen: str, tools: Tools) -> tuple[dict, dict]:
    """(the format echo, the one-string parameters the model sees)."""
    form = tool.get("format") or {"type": "text"}
    where = f"{at}.format"
    if not isinstance(form, dict) or form.get("type") not in ("text", "grammar"):
        raise bad(f"{where} must be {{\"type\": \"text\"}} or {{\"type\": \"grammar\", \"syntax\": \"lark\" | "
                  "\"regex\", \"definition\": ...}", where)
    refuse_extra(form, {"type"} if form["type"] == "text" else {"type", "syntax", "definition"}, where)
    text = {"type": "string", "description": "The tool's input, as free-form text (not JSON)."}
    if form["type"] == "grammar":
        syntax = form.get("syntax")
        if syntax not in ("lark", "regex"):
            raise bad(f"{where}.syntax must be \"lark\" or \"regex\", got {json.dumps(syntax)[:60]}",
                      f"{where}.syntax")
        definition = string_field(form, "definition", where)
        lark = definition if syntax == "lark" else None
        pattern = f"^(?:{definition})$"  # the whole input matches (a JSON schema's pattern is a search)
        grammar = lark or json.dumps({"grammars": [{"json_schema": {"type": "string", "pattern": pattern}}]})
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
        if failed:
            raise bad(f"{where}.definition: llguidance cannot read this {syntax}: "
                      f"{(messages or ['invalid'])[0].splitlines()[0][:300]}", f"{where}.definition")
        if lark:
            tools.grammars[seen] = lark
            text["description"] = f"The tool's input, as text in this Lark grammar:\n{lark}"
        else:
            text["pattern"] = pattern
        form = {"type": "grammar", "syntax": syntax, "definition": definition}
    parameters = {"type": "object", "properties": {INPUT: text}, "required": [INPUT], "additionalProperties": False}
    return form, parameters


def tool_choice(choice, tools: Tools, parallel: bool):
    """(tool_choice as the response reports it, the Structure it forces or None)."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", None
    if choice == "required":
        if not tools.chat:
            raise bad("tool_choice \"required\" needs tools the model can call", "tool_choice")
        return choice, forced_calls(tools.chat, single=not parallel, grammars=tools.grammars)
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and not isinstance(kind, str):
        raise bad(f"tool_choice.type must be a string, got {json.dumps(kind)[:60]}", "tool_choice.type")
    if is_name(kind, HOSTED):
        raise bad(f"tool_choice forces the hosted tool {kind!r}, which this server cannot run", "tool_choice.type")
    if kind in ("function", "custom") and set(choice) <= {"type", "name"}:
        name = choice.get("name")
        if not isinstance(name, str) or tools.named.get(name, (None,))[0] != kind:
            raise bad(f"tool_choice names {kind} tool {json.dumps(name)[:60]}, which is not in tools",
                      "tool_choice.name")
        return dict(choice), forced_calls(named(tools.chat, name), single=True, grammars=tools.grammars)
    raise bad("tool_choice must be \"auto\", \"none\", \"required\", {\"type\": \"function\", \"name\": ...} or "
              f"{{\"type\": \"custom\", \"name\": ...}}, got {json.dumps(choice)[:80]}", "tool_choice")


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
