"""What parsing a request body costs the server, per API: the parse of a realistic agent
turn (30 messages: a system prompt, user turns, assistant turns with tool calls, tool
results; 8 tools with JSON schemas), from the decoded JSON body to the request the engine
driving runs, timed over --iterations parses (the median of --repeats runs). The body
is the same conversation in each API's shape: OpenAI chat, Anthropic Messages, the
Responses API (no store), and OpenAI completions (a prompt string).

    python -m bench.request_parse [--iterations 10000] [--repeats 5] [--out-dir bench/results]

Writes request_parse.json and .md."""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

from bench.common import RESULTS, machine, machine_note, package_version, write
from monolith.serving.anthropic.requests import parse_messages_request
from monolith.serving.openai.requests import (
    parse_chat_request,
    parse_completion_request,
)
from monolith.serving.requests import SamplingDefaults
from monolith.serving.responses.requests import parse_request
from monolith.serving.responses.store import ResponseStore

TURNS = 7  # user -> assistant call -> tool result -> assistant call -> tool result -> ... : 4 messages a turn
TOOLS = 8


def schema(i: int) -> dict:
    return {"type": "object", "properties": {"path": {"type": "string", "description": "a file path"},
                                             "line": {"type": "integer"}, "flags": {"type": "array",
                                                                                    "items": {"type": "string"}}},
            "required": ["path"], "additionalProperties": False, "description": f"tool {i}"}


def conversation() -> list[tuple[str, str, dict | None]]:
    """(role, text, call) of the turns: a call is {"id", "name", "input"}."""
    turns = [("user", "Fix the failing test in tests/test_x.py and explain what was wrong.", None)]
    for t in range(TURNS):
        for c in range(2):
            call = {"id": f"call_{t}_{c}", "name": f"tool_{(t + c) % TOOLS}", "input": {"path": f"src/m{t}.py",
                                                                                           "line": 10 * c}}
            turns.append(("assistant", f"Looking at m{t}.py, step {c}.", call))
            turns.append(("tool", f"def f{t}():\n    return {t} * {c}\n" * 8, call))
    return turns[:29]


def chat_body() -> dict:
    messages = [{"role": "system", "content": "You are a coding agent. " * 40}]
    for role, text, call in conversation():
        if role == "assistant":
            messages.append({"role": "assistant", "content": text, "tool_calls": [{
                "id": call["id"], "type": "function",
                "function": {"name": call["name"], "arguments": str(call["input"]).replace("'", '"')}}]})
        elif role == "tool":
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": text})
        else:
            messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"tool {i}",
                                               "parameters": schema(i)}} for i in range(TOOLS)]
    return {"model": "m", "messages": messages, "tools": tools, "tool_choice": "auto", "max_tokens": 512,
            "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}}


def messages_body() -> dict:
    messages = []
    for role, text, call in conversation():
        if role == "assistant":
            messages.append({"role": "assistant", "content": [
                {"type": "text", "text": text},
                {"type": "tool_use", "id": call["id"], "name": call["name"], "input": call["input"]}]})
        elif role == "tool":
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call["id"], "content": text}]})
        else:
            messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
    tools = [{"name": f"tool_{i}", "description": f"tool {i}", "input_schema": schema(i)} for i in range(TOOLS)]
    return {"model": "m", "system": [{"type": "text", "text": "You are a coding agent. " * 40}], "messages": messages,
            "tools": tools, "max_tokens": 512, "stream": True, "metadata": {"user_id": "u"}}


def responses_body() -> dict:
    items = []
    for role, text, call in conversation():
        if role == "assistant":
            items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]})
            items.append({"type": "function_call", "call_id": call["id"], "name": call["name"],
                          "arguments": str(call["input"]).replace("'", '"')})
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": call["id"], "output": text})
        else:
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    tools = [{"type": "function", "name": f"tool_{i}", "description": f"tool {i}", "parameters": schema(i)}
             for i in range(TOOLS)]
    return {"model": "m", "instructions": "You are a coding agent. " * 40, "input": items, "tools": tools,
            "max_output_tokens": 512, "stream": True, "store": False}


def completion_body() -> dict:
    return {"model": "m", "prompt": "def fibonacci(n):\n" * 40, "max_tokens": 64, "temperature": 0.0,
            "stop": ["\n\n"], "logprobs": 2}


def parsers() -> dict:
    defaults, store = SamplingDefaults(), ResponseStore()
    return {"chat": (chat_body(), lambda b: parse_chat_request(b, defaults)),
            "messages": (messages_body(), lambda b: parse_messages_request(b, defaults)),
            "responses": (responses_body(), lambda b: parse_request(b, defaults, store)),
            "completions": (completion_body(), lambda b: parse_completion_request(b, defaults))}


def time_parse(body: dict, parse, iterations: int, repeats: int) -> float:
    """Median microseconds per parse (each parse gets its own copy of the body, made
    outside the timing, since a parser may take it apart)."""
    runs = []
    for _ in range(repeats):
        copies = [copy.deepcopy(body) for _ in range(iterations)]
        start = time.perf_counter()
        for b in copies:
            parse(b)
        runs.append((time.perf_counter() - start) / iterations * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=10000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    rows = []
    for api, (body, parse) in parsers().items():
        parse(copy.deepcopy(body))  # warm: imports, caches
        us = time_parse(body, parse, args.iterations, args.repeats)
        messages = len(body.get("messages") or body.get("input") or [])
        rows.append({"api": api, "messages": messages, "us_per_parse": round(us, 1)})
        print(f"{api:12s} {messages:3d} messages  {us:8.1f} us/parse")
    report = {"machine": machine(), "pydantic": package_version("pydantic"), "iterations": args.iterations,
              "repeats": args.repeats, "rows": rows,
              "notes": [f"the median of {args.repeats} runs of {args.iterations} parses each, one CPU thread",
                        machine_note(machine())]}
    table = "| API | messages | µs per parse |\n|---|---|---|\n" + "".join(
        f"| {r['api']} | {r['messages']} | {r['us_per_parse']} |\n" for r in rows)
    write(report, "request_parse", table, args.out_dir)


if __name__ == "__main__":
    main()
