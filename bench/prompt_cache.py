"""An agent workload replayed over HTTP: does the prompt cache take the shared prefix?

Two conversations (A, B) share a ~8K-token system prompt with tool definitions
(bench/agent_workload.py) and take turns: A1, B1, A2, B2, ... Each turn is one streamed
greedy /v1/chat/completions to `python -m monolith.serve`; the client sends the history
back with only each reply's content (reasoning dropped, as Qwen's template does).

Runs (each a fresh server on the bundled demo pair, or --model / --draft):
- cold: --prompt-cache-size 0 (plain). Interleaving means no request extends the one
  before, so every turn prefills in full; a turn the server still reuses is measured
  again after an unrelated request (its truly cold TTFT).
- warm: the default prompt cache, plain and speculative (--spec-sched fixed: always
  drafts); TTFT, tokens prefilled (prompt_tokens - cached_tokens) against the new tokens
  (the prompt beyond its longest common prefix with any earlier prompt), hit rate,
  /metrics (bytes held, saved states, evictions) scraped through every request.
- restart: a server with --prompt-cache-dir D replays the workload and stops; a new one
  on D answers a new conversation C (same system prompt) first, then A's next turn.
- memory: A, B and C replayed on a server with a small --prompt-cache-size; the bytes
  held must stay within it at every scrape.
- sweep: per --save-every interval, the cold prefill of A1's prompt (the overhead of
  its saves against interval 0), the bytes held, and the worst case: a prompt that
  leaves A1's one token before a saved state (tokens re-prefilled).
- mlx-lm: mlx_lm.server on the same workload (the demo target dequantized to F32,
  bench/mlx_lm_checkpoint.py), its cached_tokens and prompt tokens processed per turn.
Every turn's text and tool calls are compared with the cold (plain) server's, the
speculative variant's too: greedy output must not depend on what was cached. (The text
stands for the tokens: the stream carries no token ids.) Prints markdown tables and
writes bench/results/prompt_cache.json. On the demo pair here (MLX's CPU backend, 2
shared cores) an 8K prefill takes 25-40 s and the default run about 27 minutes, most of
it the cold run's 22 full prefills; --turns, --runs and --system-tokens shorten it.

    python -m bench.prompt_cache [--model M --draft D] [--turns 10] [--system-tokens 8192] [--tools N]
        [--max-tokens 32] [--variants plain,spec] [--save-every 0,256,512,2048]
        [--runs cold,warm,restart,memory,sweep,mlx-lm] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.agent_workload import TOOLS, Conversation, interleave, system_prompt
from bench.common import ROOT
from bench.http_replay import Server, ServerFailed, chat

RESULTS = ROOT / "bench" / "results" / "prompt_cache.json"
RUNS = ("cold", "warm", "restart", "memory", "sweep", "mlx-lm")
CACHE_METRICS = {"bytes": "monolith_prompt_cache_bytes", "budget": "monolith_prompt_cache_budget_bytes",
                 "saved_states": "monolith_prompt_cache_saved_states", "hits": "monolith_prompt_cache_hits_total",
                 "misses": "monolith_prompt_cache_misses_total",
                 "evictions": "monolith_prompt_cache_evictions_total",
                 "disk_bytes": "monolith_prompt_cache_disk_bytes", "disk_files": "monolith_prompt_cache_disk_files",
                 "disk_hits": "monolith_prompt_cache_disk_hits_total",
                 "spec_drafts": "spec_decode_num_drafts_total",  # speculative rounds: does the spec variant draft?
                 "spec_accepted": "spec_decode_num_accepted_tokens_total"}
PROGRESS = re.compile(r"Prompt processing progress: (\d+)/(\d+)")
MLX_CACHE = re.compile(r"Prompt Cache: (\d+) sequences, ([0-9.]+) GB")


def serve_flags() -> set[str]:
    """The long options `python -m monolith.serve` offers (read from its parser: older
    servers lack the prompt-cache flags; deprecated aliases, hidden from --help, are left
    out)."""
    from monolith.serve import build_parser

    return {flag for flag, action in build_parser()._option_string_actions.items()
            if flag.startswith("--") and action.help != argparse.SUPPRESS}


INTERVAL = re.compile(r"prompt cache: .*states saved at message ends(?: and every (\d+) tokens)?")


def logged_interval(log: str) -> int | None:
    """The interval between saved states a monolith server says it uses (0: message ends only)."""
    found = INTERVAL.search(log)
    return None if found is None else int(found.group(1) or 0)


def lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Bench:
    def __init__(self, args, tokenizer, system: str, work: Path):
        self.args = args
        self.tok = tokenizer
        self.system = system
        self.tools = TOOLS[:args.tools]
        self.work = work
        self.flags = serve_flags()
        self.env = {"LD_PRELOAD": args.openblas} if args.openblas else {}
        self.logs = 0

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def monolith(self, variant: str, *flags: str) -> Server:
        a = self.args
        cmd = [sys.executable, "-m", "monolith.serve", "--log-level", "info", "--max-context", str(a.max_context)]
        if a.model:
            cmd += ["--model", a.model] + (["--draft", a.draft] if a.draft and variant == "spec" else [])
        if variant == "plain":
            cmd.append("--no-draft")
        else:
            cmd += ["--spec-sched", "fixed"]  # drafts every round (serve's default drafts only when it pays)
        if a.dtype:
            cmd += ["--dtype", a.dtype]
        return self.server(cmd + list(flags), variant)

    def server(self, cmd: list[str], label: str, **kw) -> Server:
        self.logs += 1
        return Server(cmd, self.work / f"server{self.logs}-{label}.log", env=self.env, **kw)

    # ---- the replay -----------------------------------------------------------------

    def replay(self, server: Server, conversations: dict[str, Conversation], order: list[str],
               seen: list[list[int]], *, cold: bool = False, chat_api=None) -> list[dict]:
        """One request per entry of `order`; `seen` (earlier prompts' tokens) grows."""
        rows = []
        with httpx.Client(timeout=3600) as client:
            for name in order:
                conv = conversations[name]
                messages = conv.next_request()
                ids = self.tok.encode_chat(messages, self.tools, add_generation_prompt=True)
                shared = max((lcp(ids, p) for p in seen), default=0)
                seen.append(ids)
                log_mark = len(server.log_text())
                reply = (chat_api or chat)(client, server.url, messages, self.tools, self.args.max_tokens)
                row = self.row(name, conv.turns_done, ids, shared, reply)
                row["processed"], row["server_cache_before"] = _from_log(server.log_text()[log_mark:])
                if cold and reply.cached_tokens:
                    _flush(client, server.url)
                    again = chat(client, server.url, messages, self.tools, self.args.max_tokens)
                    row.update(cold_ttft_s=again.ttft, cold_cached_tokens=again.cached_tokens,
                               cold_text_equal=again.text == reply.text)
                if server.metrics:
                    row["metrics"] = _cache_metrics(server.scrape())
                conv.add_reply(reply.text, reply.tool_calls)
                rows.append(row)
                print(f"  {name}{conv.turns_done}: prompt {row['prompt_tokens']} cached {row['cached_tokens']} "
                      f"new {row['new_tokens']} TTFT {row['ttft_s']:.2f} s", flush=True)
        return rows

    def row(self, name: str, turn: int, ids: list[int], shared: int, reply) -> dict:
        prompt = reply.usage.get("prompt_tokens")
        cached = reply.cached_tokens
        return {"conversation": name, "turn": turn, "prompt_tokens": prompt, "client_prompt_tokens": len(ids),
                "cached_tokens": cached, "prefilled": None if prompt is None or cached is None else prompt - cached,
                "new_tokens": len(ids) - shared, "shared_with_earlier": shared, "ttft_s": reply.ttft,
                "seconds": reply.seconds, "completion_tokens": reply.usage.get("completion_tokens"),
                "finish_reason": reply.finish_reason, "text": reply.text, "tool_calls": reply.tool_calls}

    def conversations(self, names: str) -> dict[str, Conversation]:
        return {n: Conversation(n, self.system) for n in names}

    # ---- runs -----------------------------------------------------------------------

    def cold(self) -> dict:
        flags = ["--prompt-cache-size", "0"] if self.has("--prompt-cache-size") else []
        convs, seen = self.conversations("ABC"), []
        with self.monolith("plain", *flags) as server:
            rows = self.replay(server, convs, interleave(["A", "B"], self.args.turns), seen, cold=True)
            rows += self.replay(server, convs, ["C", "A"], seen, cold=True)
        return {"variant": "plain", "flags": flags, "turns": rows, "startup_s": server.started_seconds,
                "note": None if flags else "this server has no --prompt-cache-size: cold = the current server"}

    def warm(self, variant: str) -> dict:
        flags = self.interval_flags()
        convs, seen = self.conversations("ABC"), []
        with self.monolith(variant, *flags) as server:
            rows = self.replay(server, convs, interleave(["A", "B"], self.args.turns), seen)
            rows += self.replay(server, convs, ["C", "A"], seen)
        return {"variant": variant, "flags": flags, "turns": rows, "peak": _peak(server.scrapes),
                "startup_s": server.started_seconds, "interval": logged_interval(server.log_text())}

    def interval_flags(self) -> list[str]:
        if self.args.interval is not None and self.has("--prompt-cache-save-every"):
            return ["--prompt-cache-save-every", str(self.args.interval)]
        return []

    def restart(self) -> dict:
        if not self.has("--prompt-cache-dir"):
            return {"skipped": "this server has no --prompt-cache-dir"}
        directory = self.work / "prompt-cache-dir"
        flags = self.interval_flags() + ["--prompt-cache-dir", str(directory)]
        convs, seen = self.conversations("ABC"), []
        with self.monolith("plain", *flags) as first:
            rows = self.replay(first, convs, interleave(["A", "B"], self.args.turns), seen)
        files = sorted(p.name for p in directory.rglob("*") if p.is_file())
        with self.monolith("plain", *flags) as second:
            after = self.replay(second, convs, ["C", "A"], seen)
        return {"variant": "plain", "flags": flags, "turns": rows, "after_restart": after,
                "files_after_first": len(files), "dir_bytes": sum(p.stat().st_size for p in directory.rglob("*")
                                                                   if p.is_file()),
                "peak_first": _peak(first.scrapes), "peak_second": _peak(second.scrapes),
                "interval": logged_interval(second.log_text()),
                "startup_s": [first.started_seconds, second.started_seconds]}

    def memory(self, warm_peak: float | None) -> dict:
        if not self.has("--prompt-cache-size"):
            return {"skipped": "this server has no --prompt-cache-size"}
        budget = self.args.memory_budget or int((warm_peak or 64 * 2**20) * self.args.memory_share)
        flags = self.interval_flags() + ["--prompt-cache-size", str(budget)]
        convs, seen = self.conversations("ABC"), []
        with self.monolith("plain", *flags) as server:
            rows = self.replay(server, convs, interleave(["A", "B", "C"], self.args.turns), seen)
        held = [s.get(CACHE_METRICS["bytes"]) for s in server.scrapes if CACHE_METRICS["bytes"] in s]
        budgets = {s.get(CACHE_METRICS["budget"]) for s in server.scrapes if CACHE_METRICS["budget"] in s}
        return {"variant": "plain", "flags": flags, "budget": budget, "turns": rows, "scrapes": len(held),
                "max_bytes": max(held, default=None), "budget_reported": sorted(budgets),
                "within_budget": bool(held) and max(held) <= budget, "peak": _peak(server.scrapes),
                "interval": logged_interval(server.log_text())}

    def sweep(self, ids: list[int]) -> list[dict]:
        if not self.has("--prompt-cache-save-every"):
            return [{"skipped": "this server has no --prompt-cache-save-every"}]
        other = self.tok.encode(" Unrelated: summarize the release notes of version 2.4 in three bullet points.",
                                add_special_tokens=False)
        rows = []
        for every in self.args.save_every:
            server = self.monolith("plain", "--prompt-cache-save-every", str(every))
            with server, httpx.Client(timeout=3600) as client:
                first = _complete(client, server.url, ids)
                after_first = _cache_metrics(server.scrape())
                # leave A1's prompt one token before a saved state: the worst case
                q = (len(ids) - 1) // every * every - 1 if every else len(ids) - 2
                q = q if q > 0 else len(ids) - 2
                second = _complete(client, server.url, ids[:q] + other)
            cached = second["cached_tokens"]
            rows.append({"save_every": every, "cold_prefill_s": first["seconds"],
                         "prompt_tokens": len(ids), "saved_states": after_first.get("saved_states"),
                         "bytes": after_first.get("bytes"), "diverge_at": q, "second_cached": cached,
                         "second_prefill_s": second["seconds"],
                         "extra_prefilled": None if cached is None else q - cached})
            print(f"  every {every}: cold prefill {first['seconds']:.2f} s, {after_first.get('saved_states')} "
                  f"saved states, {after_first.get('bytes')} bytes; diverging at {q}: {cached} cached", flush=True)
        base = next((r["cold_prefill_s"] for r in rows if r["save_every"] == 0), None)
        for r in rows:
            r["overhead_vs_0"] = None if base is None else r["cold_prefill_s"] / base - 1
        return rows

    def mlx_lm(self, target: Path, target_pack: Path) -> dict:
        from bench.mlx_lm_checkpoint import write_float_checkpoint

        out = {"version": _version("mlx-lm"), "source_load": self.mlx_lm_load(target)}
        unpacked = self.work / "unpacked"
        done = subprocess.run([sys.executable, "-m", "monolith.pack", "unpack", str(target_pack), "--out",
                               str(unpacked)], capture_output=True, text=True, cwd=ROOT, check=False)
        out["unpack"] = {"returncode": done.returncode, "stderr": done.stderr[-2000:]}
        if done.returncode == 0:
            out["unpacked_load"] = self.mlx_lm_load(unpacked)
        model_dir = write_float_checkpoint(target, self.work / "mlx-lm-f32")
        out["converted"] = "the demo target dequantized to F32, experts fused (bench/mlx_lm_checkpoint.py)"
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--log-level", "INFO"]
        convs, seen = self.conversations("AB"), []
        try:
            with self.server(cmd, "mlx-lm", metrics=False) as server:
                try:
                    out["turns"] = self.replay(server, convs, interleave(["A", "B"], self.args.mlx_lm_turns), seen)
                except RuntimeError as e:
                    out["refused"] = str(e)
                log = server.log_text()
        except ServerFailed as e:
            out["failed"] = str(e)
            return out
        out["log_tail"] = log.splitlines()[-40:]
        return out

    def mlx_lm_load(self, path: Path) -> dict:
        code = "import sys, mlx_lm; mlx_lm.load(sys.argv[1])"
        done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT,
                              check=False)
        lines = [line for line in done.stderr.splitlines() if not line.startswith("language_model.")]
        return {"returncode": done.returncode, "stderr_tail": lines[-6:],
                "parameters_refused": len(done.stderr.splitlines()) - len(lines)}


def _from_log(log: str) -> tuple[int | None, dict | None]:
    """mlx-lm's log of one request: the prompt tokens its last progress line says it
    processed, and its "Prompt Cache: N sequences, X GB" line (logged as a request starts)."""
    found, cache = PROGRESS.findall(log), MLX_CACHE.findall(log)
    return (int(found[-1][1]) if found else None,
            {"sequences": int(cache[-1][0]), "gb": float(cache[-1][1])} if cache else None)


def _flush(client: httpx.Client, url: str) -> None:
    client.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}) \
        .raise_for_status()


def _complete(client: httpx.Client, url: str, ids: list[int]) -> dict:
    began = time.perf_counter()
    r = client.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    usage = r.json()["usage"]
    return {"seconds": time.perf_counter() - began,
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def _cache_metrics(values: dict) -> dict:
    return {key: values[name] for key, name in CACHE_METRICS.items() if name in values}


def _peak(scrapes: list[dict]) -> float | None:
    held = [s[CACHE_METRICS["bytes"]] for s in scrapes if CACHE_METRICS["bytes"] in s]
    return max(held, default=None)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# ---- the report ---------------------------------------------------------------------

def key(row: dict) -> tuple[str, int]:
    return row["conversation"], row["turn"]


def cold_ttft(row: dict) -> float:
    return row.get("cold_ttft_s", row["ttft_s"])


def turn_table(title: str, cold: list[dict], runs: dict[str, list[dict]]) -> list[str]:
    ref = {key(r): r for r in cold}
    names = list(runs)
    lines = [f"### {title}", "", "| turn | prompt | new | cold TTFT s | "
             + " | ".join(f"{n} TTFT s | {n} prefilled | {n} same text" for n in names) + " |",
             "|---|---|---|---|" + "---|---|---|" * len(names)]
    order = [key(r) for r in next(iter(runs.values()))]
    for k in order:
        c = ref.get(k)
        cells = [f"{k[0]}{k[1]}", str(_first(runs, k, "prompt_tokens")), str(_first(runs, k, "new_tokens")),
                 f"{cold_ttft(c):.3f}" if c else "-"]
        for n in names:
            r = next((x for x in runs[n] if key(x) == k), None)
            if r is None:
                cells += ["-", "-", "-"]
                continue
            cells += [f"{r['ttft_s']:.3f}", str(r["prefilled"]), "-" if c is None else
                      ("yes" if (r["text"], r["tool_calls"]) == (c["text"], c["tool_calls"]) else "NO")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _first(runs: dict, k, field: str):
    for rows in runs.values():
        for r in rows:
            if key(r) == k:
                return r[field]
    return None


def hit_rate(rows: list[dict]) -> dict:
    prompt = sum(r["prompt_tokens"] or 0 for r in rows)
    cached = sum(r["cached_tokens"] or 0 for r in rows)
    return {"requests": len(rows), "requests_hit": sum(1 for r in rows if r["cached_tokens"]),
            "prompt_tokens": prompt, "cached_tokens": cached, "token_hit_rate": cached / prompt if prompt else None}


def goals(report: dict) -> list[dict]:
    cold = {key(r): r for r in report["cold"]["turns"]} if "turns" in report.get("cold", {}) else {}
    out = []

    def goal(name, passed, detail):
        out.append({"goal": name, "pass": passed, "detail": detail})

    for variant, run in report.get("warm", {}).items():
        rows = run["turns"][1:]  # the first request has nothing to reuse
        ratios = {key(r): r["ttft_s"] / cold_ttft(cold[key(r)]) for r in rows if key(r) in cold}
        if ratios:
            above = [f"{r['conversation']}{r['turn']} {ratios[key(r)]:.1%} ({r['new_tokens']} new tokens = "
                     f"{r['new_tokens'] / r['client_prompt_tokens']:.0%} of its prompt)"
                     for r in rows if ratios.get(key(r), 0) > 0.10]
            median = statistics.median(ratios.values())
            goal(f"warm TTFT <= 10% of cold ({variant}, the median turn)", median <= 0.10,
                 f"warm/cold TTFT over {len(ratios)} turns: median {median:.1%}, worst {max(ratios.values()):.1%}"
                 + (f"; above 10%: {', '.join(above)}" if above else ""))
        interval = run.get("interval")
        step = interval or 0
        over = [r for r in rows if r["prefilled"] is None or r["prefilled"] > r["new_tokens"] + step]
        goal(f"prefilled per warm turn <= new + one interval ({variant})", not over,
             f"interval {interval}: {len(rows) - len(over)}/{len(rows)} turns within; worst excess "
             f"{max((r['prefilled'] or 0) - r['new_tokens'] for r in rows)} tokens")
    for variant, run in [("warm " + v, r) for v, r in report.get("warm", {}).items()] + \
            [("restart", report.get("restart", {})), ("memory", report.get("memory", {}))]:
        rows = run.get("turns", []) + run.get("after_restart", [])
        compared = [r for r in rows if key(r) in cold]
        if compared:
            differ = [f"{r['conversation']}{r['turn']}" for r in compared
                      if (r["text"], r["tool_calls"]) != (cold[key(r)]["text"], cold[key(r)]["tool_calls"])]
            goal(f"greedy text equals cold ({variant})", not differ,
                 f"{len(compared) - len(differ)}/{len(compared)} turns equal" + (f"; differ: {differ}" if differ else ""))
    restart = report.get("restart", {})
    if restart.get("after_restart") and cold:
        first = restart["after_restart"][0]
        ratio = first["ttft_s"] / cold_ttft(cold[key(first)])
        goal("restart first TTFT <= 15% of cold", ratio <= 0.15,
             f"{first['conversation']}{first['turn']}: {first['ttft_s']:.3f} s vs cold "
             f"{cold_ttft(cold[key(first)]):.3f} s = {ratio:.1%} ({first['cached_tokens']} cached)")
    memory = report.get("memory", {})
    if "within_budget" in memory:
        goal("memory bound holds", memory["within_budget"],
             f"max {memory['max_bytes']} bytes held over {memory['scrapes']} scrapes, budget {memory['budget']}")
    return out


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def print_report(report: dict) -> None:
    st = report["settings"]
    print(f"\n{st['model']}: system prompt {st['system_tokens']} tokens with {st['tools']} tools, {st['turns']} turns "
          f"per conversation, max_tokens {st['max_tokens']}, save interval {st['save_every_used']}\n")
    cold = report.get("cold", {}).get("turns", [])
    runs = {f"warm {v}": r["turns"] for v, r in report.get("warm", {}).items()}
    if report.get("restart", {}).get("turns"):
        runs["restart"] = report["restart"]["turns"] + report["restart"]["after_restart"]
    if runs:
        print("\n".join(turn_table("TTFT and tokens prefilled per turn", cold, runs)))
    elif cold:
        print("\n".join(turn_table("cold", cold, {"cold": cold})))
    print("### hit rate and memory\n\n| run | requests hit | token hit rate | peak held | budget | saved states "
          "(end) | evictions (end) |\n|---|---|---|---|---|---|---|")
    for name, run in [("cold", report.get("cold", {}))] + [(f"warm {v}", r) for v, r in
                                                             report.get("warm", {}).items()] + \
            [("restart", report.get("restart", {})), ("memory", report.get("memory", {}))]:
        if run.get("turns"):
            h = run["hit_rate"]
            rate = "-" if h["token_hit_rate"] is None else f"{h['token_hit_rate']:.1%}"
            end = (run.get("after_restart") or run["turns"])[-1].get("metrics", {})
            print(f"| {name} | {h['requests_hit']}/{h['requests']} | {rate} | "
                  f"{_mib(run.get('peak', run.get('peak_first')))} | {_mib(end.get('budget'))} | "
                  f"{end.get('saved_states', '-')} | {end.get('evictions', '-')} |")
    if report.get("sweep"):
        print("\n### save interval\n\n| every | cold prefill s | overhead vs 0 | saved states | bytes | "
              "worst-case extra prefilled |\n|---|---|---|---|---|---|")
        for r in report["sweep"]:
            if "skipped" in r:
                print(f"| skipped: {r['skipped']} |")
                continue
            overhead = "-" if r["overhead_vs_0"] is None else f"{r['overhead_vs_0']:+.1%}"
            print(f"| {r['save_every']} | {r['cold_prefill_s']:.2f} | {overhead} | {r['saved_states']} | "
                  f"{_mib(r['bytes'])} | {r['extra_prefilled']} |")
    mlx = report.get("mlx_lm")
    if mlx and mlx.get("turns"):
        print(f"\n### mlx-lm {mlx['version']} (its own weights: texts are not expected to match)\n\n"
              "| turn | prompt | cached | processed (log) | new | TTFT s | its cache before the turn (log) |\n|---|---|---|---|---|---|---|")
        for r in mlx["turns"]:
            held = r["server_cache_before"] and f"{r['server_cache_before']['sequences']} sequences, {r['server_cache_before']['gb']} GB"
            print(f"| {r['conversation']}{r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                  f"{r['processed']} | {r['new_tokens']} | {r['ttft_s']:.3f} | {held} |")
    elif mlx:
        print(f"\nmlx-lm: {mlx.get('failed') or mlx.get('refused')}")
    print("\n### goals\n")
    for g in report["goals"]:
        print(f"- {'PASS' if g['pass'] else 'FAIL'}: {g['goal']}: {g['detail']}")


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked; `variants` and `runs` as lists, `save_every` as ints."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target (default: the bundled demo pair)")
    ap.add_argument("--draft", help="draft of the speculative variant (with --model)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"))
    ap.add_argument("--turns", type=int, default=10, help="turns per conversation (default 10)")
    ap.add_argument("--system-tokens", type=int, default=8192, help="system prompt + tools, in tokens")
    ap.add_argument("--tools", type=int, default=len(TOOLS), choices=range(1, len(TOOLS) + 1), metavar="N",
                    help=f"how many of the workload's {len(TOOLS)} tools the requests carry (default all)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--variants", default="plain,spec", help="warm runs: plain and/or spec (default both)")
    ap.add_argument("--no-draft", action="store_true", help="plain only (same as --variants plain)")
    ap.add_argument("--interval", type=int, help="--prompt-cache-save-every of the warm, restart and "
                                                 "memory runs (default: the server's)")
    ap.add_argument("--save-every", default="0,256,512,2048", help="intervals the sweep measures "
                                                                    "(default 0,256,512,2048)")
    ap.add_argument("--memory-budget", type=int, help="--prompt-cache-size of the memory run "
                                                      "(default: --memory-share of the warm run's peak)")
    ap.add_argument("--memory-share", type=float, default=0.5)
    ap.add_argument("--mlx-lm-turns", type=int, default=3, help="turns per conversation mlx-lm replays")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"which runs (default all: {','.join(RUNS)})")
    ap.add_argument("--openblas", help="LD_PRELOAD this library into the servers (docs/performance.md)")
    ap.add_argument("--keep", type=Path, help="keep the server logs and cache directory here")
    ap.add_argument("--json", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    args.save_every = [int(x) for x in args.save_every.split(",") if x.strip()]
    args.variants = ["plain"] if args.no_draft else [v for v in args.variants.split(",") if v]
    args.runs = [r for r in args.runs.split(",") if r]
    for name in [v for v in args.variants if v not in ("plain", "spec")] + [r for r in args.runs if r not in RUNS]:
        raise SystemExit(f"unknown variant or run: {name}")
    return args


def measure(bench: Bench, report: dict, target: Path, target_pack: Path) -> None:
    """The runs --runs asks for, each into its section of `report`."""
    runs = bench.args.runs
    if "cold" in runs:
        print("cold (plain, --prompt-cache-size 0)", flush=True)
        report["cold"] = bench.cold()
    if "warm" in runs:
        report["warm"] = {}
        for v in bench.args.variants:
            print(f"warm ({v})", flush=True)
            report["warm"][v] = bench.warm(v)
    if "restart" in runs:
        print("restart (plain, --prompt-cache-dir)", flush=True)
        report["restart"] = bench.restart()
    if "memory" in runs:
        print("memory (plain, a small --prompt-cache-size)", flush=True)
        peak = report.get("warm", {}).get("plain", {}).get("peak")
        report["memory"] = bench.memory(peak)
    if "sweep" in runs:
        print("save interval sweep (plain)", flush=True)
        first = Conversation("A", bench.system).next_request()
        report["sweep"] = bench.sweep(bench.tok.encode_chat(first, bench.tools, add_generation_prompt=True))
    if "mlx-lm" in runs:
        print("mlx-lm", flush=True)
        report["mlx_lm"] = bench.mlx_lm(target, target_pack)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out

    from monolith.pack.cache import resolve_pack
    from monolith.tokenizer import load_tokenizer

    if args.model:
        target = Path(args.model)
    else:
        from monolith.pack.demo import demo_pair

        target, _ = demo_pair()
    target_pack = resolve_pack(args.model or target, role="target")
    tok = load_tokenizer(target_pack)

    def count(text: str) -> int:
        return len(tok.encode_chat([{"role": "system", "content": text}], TOOLS[:args.tools],
                                   add_generation_prompt=False))

    system = system_prompt(count, args.system_tokens)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        bench = Bench(args, tok, system, work)
        report = {"benchmark": "prompt_cache",
                  "description": "two interleaved agent conversations sharing a system prompt with tools, "
                                 "streamed greedy chat completions; see bench/prompt_cache.py",
                  "machine": {"platform": platform.platform(), "python": platform.python_version(),
                              "mlx": _version("mlx"), "cpus": os.cpu_count()},
                  "settings": {"model": args.model or "demo pair", "draft": args.draft, "turns": args.turns,
                               "system_tokens": count(system), "tools": args.tools, "max_tokens": args.max_tokens,
                               "variants": args.variants,
                               "openblas": args.openblas,
                               "server_prompt_cache_flags": sorted(f for f in bench.flags if "prompt-cache" in f)}}
        measure(bench, report, target, target_pack)
    for run in [report.get("cold"), *report.get("warm", {}).values(), report.get("restart"), report.get("memory")]:
        if run and run.get("turns"):
            run["hit_rate"] = hit_rate(run["turns"] + run.get("after_restart", []))
    report["settings"]["save_every_used"] = next(
        (r["interval"] for r in [*report.get("warm", {}).values(), report.get("restart", {})] if r.get("interval")
         is not None), args.interval)
    report["goals"] = goals(report)
    report["seconds"] = time.perf_counter() - began
    print_report(report)
    print(f"\n{report['seconds']:.0f} s in all")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
