"""Tool transcripts for the demo target (assistant_data.py): a few tool kinds (read a
file, search, run a command, weather, time, arithmetic, list a directory), each with
varied names, descriptions and parameter names, so that the model learns to read the
tools block rather than one name. A transcript offers the right tool among others in
shuffled order; the user's request names the argument (a path, words to search for, a
command, a city); the assistant calls the tool in the template's own format, reads the
result (role tool) and answers from it. Stdlib questions and small talk with tools
offered are answered without a call (`no_tool_transcript`).

Arguments come from the standard library's names (paths and identifiers of the
functions in the pool given: held-out functions for the bench's prompts), and cities
and commands from fixed lists split in a training and a held-out part.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    names: tuple[str, ...]
    descriptions: tuple[str, ...]
    params: tuple[str, ...]  # the main argument's name, one of these
    param_doc: str
    requests: tuple[str, ...]  # "{arg}" is the argument


KINDS = {
    "read": Kind(("read_file", "open_file", "view_file", "cat", "get_file_contents", "load_text"),
                 ("Read a file and return its contents.", "Return the text of a file in the workspace.",
                  "Show the contents of a file."),
                 ("path", "file_path", "filename", "file"), "Path of the file to read.",
                 ("Show me {arg}.", "What is in {arg}?", "Open {arg} and tell me what it defines.",
                  "Read the file {arg}.", "Can you look at {arg}?")),
    "search": Kind(("search", "grep", "search_code", "find_in_files", "code_search", "lookup"),
                   ("Search the project for text.", "Find where a word or identifier occurs in the code.",
                    "Full-text search over the repository."),
                   ("query", "pattern", "q", "text"), "What to search for.",
                   ("Find where {arg} is used.", "Search for {arg}.", "Where is {arg} defined?",
                    "Look up {arg} in the code.")),
    "run": Kind(("run_command", "shell", "exec", "bash", "run_shell", "terminal"),
                ("Run a shell command and return its output.", "Execute a command in the workspace.",
                 "Run a program in a shell."),
                ("command", "cmd", "script"), "The command line to run.",
                ("Run `{arg}`.", "Please run {arg} and tell me the output.", "Execute `{arg}` for me.")),
    "weather": Kind(("get_weather", "weather", "get_forecast", "current_weather"),
                    ("Get the current weather for a location.", "Look up today's weather in a city.",
                     "Current conditions and temperature for a place."),
                    ("location", "city", "place"), "The city, e.g. San Francisco, CA.",
                    ("What's the weather in {arg}?", "What is the weather like in {arg}?",
                     "Is it raining in {arg}?", "How warm is it in {arg} today?")),
    "time": Kind(("get_time", "current_time", "world_clock"),
                 ("Get the current time in a time zone.", "Tell the local time of a zone."),
                 ("timezone", "tz", "zone"), "An IANA time zone name.",
                 ("What time is it in {arg}?", "Tell me the time in {arg}.")),
    "calc": Kind(("calculate", "calculator", "eval_math"),
                 ("Evaluate an arithmetic expression.", "Compute the value of a math expression."),
                 ("expression", "expr"), "The expression, e.g. 2 * (3 + 4).",
                 ("What is {arg}?", "Compute {arg}.", "Calculate {arg} for me.")),
    "list": Kind(("list_directory", "list_files", "ls"),
                 ("List the files in a directory.", "Show the entries of a folder."),
                 ("path", "directory", "dir"), "The directory to list.",
                 ("What files are in {arg}?", "List the directory {arg}.")),
}
CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Denver", "Madrid", "Seoul", "Toronto", "Nairobi",
          "Berlin", "Mumbai", "Sydney", "Boston", "Quito", "Dublin", "Hanoi", "Austin", "Prague", "Chicago",
          "Vienna", "Santiago", "Helsinki", "San Francisco, CA", "Kyoto", "Accra", "Lisbon"]
ZONES = ["Europe/Paris", "Asia/Tokyo", "America/New_York", "Africa/Lagos", "Australia/Sydney", "Europe/Berlin",
         "America/Chicago", "Asia/Kolkata", "America/Lima", "Europe/Oslo", "Asia/Seoul", "Europe/Madrid"]
COMMANDS = ["pytest -q", "git status", "ls src", "make test", "python -m {module}", "git log -1", "pip list",
            "python -V", "du -sh .", "python {module}.py", "ruff check .", "git diff --stat"]
CONDITIONS = ["sunny", "cloudy", "raining", "snowing", "windy", "foggy"]
OUTPUTS = ["3 passed in 0.21s", "nothing to commit, working tree clean", "ok", "Python 3.11.7", "1 failed, 4 passed",
           "done", "All checks passed!", "12M\t."]


def held_part(items: list, held: bool) -> list:
    """Every fourth item is held out (bench prompts), the rest train."""
    return [x for i, x in enumerate(items) if (i % 4 == 3) == held]


def tool(rng: random.Random, kind: str) -> tuple[dict, str]:
    """(a chat tool of `kind` with drawn name, description and parameter name, the main
    parameter's name)."""
    k = KINDS[kind]
    param = rng.choice(k.params)
    properties = {param: {"type": "string", "description": k.param_doc}}
    if kind == "weather" and rng.random() < 0.5:
        properties["unit"] = {"type": "string", "enum": ["celsius", "fahrenheit"]}
    schema = {"type": "object", "properties": properties, "required": [param]}
    return {"type": "function", "function": {"name": rng.choice(k.names), "description": rng.choice(k.descriptions),
                                             "parameters": schema}}, param


def offered(rng: random.Random, kind: str | None) -> tuple[list[dict], dict | None, str | None]:
    """(1-3 tools in shuffled order, the one of `kind` among them or None, its parameter)."""
    others = [k for k in KINDS if k != kind]
    kinds = rng.sample(others, rng.randint(0 if kind else 1, 2)) + ([kind] if kind else [])
    rng.shuffle(kinds)
    tools, right, param = [], None, None
    for k in kinds:
        t, p = tool(rng, k)
        if any(t["function"]["name"] == u["function"]["name"] for u in tools):
            continue
        tools.append(t)
        if k == kind:
            right, param = t, p
    return tools, right, param


def argument_and_result(rng: random.Random, kind: str, pool, held: bool) -> tuple[str, str, str]:
    """(the argument the request names, the tool's result, the answer from it)."""
    f = pool[rng.randrange(len(pool))]
    if kind == "read":
        path = rng.choice(["src/{}.py", "lib/{}.py", "{}.py", "app/{}.py"]).format(f.module)
        names = sorted({g.name for g in pool if g.module == f.module})[:3]
        body = "".join(f"def {n}(...):\n    ...\n\n" for n in names)
        return path, f"# {path}\n{body}".rstrip(), f"`{path}` defines {', '.join(f'`{n}`' for n in names)}."
    if kind == "search":
        line = rng.randint(2, 900)
        path = f"src/{f.module}.py"
        found = f"{path}:{line}: def {f.name}({', '.join(f.args)}):"
        return f.name, found, f"`{f.name}` is in `{path}` at line {line}."
    if kind == "run":
        command = rng.choice(COMMANDS).format(module=f.module)
        output = rng.choice(OUTPUTS)
        return command, output, f"`{command}` printed: {output}"
    if kind == "weather":
        city, degrees, sky = rng.choice(held_part(CITIES, held)), rng.randint(-5, 35), rng.choice(CONDITIONS)
        result = json.dumps({"temperature": degrees, "unit": "celsius", "conditions": sky})
        return city, result, f"It is {degrees} degrees celsius and {sky} in {city}."
    if kind == "time":
        zone, clock = rng.choice(held_part(ZONES, held)), f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        return zone, clock, f"It is {clock} in {zone}."
    if kind == "calc":
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        expression = f"{a} {op} {b}"
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return expression, str(value), f"{expression} = {value}."
    directory = rng.choice(["src", "docs", "tests", "lib"]) + rng.choice(["", f"/{f.module}"])
    entries = sorted({f"{g.module}.py" for g in rng.sample(pool, 3)})
    return directory, "\n".join(entries), f"`{directory}` holds {', '.join(entries)}."


def tool_transcript(rng: random.Random, pool, held: bool) -> dict:
    """A request that a tool offered can serve: the call, and most of the time its result
    and the answer from it ("tool_answer"; else the transcript ends at the call:
    "tool_call")."""
    kind = rng.choice(list(KINDS))
    tools, right, param = offered(rng, kind)
    arg, result, answer = argument_and_result(rng, kind, pool, held)
    arguments = {param: arg}
    if "unit" in right["function"]["parameters"]["properties"] and rng.random() < 0.5:
        arguments["unit"] = "celsius"
    name = right["function"]["name"]
    request = rng.choice(KINDS[kind].requests).format(arg=arg)
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}
    messages = [{"role": "user", "content": request}, call]
    expect = {"tool": name, "arguments": arguments}
    if rng.random() < 0.7:
        messages += [{"role": "tool", "content": result}, {"role": "assistant", "content": answer}]
        return {"kind": "tool_answer", "messages": messages, "tools": tools, "kwargs": {},
                "expect": {"key_words": answer_words(answer)}}
    return {"kind": "tool_call", "messages": messages, "tools": tools, "kwargs": {}, "expect": expect}


def answer_words(answer: str) -> list[str]:
    """The words of an answer from a tool's result that carry the result (4+ characters)."""
    words = [w.strip("`.,:;'").lower() for w in answer.split()]
    return [w for w in words if len(w) > 3][:4]


def no_tool_transcript(rng: random.Random, t: dict) -> dict:
    """A stdlib transcript `t` with tools offered that do not serve it: answered without a call."""
    tools, _, _ = offered(rng, None)
    return {**t, "kind": "no_tool", "tools": tools, "messages": t["messages"][:2],
            "expect": {**t["expect"], "no_call": True}}
