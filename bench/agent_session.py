"""Agent sessions replayed side by side: monolith's server and mlx-lm's on the same weights.

What a coding agent does every turn: resend the whole conversation (a long system prompt
with tools, then tool calls and their results), a few hundred new tokens each time, and
wait for the first streamed token. This bench replays scripted sessions of that shape
against `python -m monolith.serve` and `mlx_lm.server`, both started here on the same
weights (the demo target by default; mlx-lm loads its float copy, written by
bench/mlx_lm_checkpoint.py) with the same BLAS (`--openblas` preloads one into both):

- one session per `--prefixes` entry (default a 6K and a Claude Code-sized 32K prefix:
  system prompt + the workload's tools, bench/agent_workload.py);
- turn 1 is the cold prefill of the prefix and a task; each later turn adds the
  assistant's tool call (scripted: the history does not depend on either model's reply)
  and a tool result of about `--new-tokens` tokens (a window of the standard library's
  sources);
- one turn (`--edit-turn`) is edited the way agents edit their history: the client
  clears the first tool result ("[cleared]"), so only the prefix before it is shared.

The same requests go to both servers, alternating which is asked first each turn. Per
turn: TTFT (request sent -> first content, reasoning or tool-call delta), prompt and
cached tokens as each server's usage reports them, decode tok/s (completion tokens after
the first over the time from first to last delta). The warm turn is the median TTFT of
turns 2..N (the edited turn and the one after it apart), and the ratio monolith / mlx-lm
is taken within this one run. After the sessions, streaming's cost: the last request
again (its prompt cached) with `--decode-tokens`, streamed and not, alternating, three
times each: completion tokens over the request's wall time, streamed / non-streamed.
Writes bench/results/agent_session.json and .md.

    python -m bench.agent_session [--prefixes 6144,32768] [--turns 8] [--new-tokens 400]
        [--max-tokens 32] [--edit-turn 6] [--decode-tokens 256] [--servers monolith,mlx-lm] [--openblas LIB]
        [--model M] [--server-arg=--flag ...] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.agent_workload import TOOLS, served_target, system_counter, system_prompt
from bench.common import ROOT, Prompts, machine, machine_note, package_version, write
from bench.http_replay import Refused, Server

SERVERS = ("monolith", "mlx-lm")
TASK = ("The test tests/test_refunds.py::test_refund_rounds_half_even fails on main. Find out why, "
        "read whatever files you need with the tools, and fix it with the smallest change.")
PATHS = ("services/billing/refunds.py", "services/billing/money.py", "tests/test_refunds.py",
         "services/billing/ledger.py", "services/billing/api.py", "services/common/decimal_utils.py")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target checkpoint directory (default: the bundled demo target)")
    ap.add_argument("--prefixes", default="6144,32768", help="system prompt + tools, in tokens, one session each")
    ap.add_argument("--turns", type=int, default=8, help="requests per session (default 8)")
    ap.add_argument("--new-tokens", type=int, default=400, help="tokens a turn's tool result adds (about)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens each reply may generate")
    ap.add_argument("--edit-turn", type=int, default=6, help="the turn whose request edits the history (0: none)")
    ap.add_argument("--decode-tokens", type=int, default=256, help="tokens of the streamed / non-streamed decodes")
    ap.add_argument("--servers", default=",".join(SERVERS), help="which servers (default both)")
    ap.add_argument("--max-context", type=int, default=40960)
    ap.add_argument("--openblas", help="LD_PRELOAD this library into both servers (docs/performance.md)")
    ap.add_argument("--server-arg", action="append", default=[], help="one more flag for monolith.serve")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--name", default="agent_session", help="the result files' name")
    args = ap.parse_args(argv)
    args.prefixes = [int(p) for p in args.prefixes.split(",") if p.strip()]
    args.servers = [s for s in args.servers.split(",") if s]
    for s in args.servers:
        if s not in SERVERS:
            raise SystemExit(f"unknown server {s!r} (known: {', '.join(SERVERS)})")
    if args.turns < 2:
        raise SystemExit("--turns must be at least 2 (turn 1 is the cold one)")
    return args


class Session:
    """A scripted agent session: the history grows by a tool call and its result a turn."""

    def __init__(self, system: str, tool_result_chars: int, seed: int):
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": TASK}]
        self.chars = tool_result_chars
        self.rng = random.Random(seed)
        self.corpus = Prompts()
        self.calls = 0

    def add_tool_turn(self) -> None:
        path = PATHS[self.calls % len(PATHS)]
        call_id = f"call_{self.calls:04d}"
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}]})
        text, _ = self.corpus.window(self.rng, self.chars)
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        self.calls += 1

    def clear_first_result(self) -> None:
        """What an agent's context editing does: the oldest tool result replaced."""
        first = next(m for m in self.messages if m["role"] == "tool")
        first["content"] = "[cleared: an old tool result, to save context]"


def ask(client: httpx.Client, url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat completion with the workload's tools: TTFT and usage."""
    body = {"messages": messages, "tools": TOOLS, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    usage = {}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise Refused("/v1/chat/completions", r.status_code, r.text)
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise Refused("/v1/chat/completions", 500, line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
                    last = time.perf_counter()
                    first = first or last
    end = time.perf_counter()
    completion = usage.get("completion_tokens") or 0
    decode = (last or end) - (first or end)
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": (first or end) - start, "seconds": end - start, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"), "completion_tokens": completion,
            "decode_tok_s": (completion - 1) / decode if completion > 1 and decode > 0 else None}


def ask_whole(client: httpx.Client, url: str, messages: list[dict], max_tokens: int) -> dict:
    """The same request not streamed: its wall time and usage."""
    body = {"messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise Refused("/v1/chat/completions", r.status_code, r.text)
    return {"seconds": time.perf_counter() - start, "completion_tokens": r.json()["usage"]["completion_tokens"]}


def streaming(servers: dict[str, Server], messages: list[dict], tokens: int) -> dict:
    """Per server: tok/s (completion tokens over wall time) of the same cached request
    streamed and not, alternating three times each, medians, and streamed / non-streamed."""
    out = {}
    with httpx.Client(timeout=3600) as client:
        for name, server in servers.items():
            streamed, whole = [], []
            for _ in range(3):
                s = ask(client, server.url, messages, tokens)
                streamed.append(s["completion_tokens"] / s["seconds"])
                w = ask_whole(client, server.url, messages, tokens)
                whole.append(w["completion_tokens"] / w["seconds"])
            out[name] = {"completion_tokens": s["completion_tokens"], "streamed_tok_s": statistics.median(streamed),
                         "non_streamed_tok_s": statistics.median(whole),
                         "ratio": statistics.median(streamed) / statistics.median(whole)}
            print(f"  {name}: streamed / non-streamed {out[name]['ratio']:.2f} "
                  f"({s['completion_tokens']} tokens)", flush=True)
    return out


def replay(servers: dict[str, Server], session: Session, args) -> list[dict]:
    """Every turn to every server, alternating which goes first."""
    rows = []
    with httpx.Client(timeout=3600) as client:
        for turn in range(1, args.turns + 1):
            if turn > 1:
                session.add_tool_turn()
            edited = turn == args.edit_turn
            if edited:
                session.clear_first_result()
            names = list(servers) if turn % 2 else list(reversed(servers))
            row = {"turn": turn, "edited": edited}
            for name in names:
                row[name] = ask(client, servers[name].url, session.messages, args.max_tokens)
            rows.append(row)
            print(f"  turn {turn}{' (edited)' if edited else ''}: " + "; ".join(
                f"{n} TTFT {row[n]['ttft_s']:.3f} s, prompt {row[n]['prompt_tokens']}, cached "
                f"{row[n]['cached_tokens']}" for n in servers), flush=True)
    return rows


def summary(rows: list[dict], names: list[str], edit_turn: int) -> dict:
    """Median warm-turn TTFT per server (turns 2..N but the edited one and the next), the
    edited turn's, and monolith / mlx-lm."""
    warm = [r for r in rows if r["turn"] > 1 and r["turn"] not in (edit_turn, edit_turn + 1)]
    out = {}
    for name in names:
        rates = [r[name]["decode_tok_s"] for r in rows if r[name]["decode_tok_s"]]
        out[name] = {"cold_ttft_s": rows[0][name]["ttft_s"],
                     "warm_ttft_s": statistics.median(r[name]["ttft_s"] for r in warm) if warm else None,
                     "edited_ttft_s": next((r[name]["ttft_s"] for r in rows if r["edited"]), None),
                     "decode_tok_s": statistics.median(rates) if rates else None}
    if len(names) == 2 and all(out[n]["warm_ttft_s"] for n in names):
        a, b = (out[n] for n in SERVERS)
        out["ratio"] = {k: a[k] / b[k] for k in ("cold_ttft_s", "warm_ttft_s", "edited_ttft_s", "decode_tok_s")
                        if a[k] and b[k]}
    return out


def start_servers(args, target: Path, work: Path) -> dict[str, Server]:
    env = {"LD_PRELOAD": args.openblas, "OPENBLAS_NUM_THREADS": "1"} if args.openblas else {}
    servers = {}
    if "monolith" in args.servers:
        cmd = [sys.executable, "-m", "monolith.serve", "--log-level", "info", "--max-context", str(args.max_context),
               *(["--model", args.model] if args.model else []), *args.server_arg]
        servers["monolith"] = Server(cmd, work / "monolith.log", env=env, metrics=False)
    if "mlx-lm" in args.servers:
        from bench.mlx_lm_checkpoint import write_float_checkpoint

        model_dir = write_float_checkpoint(target, work / "mlx-lm-f32")
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--log-level", "WARNING"]
        servers["mlx-lm"] = Server(cmd, work / "mlx-lm.log", env=env, metrics=False)
    return servers


def table(report: dict) -> str:
    names = report["settings"]["servers"]
    lines = ["| prefix | turn | " + " | ".join(f"{n} TTFT s | {n} cached / prompt" for n in names) + " |",
             "|---|---|" + "---|---|" * len(names)]
    for s in report["sessions"]:
        for r in s["turns"]:
            cells = " | ".join(f"{r[n]['ttft_s']:.3f} | {r[n]['cached_tokens']} / {r[n]['prompt_tokens']}"
                               for n in names)
            lines.append(f"| {s['prefix_tokens']} | {r['turn']}{' edited' if r['edited'] else ''} | {cells} |")
    lines += ["", "| prefix | server | cold TTFT s | warm TTFT s (median) | edited TTFT s | decode tok/s |",
              "|---|---|---|---|---|---|"]
    for s in report["sessions"]:
        for n in names:
            m = s["summary"][n]
            lines.append(f"| {s['prefix_tokens']} | {n} | " + " | ".join(
                "-" if m[k] is None else f"{m[k]:.3f}" if k != "decode_tok_s" else f"{m[k]:.1f}"
                for k in ("cold_ttft_s", "warm_ttft_s", "edited_ttft_s", "decode_tok_s")) + " |")
        if "ratio" in s["summary"]:
            ratio = s["summary"]["ratio"]
            lines.append(f"| {s['prefix_tokens']} | monolith / mlx-lm | " + " | ".join(
                f"{ratio[k]:.2f}x" if k in ratio else "-"
                for k in ("cold_ttft_s", "warm_ttft_s", "edited_ttft_s", "decode_tok_s")) + " |")
    lines += ["", "| server | decode tokens | streamed tok/s | non-streamed tok/s | streamed / non-streamed |",
              "|---|---|---|---|---|"]
    for n, m in report.get("streaming", {}).items():
        lines.append(f"| {n} | {m['completion_tokens']} | {m['streamed_tok_s']:.1f} | {m['non_streamed_tok_s']:.1f} "
                     f"| {m['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    target, _, tok = served_target(args.model)
    count = system_counter(tok, TOOLS)
    began = time.perf_counter()
    report = {"benchmark": "agent_session", "machine": machine(),
              "settings": {"model": args.model or "demo target", "turns": args.turns, "new_tokens": args.new_tokens,
                           "max_tokens": args.max_tokens, "edit_turn": args.edit_turn, "servers": args.servers,
                           "mlx_lm": package_version("mlx-lm"), "openblas": args.openblas,
                           "server_args": args.server_arg},
              "sessions": []}
    chars = args.new_tokens * len(TASK) // max(1, len(tok.encode(TASK, add_special_tokens=False)))
    with tempfile.TemporaryDirectory() as tmp:
        servers = start_servers(args, target, Path(tmp))
        try:
            for s in servers.values():
                s.__enter__()
            for i, prefix in enumerate(args.prefixes):
                print(f"session over a {prefix}-token prefix", flush=True)
                session = Session(system_prompt(count, prefix), chars, seed=i)
                rows = replay(servers, session, args)
                report["sessions"].append({"prefix_tokens": prefix, "turns": rows,
                                           "summary": summary(rows, list(servers), args.edit_turn)})
            print("streaming's cost", flush=True)
            report["streaming"] = streaming(servers, session.messages, args.decode_tokens)
        finally:
            for s in servers.values():
                s.stop()
    report["seconds"] = time.perf_counter() - began
    if args.openblas:
        report["machine"]["blas"], report["machine"]["openblas_threads"] = args.openblas, "1"
    report["notes"] = [machine_note(report["machine"]),
                       "TTFT: request sent -> first streamed content, reasoning or tool-call delta; warm: median "
                       "of turns 2..N but the edited turn and the one after it; same requests to both servers, "
                       "alternating which goes first"]
    text = table(report)
    print(text)
    write(report, args.name, text, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
