"""The runs of bench/prompt_cache.py: a server per run (bench/http_replay.py), the agent
workload (bench/agent_workload.py) replayed against it turn by turn, and what each run
measures (TTFT, tokens prefilled against new tokens, /metrics, the save-interval sweep,
mlx-lm's server on the same workload)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.agent_workload import TOOLS, Conversation, interleave
from bench.common import ROOT, package_version
from bench.http_replay import Server, ServerFailed, chat

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

        out = {"version": package_version("mlx-lm"), "source_load": self.mlx_lm_load(target)}
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
