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
The runs live in bench/prompt_cache_runs.py, the tables and goals in
bench/prompt_cache_report.py.

    python -m bench.prompt_cache [--model M --draft D] [--turns 10] [--system-tokens 8192] [--tools N]
        [--max-tokens 32] [--variants plain,spec] [--save-every 0,256,512,2048]
        [--runs cold,warm,restart,memory,sweep,mlx-lm] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.agent_workload import TOOLS, Conversation, served_target, system_counter, system_prompt
from bench.common import ROOT, package_version
from bench.prompt_cache_report import goals, hit_rate, print_report
from bench.prompt_cache_runs import Bench

RESULTS = ROOT / "bench" / "results" / "prompt_cache.json"
RUNS = ("cold", "warm", "restart", "memory", "sweep", "mlx-lm")


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

    target, target_pack, tok = served_target(args.model)
    count = system_counter(tok, TOOLS[:args.tools])

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
                              "mlx": package_version("mlx"), "cpus": os.cpu_count()},
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
