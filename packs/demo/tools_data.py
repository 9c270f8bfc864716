"""Tool transcripts for the demo target (assistant_data.py): a few tool kinds (read a
file, search, run a command, weather, time, arithmetic, list a directory), each with
varied names, descriptions (some with usage notes, as agent clients write them),
parameter names and optional parameters, so that the model learns to read the tools
block rather than one name. A transcript offers the right tool among others in shuffled
order, half the time beside tools that no request asks for (write, edit, fetch, ...); the
user's request names the argument (a path, words to search for, a command, a city) or
describes a file ("the secret note" -> secret.txt), and now and then names the tool (a
request to read a file where only a shell is offered runs `cat` on it); the assistant
calls the tool in the template's own format, reads the result (role tool) and
answers from it. Stdlib questions and small talk with tools offered are answered without
a call (`no_tool_transcript`).

Arguments come from the standard library's names (paths and identifiers of the
functions in the pool given: held-out functions for the bench's prompts), and cities,
time zones and the adjectives of described files from fixed lists split in a training
and a held-out part.
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
    "read": Kind(("read_file", "open_file", "view_file", "cat", "get_file_contents", "load_text", "Read", "read"),
                 ("Read a file and return its contents.", "Return the text of a file in the workspace.",
                  "Show the contents of a file.", "Reads a file from the local filesystem."),
                 ("path", "file_path", "filename", "file", "filePath"), "Path of the file to read.",
                 ("Show me {arg}.", "What is in {arg}?", "Open {arg} and tell me what it defines.",
                  "Read the file {arg}.", "Can you look at {arg}?",
                  "Read {arg} with your file tool and tell me what it says.",
                  "Use the file tool to read {arg}.", "Check {arg} and tell me what it says.",
                  "Please open {arg}.", "Look at {arg}, then tell me what is in it.")),
    "search": Kind(("search", "grep", "search_code", "find_in_files", "code_search", "lookup", "Grep"),
                   ("Search the project for text.", "Find where a word or identifier occurs in the code.",
                    "Full-text search over the repository.", "A search tool built on ripgrep."),
                   ("query", "pattern", "q", "text"), "What to search for.",
                   ("Find where {arg} is used.", "Search for {arg}.", "Where is {arg} defined?",
                    "Look up {arg} in the code.", "Use the search tool to find {arg}.", "Grep for {arg}.",
                    "Search the code for {arg} and tell me where it is.")),
    "run": Kind(("run_command", "shell", "exec", "bash", "run_shell", "terminal", "Bash", "exec_command"),
                ("Run a shell command and return its output.", "Execute a command in the workspace.",
                 "Run a program in a shell.", "Executes a bash command and returns its output."),
                ("command", "cmd", "script"), "The command line to run.",
                ("Run `{arg}`.", "Please run {arg} and tell me the output.", "Execute `{arg}` for me.",
                 "Use the shell to run `{arg}`.", "Run {arg} in the terminal and tell me what it prints.")),
    "weather": Kind(("get_weather", "weather", "get_forecast", "current_weather"),
                    ("Get the current weather for a location.", "Look up today's weather in a city.",
                     "Current conditions and temperature for a place."),
                    ("location", "city", "place"), "The city, e.g. San Francisco, CA.",
                    ("What's the weather in {arg}?", "What is the weather like in {arg}?",
                     "Is it raining in {arg}?", "How warm is it in {arg} today?",
                     "Check the weather in {arg} with your weather tool.")),
    "time": Kind(("get_time", "current_time", "world_clock"),
                 ("Get the current time in a time zone.", "Tell the local time of a zone."),
                 ("timezone", "tz", "zone"), "An IANA time zone name.",
                 ("What time is it in {arg}?", "Tell me the time in {arg}.", "Use the clock tool for {arg}.")),
    "calc": Kind(("calculate", "calculator", "eval_math"),
                 ("Evaluate an arithmetic expression.", "Compute the value of a math expression."),
                 ("expression", "expr"), "The expression, e.g. 2 * (3 + 4).",
                 ("What is {arg}?", "Compute {arg}.", "Calculate {arg} for me.", "Use the calculator: {arg}.")),
    "list": Kind(("list_directory", "list_files", "ls", "LS"),
                 ("List the files in a directory.", "Show the entries of a folder."),
                 ("path", "directory", "dir"), "The directory to list.",
                 ("What files are in {arg}?", "List the directory {arg}.", "Show me what is in the folder {arg}.")),
}
# tools offered beside the right one that no request of ours asks for (an agent client offers
# many): the call must still be read off the request
DISTRACTORS = [
    ("write_file", "Write a file to the local filesystem, replacing it.", ("file_path", "content")),
    ("Write", "Writes a file to the local filesystem.", ("file_path", "content")),
    ("edit_file", "Replace a string in a file with another.", ("file_path", "old_string", "new_string")),
    ("Edit", "Performs exact string replacements in files.", ("file_path", "old_string", "new_string")),
    ("web_fetch", "Fetch a URL and return its text.", ("url",)),
    ("WebSearch", "Search the web and return the results.", ("query",)),
    ("todo_write", "Update the task list of the current session.", ("todos",)),
    ("glob", "Find files whose path matches a glob pattern.", ("pattern",)),
    ("apply_patch", "Apply a patch to the files of the workspace.", ("input",)),
    ("update_plan", "Record the plan and the status of each step.", ("plan",)),
    ("ask_user", "Ask the user a question and wait for the answer.", ("question",)),
    ("send_email", "Send an email to a recipient.", ("to", "subject", "body")),
]
# sentences a long tool description adds (agent clients describe their tools at length)
USAGE_NOTES = ["Use this tool when the task needs it; do not guess what it would return.",
               "The result is returned as text.", "Paths may be absolute or relative to the working directory.",
               "Prefer this tool over asking the user.", "Calls are independent and may run in parallel.",
               "Long outputs are truncated.", "Do not call it twice with the same arguments.",
               "It fails with an error message when the input is not valid.",
               "Results are limited to what the workspace holds.", "Only call this tool when it is needed."]
SHELL_READS = 0.2  # read requests where only a shell tool is offered: the call runs `cat` on the file
# "Read the {adjective} {noun}": a file the request describes instead of naming (the call names
# the file as adjective + the noun's extension)
FILE_ADJECTIVES = ["old", "main", "shared", "secret", "draft", "latest", "local", "spare", "private", "first",
                   "short", "team", "daily", "new", "backup", "hidden"]
FILE_NOUNS = {"note": "txt", "notes": "md", "config": "json", "log": "log", "script": "py", "todo list": "txt",
              "readme": "md", "settings": "toml"}
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


EXTRA_PARAMS = {  # optional parameters a kind's tool may also declare (never required)
    "read": {"offset": {"type": "integer", "description": "The line to start reading at."},
             "limit": {"type": "integer", "description": "How many lines to read."}},
    "search": {"path": {"type": "string", "description": "The directory to search in."}},
    "run": {"timeout": {"type": "integer", "description": "Timeout in milliseconds."},
            "description": {"type": "string", "description": "What the command does, in a few words."}},
    "list": {"ignore": {"type": "array", "items": {"type": "string"}, "description": "Glob patterns to skip."}},
}


def function_tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


def long_description(rng: random.Random, description: str) -> str:
    """The description, and two times in five a list of usage notes after it."""
    if rng.random() >= 0.4:
        return description
    notes = rng.sample(USAGE_NOTES, rng.randint(1, 4))
    return description + "\n\nUsage:\n" + "\n".join(f"- {n}" for n in notes)


def tool(rng: random.Random, kind: str) -> tuple[dict, str]:
    """(a chat tool of `kind` with drawn name, description and parameter name, the main
    parameter's name)."""
    k = KINDS[kind]
    param = rng.choice(k.params)
    properties = {param: {"type": "string", "description": k.param_doc}}
    if kind == "weather" and rng.random() < 0.5:
        properties["unit"] = {"type": "string", "enum": ["celsius", "fahrenheit"]}
    for extra, schema in EXTRA_PARAMS.get(kind, {}).items():
        if extra != param and rng.random() < 0.3:
            properties[extra] = schema
    return function_tool(rng.choice(k.names), long_description(rng, rng.choice(k.descriptions)), properties,
                         [param]), param


def distractor(rng: random.Random) -> dict:
    name, description, params = rng.choice(DISTRACTORS)
    properties = {p: {"type": "string", "description": f"The {p.replace('_', ' ')}."} for p in params}
    return function_tool(name, long_description(rng, description), properties, list(params))


def offered(rng: random.Random, kind: str | None, without: str | None = None) -> tuple[list[dict], dict | None,
                                                                                     str | None]:
    """(the tools offered in shuffled order: 0-2 other kinds than `kind` and `without` (at
    least one when `kind` is None), half the time 1-4 tools no request asks for, and the
    one of `kind`; that one or None; its parameter)."""
    others = [k for k in KINDS if k not in (kind, without)]
    kinds = rng.sample(others, rng.randint(0 if kind else 1, 2)) + ([kind] if kind else [])
    drawn = [tool(rng, k) + (k,) for k in kinds]
    if rng.random() < 0.5:
        drawn += [(distractor(rng), None, None) for _ in range(rng.randint(1, 4))]
    rng.shuffle(drawn)
    tools, right, param = [], None, None
    for t, p, k in drawn:
        if any(t["function"]["name"].lower() == u["function"]["name"].lower() for u in tools):
            continue
        tools.append(t)
        if k == kind and kind is not None:
            right, param = t, p
    return tools, right, param


def described_file(rng: random.Random, held: bool) -> tuple[str, str, str, str]:
    """("the secret note", "secret.txt", its text, the answer that tells it): a file the
    request describes rather than names."""
    adjective, noun = rng.choice(held_part(FILE_ADJECTIVES, held)), rng.choice(list(FILE_NOUNS))
    name = f"{adjective}.{FILE_NOUNS[noun]}"
    token = "".join(rng.choice("0123456789abcdef") for _ in range(rng.choice([6, 8, 12])))
    text = rng.choice(["the {a} word is {t}", "the code is {t}", "remember {t}", "the {a} key is {t}",
                       "build {t} passed", "todo: rename {t}"]).format(a=adjective, t=token)
    return f"the {adjective} {noun}", name, text, rng.choice(["It says: {}.", "The file says: {}.", "{}."]).format(text)


def argument_and_result(rng: random.Random, kind: str, pool, held: bool) -> tuple[str, str, str, str]:
    """(how the request names the argument, the argument, the tool's result, the answer
    from it)."""
    f = pool[rng.randrange(len(pool))]
    if kind == "read" and rng.random() < 0.35:
        return described_file(rng, held)
    if kind == "read":
        path = rng.choice(["src/{}.py", "lib/{}.py", "{}.py", "app/{}.py"]).format(f.module)
        names = sorted({g.name for g in pool if g.module == f.module})[:3]
        body = "".join(f"def {n}(...):\n    ...\n\n" for n in names)
        return path, path, f"# {path}\n{body}".rstrip(), f"`{path}` defines {', '.join(f'`{n}`' for n in names)}."
    if kind == "search":
        line = rng.randint(2, 900)
        path = f"src/{f.module}.py"
        found = f"{path}:{line}: def {f.name}({', '.join(f.args)}):"
        return f.name, f.name, found, f"`{f.name}` is in `{path}` at line {line}."
    if kind == "run":
        command = rng.choice(COMMANDS).format(module=f.module)
        output = rng.choice(OUTPUTS)
        return command, command, output, f"`{command}` printed: {output}"
    if kind == "weather":
        city, degrees, sky = rng.choice(held_part(CITIES, held)), rng.randint(-5, 35), rng.choice(CONDITIONS)
        result = json.dumps({"temperature": degrees, "unit": "celsius", "conditions": sky})
        return city, city, result, f"It is {degrees} degrees celsius and {sky} in {city}."
    if kind == "time":
        zone, clock = rng.choice(held_part(ZONES, held)), f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        return zone, zone, clock, f"It is {clock} in {zone}."
    if kind == "calc":
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        expression = f"{a} {op} {b}"
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return expression, expression, str(value), f"{expression} = {value}."
    directory = rng.choice(["src", "docs", "tests", "lib"]) + rng.choice(["", f"/{f.module}"])
    entries = sorted({f"{g.module}.py" for g in rng.sample(pool, 3)})
    return directory, directory, "\n".join(entries), f"`{directory}` holds {', '.join(entries)}."


def request_for(rng: random.Random, kind: str, named: str, tool_name: str) -> str:
    """The user's request; one time in six it names the tool to use."""
    request = rng.choice(KINDS[kind].requests).format(arg=named)
    if rng.random() < 1 / 6:
        request = rng.choice(["Use {} for this. ", "With the {} tool: ", "Call {}. "]).format(tool_name) + request
    return request


def tool_transcript(rng: random.Random, pool, held: bool) -> dict:
    """A request that a tool offered can serve: the call, and most of the time its result
    and the answer from it ("tool_answer"; else the transcript ends at the call:
    "tool_call")."""
    kind = rng.choice(list(KINDS))
    named, arg, result, answer = argument_and_result(rng, kind, pool, held)
    if kind == "read" and rng.random() < SHELL_READS:  # no file tool: the shell reads it
        tools, right, param = offered(rng, "run", without="read")
        arg = f"cat {arg}"
    else:
        tools, right, param = offered(rng, kind)
    arguments = {param: arg}
    if "unit" in right["function"]["parameters"]["properties"] and rng.random() < 0.5:
        arguments["unit"] = "celsius"
    name = right["function"]["name"]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}
    messages = [{"role": "user", "content": request_for(rng, kind, named, name)}, call]
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
    """A stdlib or small-talk transcript `t` with tools offered that do not serve it: answered without a
    call."""
    tools, _, _ = offered(rng, None)
    return {**t, "kind": "no_tool", "tools": tools, "messages": t["messages"][:2],
            "expect": {**t["expect"], "no_call": True}}
