"""The agent workload bench/prompt_cache.py replays: a coding agent's system prompt (a
long instruction text and an OpenAI `tools` list of function schemas), sized to a token
count with the served model's own chat template, and the user turns of two (or more)
conversations that share it.

A conversation keeps its history as a client does: each reply goes back as an
assistant message with only `content` (any `<think>...</think>` part stripped, as Qwen's
template drops the reasoning of earlier turns) and any tool calls the server parsed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


def _string(description: str, enum: list[str] | None = None) -> dict:
    return {"type": "string", "description": description, **({"enum": enum} if enum else {})}


def _integer(description: str, minimum: int = 0) -> dict:
    return {"type": "integer", "description": description, "minimum": minimum}


TOOLS = [
    _function("read_file", "Read a text file of the workspace. Long files are returned in pages; ask for the next "
              "page with `offset`. Binary files are refused with an error.",
              {"path": _string("Path relative to the repository root, e.g. src/app/main.py"),
               "offset": _integer("First line to return (0-based)"),
               "limit": _integer("Lines to return at most (default 400)", 1)}, ["path"]),
    _function("write_file", "Create or overwrite a file with the given text. Parent directories are created. "
              "Prefer edit_file for changes to existing files.",
              {"path": _string("Path relative to the repository root"),
               "content": _string("The complete new text of the file")}, ["path", "content"]),
    _function("edit_file", "Replace one exact occurrence of `old` by `new` in a file. Fails when `old` occurs "
              "zero times or more than once; include enough context to make it unique.",
              {"path": _string("Path relative to the repository root"),
               "old": _string("The exact text to replace, whitespace included"),
               "new": _string("The replacement text")}, ["path", "old", "new"]),
    _function("list_directory", "List the entries of a directory, directories first, with sizes in bytes.",
              {"path": _string("Directory relative to the repository root ('.' for the root)"),
               "depth": _integer("How many levels to descend (default 1)", 1),
               "include_hidden": {"type": "boolean", "description": "Also list names starting with a dot"}},
              ["path"]),
    _function("search_code", "Search the repository for a regular expression (ripgrep syntax) and return the "
              "matching lines with their file names and line numbers.",
              {"pattern": _string("The regular expression"),
               "glob": _string("Only files whose path matches this glob, e.g. '*.py'"),
               "case_sensitive": {"type": "boolean", "description": "Match case exactly (default false)"},
               "max_results": _integer("Matches to return at most (default 100)", 1)}, ["pattern"]),
    _function("find_symbol", "Find where a Python symbol (function, class, method or module-level name) is "
              "defined and where it is referenced.",
              {"name": _string("The symbol, optionally qualified: package.module.Class.method"),
               "kind": _string("What to return", ["definition", "references", "both"])}, ["name"]),
    _function("run_shell", "Run a shell command in the repository root with a timeout and return its exit "
              "status, standard output and standard error (each truncated to 20000 characters).",
              {"command": _string("The command line, run by /bin/bash -lc"),
               "timeout_seconds": _integer("Kill the command after this many seconds (default 120)", 1),
               "env": {"type": "object", "description": "Extra environment variables",
                       "additionalProperties": {"type": "string"}}}, ["command"]),
    _function("run_tests", "Run the test suite or a part of it with pytest and return the summary and the "
              "failures' tracebacks.",
              {"selection": _string("pytest node ids or a -k expression; empty for the whole suite"),
               "fail_fast": {"type": "boolean", "description": "Stop at the first failure (-x)"},
               "verbosity": _string("Output detail", ["quiet", "normal", "verbose"])}, []),
    _function("git_status", "Show the working tree status: staged, unstaged and untracked files.", {}, []),
    _function("git_diff", "Show a diff of the working tree against a revision.",
              {"revision": _string("Revision to compare with (default HEAD)"),
               "paths": {"type": "array", "items": {"type": "string"}, "description": "Limit to these paths"},
               "context_lines": _integer("Lines of context around each change (default 3)")}, []),
    _function("git_commit", "Commit the staged changes (or all tracked changes with `all`) with a message.",
              {"message": _string("The commit message: a short summary line, a blank line, then details"),
               "all": {"type": "boolean", "description": "Stage every modified tracked file first"}},
              ["message"]),
    _function("http_get", "Fetch a URL of the project's documentation mirror and return the text of the page.",
              {"url": _string("An http(s) URL"),
               "max_characters": _integer("Truncate the text to this many characters (default 20000)", 1)},
              ["url"]),
    _function("python_eval", "Evaluate a short Python snippet in a fresh interpreter of the project's virtual "
              "environment and return what it prints and the value of its last expression.",
              {"code": _string("The Python source"),
               "timeout_seconds": _integer("Kill the interpreter after this many seconds (default 30)", 1)},
              ["code"]),
    _function("ask_user", "Ask the user a question when the task is ambiguous, and wait for the answer.",
              {"question": _string("One clear question"),
               "options": {"type": "array", "items": {"type": "string"},
                           "description": "Suggested answers, if the question has a few"}}, ["question"]),
]

INTRO = ("You are Forge, an autonomous software engineering agent. You work inside a checked-out Git "
         "repository through the tools listed below, on behalf of a developer who reads your messages "
         "between turns. Think before acting, act in small verifiable steps, and report what you did and "
         "what you found, plainly and briefly.")

AREAS = ["reading code", "editing files", "running commands", "testing", "version control", "dependencies",
         "error handling", "performance work", "documentation", "security", "communication",
         "data files", "configuration", "concurrency", "logging", "reviews"]
RULES = [
    "Read the relevant files before you change them, and quote the lines you rely on.",
    "Prefer the smallest change that fixes the problem; do not reformat code you are not changing.",
    "After every edit, run the narrowest test that covers it, then the wider suite before you finish.",
    "Never guess a file's content, an API's signature or a command's output: look it up with a tool.",
    "When a command fails, read its whole error output and fix the cause, not the symptom.",
    "Keep secrets out of the repository, the logs and your messages; never print environment variables.",
    "State your assumptions explicitly, and ask the user when one of them decides the design.",
    "Write a test that fails before the fix and passes after it, and say which test that is.",
    "Do not delete or rewrite history; commit in small steps with messages that say why.",
    "Stop and report when the task needs access, hardware or information that you do not have.",
    "Measure before and after a performance change, on the same input, and report both numbers.",
    "Follow the repository's existing style, naming and layering, even where you would choose otherwise.",
]


def _guideline(number: int) -> str:
    area = AREAS[number % len(AREAS)]
    rule = RULES[number % len(RULES)]
    other = RULES[(number * 5 + 3) % len(RULES)]
    return (f"Guideline {number + 1} ({area}): {rule} In {area}, this also means: {other.lower()} "
            f"Check this guideline again at step {number % 7 + 2} of any task that touches {area}.")


def system_prompt(count_tokens, target_tokens: int, tools: list[dict] = TOOLS) -> str:
    """The system text: the intro and numbered guidelines, as many as bring the rendered
    system message with `tools` (`count_tokens(system_text)`) to at least target_tokens."""
    parts = [INTRO]
    if count_tokens(INTRO) >= target_tokens:
        return INTRO
    low, high = 1, 1
    while count_tokens("\n\n".join(parts + [_guideline(i) for i in range(high)])) < target_tokens:
        low, high = high, high * 2
        if high > 1 << 16:
            raise ValueError(f"cannot reach {target_tokens} system-prompt tokens")
    while low < high:  # the fewest guidelines that reach the target
        mid = (low + high) // 2
        if count_tokens("\n\n".join(parts + [_guideline(i) for i in range(mid)])) >= target_tokens:
            high = mid
        else:
            low = mid + 1
    return "\n\n".join(parts + [_guideline(i) for i in range(low)])


TASKS = {
    "A": ("the payment service in services/billing", "test_refund_rounds_half_even",
          "decimal.InvalidOperation: [<class 'decimal.ConversionSyntax'>]", "services/billing/refunds.py"),
    "B": ("the CSV import pipeline in etl/importers", "test_import_skips_blank_rows",
          "KeyError: 'customer_id'", "etl/importers/csv_rows.py"),
    "C": ("the rate limiter in api/middleware", "test_burst_then_steady_state",
          "AssertionError: 429 != 200", "api/middleware/limits.py"),
}
STEPS = [
    "Here is the task. {area} has a failing test, {test}. Find out why it fails and propose a fix.",
    "I ran it for you. The test output ends with:\n```\n{error}\n```\nWhat does that tell you?",
    "The file {file} is below (lines 1-40 of 212).\n```python\n{code}\n```\nWhere is the problem?",
    "Good. Before editing, list the other callers of the function you want to change.",
    "search_code returned 3 matches: {file}:88, {file}:131 and tests/test_{stem}.py:17. Check them.",
    "Make the edit now, the smallest one that fixes {test}.",
    "The test passes now, but tests/test_{stem}.py::test_totals fails with a rounding difference. Why?",
    "Fix that one too, without changing the public signature.",
    "All {n} tests pass. Write the commit message for these changes.",
    "Summarize for the reviewer what changed, why, and what you did not check.",
]


def _code(stem: str, turn: int) -> str:
    lines = [f"def {stem}_step_{i}(rows, options=None):  # helper {i} of {stem}" if i % 4 == 0 else
             f"    value_{i} = rows[{i}] if len(rows) > {i} else None" for i in range(40)]
    return "\n".join(lines)


def user_turn(conversation: str, turn: int) -> str:
    """The user's message of turn `turn` (0-based) of conversation A, B or C; later turns
    cycle through the steps with a round number."""
    area, test, error, file = TASKS[conversation]
    stem = file.rsplit("/", 1)[1].removesuffix(".py")
    text = STEPS[turn % len(STEPS)].format(area=area, test=test, error=error, file=file, stem=stem,
                                           code=_code(stem, turn), n=40 + turn)
    return text if turn < len(STEPS) else f"(round {turn // len(STEPS) + 1}) {text}"


THINK = re.compile(r"<think>.*?(</think>\s*|$)", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """The reply without its `<think>...</think>` part (an unclosed one runs to the end)."""
    return THINK.sub("", text).lstrip()


@dataclass
class Conversation:
    name: str
    system: str
    messages: list[dict] = field(default_factory=list)
    turns_done: int = 0

    def __post_init__(self):
        self.messages = [{"role": "system", "content": self.system}]

    def next_request(self) -> list[dict]:
        """The history plus the next user message (appended)."""
        self.messages.append({"role": "user", "content": user_turn(self.name, self.turns_done)})
        self.turns_done += 1
        return list(self.messages)

    def add_reply(self, text: str, tool_calls: list[dict]) -> None:
        message = {"role": "assistant", "content": strip_reasoning(text)}
        if tool_calls:
            message["tool_calls"] = tool_calls
        self.messages.append(message)


def interleave(names: list[str], turns: int) -> list[str]:
    """A1, B1, A2, B2, ...: the conversation of each request in order."""
    return [name for _ in range(turns) for name in names]


def served_target(model: str | None):
    """(target checkpoint directory, its pack, its tokenizer) of --model, or of the
    bundled demo pair's target (packed and checked on first use)."""
    from monolith.pack.cache import resolve_pack
    from monolith.tokenizer import load_tokenizer

    if model:
        target = Path(model)
    else:
        from monolith.pack.demo import demo_pair

        target, _ = demo_pair()
    pack = resolve_pack(model or target, role="target")
    return target, pack, load_tokenizer(pack)


def system_counter(tok, tools: list[dict]):
    """count(text): the tokens of a system message holding `text` with `tools`, as the
    chat template renders it (system_prompt sizes the prompt with it)."""
    def count(text: str) -> int:
        return len(tok.encode_chat([{"role": "system", "content": text}], tools, add_generation_prompt=False))

    return count
