"""Time to first token of a Claude Code turn, cold and warm, on a ~32,700-token prefix
(issue 32): does turn 2 prefill only what is new?

Claude Code sends a long system prompt and tool list with every request, and puts a
per-request `x-anthropic-billing-header: ... cch=<5 hex digits>;` line first in the system
prompt. The server drops that line, so turn 2's prompt extends turn 1's. The bench
starts `python -m monolith.serve` (the demo pair, plain decoding, --max-context 65536)
and sends, as Claude Code does (streamed /v1/messages with thinking adaptive, effort
high, context_management, cache_control marks):

- turn 1 (cold) and turn 2 (the reply and a new user message added, a new cch): the
  header as Claude Code writes it;
- the same two turns with the line renamed (`x-billing-note:`), which the server does
  not drop: what every warm turn cost before.

The system text is bench/agent_workload.py's, sized with /v1/messages/count_tokens to
--prefix-tokens. Reported per turn: TTFT (request sent -> first content delta), the
usage's input_tokens and cache_read_input_tokens, and the warm/cold ratios. Writes
bench/archive/results/claude_code_prefix.json and .md.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \
        python -m bench.archive.claude_code_prefix [--prefix-tokens 32700]

Archived, a finished study (issue 32): the line is dropped and turn 2 prefills only what is
new (bench/archive/results/claude_code_prefix.md: warm/cold TTFT 0.005 against 0.837);
tests/test_anthropic_agents.py checks that the line is not part of the prompt.
"""

from __future__ import annotations

import argparse
import json
import platform
import secrets
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.agent_workload import TOOLS, system_prompt, user_turn
from bench.common import ROOT
from bench.http_replay import Server

KEY = "bench-key"
HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
TOOLS_ANTHROPIC = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def system_blocks(text: str, header: str) -> list[dict]:
    line = f"{header}: cc_version=2.1.332.a1b; cc_entrypoint=cli; cch={secrets.token_hex(3)[:5]};"
    return [{"type": "text", "text": line},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]


def body(system: list[dict], messages: list[dict], max_tokens: int) -> dict:
    return {"model": "monolith-demo", "max_tokens": max_tokens, "stream": True, "system": system,
            "messages": messages, "tools": TOOLS_ANTHROPIC, "thinking": {"type": "adaptive"},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "bench"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}


def turn(client: httpx.Client, url: str, request: dict) -> dict:
    """One streamed turn: TTFT, usage, the reply's text."""
    sent = time.perf_counter()
    first, usage, text = None, {}, []
    with client.stream("POST", url + "/v1/messages", json=request, headers=HEADERS) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:400]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "content_block_delta" and first is None:
                first = time.perf_counter() - sent
            if event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
                text.append(event["delta"]["text"])
            if event["type"] == "message_delta":
                usage = event["usage"]
    return {"ttft_s": first, "input_tokens": usage.get("input_tokens"),
            "cache_read_input_tokens": usage.get("cache_read_input_tokens"), "text": "".join(text)}


def conversation(client: httpx.Client, url: str, text: str, header: str, max_tokens: int) -> list[dict]:
    messages = [{"role": "user", "content": user_turn("A", 0)}]
    first = turn(client, url, body(system_blocks(text, header), messages, max_tokens))
    messages += [{"role": "assistant", "content": first["text"] or "(no text)"},
                 {"role": "user", "content": user_turn("A", 1)}]
    second = turn(client, url, body(system_blocks(text, header), messages, max_tokens))
    return [first, second]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=32700)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "archive" / "results" / "claude_code_prefix")
    args = ap.parse_args()
    command = [sys.executable, "-m", "monolith.serve", "--no-draft", "--max-context", "65536", "--api-key", KEY]
    with tempfile.TemporaryDirectory() as tmp, Server(command, Path(tmp) / "serve.log", metrics=False) as server, \
            httpx.Client(timeout=3600) as client:
        def count(text: str) -> int:
            request = body(system_blocks(text, "x-anthropic-billing-header"), [{"role": "user", "content": "hi"}], 1)
            del request["stream"], request["max_tokens"], request["metadata"]
            r = client.post(server.url + "/v1/messages/count_tokens", json=request, headers=HEADERS)
            r.raise_for_status()
            return r.json()["input_tokens"]

        text = system_prompt(count, args.prefix_tokens)
        prefix = count(text)
        runs = {"dropped": conversation(client, server.url, text, "x-anthropic-billing-header", args.max_tokens),
                "kept": conversation(client, server.url, text, "x-billing-note", args.max_tokens)}
    result = {"prefix_tokens": prefix, "max_tokens": args.max_tokens, "machine": platform.platform(),
              "runs": {k: [{n: v for n, v in t.items() if n != "text"} for t in turns] for k, turns in runs.items()}}
    for name, (cold, warm) in result["runs"].items():
        result[f"warm_over_cold_{name}"] = warm["ttft_s"] / cold["ttft_s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    table = report(result)
    args.out.with_suffix(".md").write_text(table)
    print(table)


def report(result: dict) -> str:
    lines = [f"# Claude Code turns on a {result['prefix_tokens']}-token prefix (demo pair, plain, "
             f"{result['machine']})", "",
             "| billing-header line | turn | TTFT s | input_tokens | cache_read_input_tokens |",
             "|---|---|---|---|---|"]
    for name, label in (("dropped", "x-anthropic-billing-header (dropped)"), ("kept", "renamed (kept: before)")):
        for i, t in enumerate(result["runs"][name]):
            lines.append(f"| {label} | {i + 1} ({'cold' if i == 0 else 'warm'}) | {t['ttft_s']:.2f} | "
                         f"{t['input_tokens']} | {t['cache_read_input_tokens']} |")
    lines += ["", f"Warm / cold TTFT: {result['warm_over_cold_dropped']:.3f} with the line dropped, "
                  f"{result['warm_over_cold_kept']:.3f} with it kept (the same run).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
