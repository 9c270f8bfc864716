"""Concurrent streaming clients against a live `python -m monolith.serve` (issue 18).

For each mode (plain: --no-draft; speculative: the draft, with --spec-sched fixed by
default so that it drafts even where the server's break-even would fall back to plain
steps) and each client count C of --clients, --repeat lists (default 3) of N greedy
streamed /v1/completions requests (default N = max(16, 4C)) are each sent twice:

- sequentially: one client, one request at a time, to a server started with
  `--max-batch 1` (the baseline; a server without that flag: as it is);
- concurrently: C client threads (each sends its next request when its previous one
  has ended) to a server started with `--max-batch B` (default: the largest C).

The two servers of a mode run side by side and take each list in turn (sequential,
then concurrent), so that a change in the machine's load (other processes share it)
hits both runs of a repeat alike (a row's ratio is the median of its repeats' own
ratios); --serial-servers starts them one after the other, for a
model of which two copies do not fit in memory. Each server first answers one short
request of each prompt length (a warm-up, not measured).

Prompts are windows of the running Python's standard-library sources (the demo pair's
corpus) of mixed lengths, drawn from a fixed seed; each C gets its own list, so the
prompt cache serves no request from an earlier row. `ignore_eos` is sent when the server
accepts it (probed once), so that outputs run to --max-tokens; without it the code
prompts rarely stop early.

Reported per (mode, C): aggregate tok/s (all completion tokens / wall time); steady tok/s,
the same while all C clients were busy: from the first send until the first request in
flight at the last send ended (each stream's tokens interpolated between its first and
last text delta), so that the end of a finite run, where fewer than C requests remain
(with speculation their lengths in rounds differ), does not count; the share of the wall
time that end took; per-request decode tok/s (median of (tokens - 1) / (last text delta
- first text delta)), TTFT p50 / p95 (request sent -> first text, queueing included),
the concurrent / sequential ratios of the aggregate and the steady tok/s, the peak of
monolith_num_requests_running seen by a /metrics scrape every 0.5 s, the speculative
rounds' tokens per round, and how many concurrent outputs differ from the sequential
text of the same request (batched == alone). With both modes,
also how many speculative sequential outputs differ from the plain ones.

A server whose --help has no --max-batch cannot batch: then only the sequential runs
happen (the table says so); --concurrent-anyway sends the concurrent clients to it all
the same (a FIFO queue: the "before" numbers). Prints a markdown table and writes
bench/results/concurrency.json and .md. `--soak SECONDS` runs bench/soak.py's mixed load
instead (bench/results/concurrency_soak.json and .md). The requests, the client threads and
the per-run statistics are in bench/concurrency_clients.py.

    python -m bench.concurrency [--quick] [--clients 1,2,4,8] [--modes plain,speculative]
        [--requests N] [--repeat 3] [--max-tokens 128] [--max-batch B] [--model M --draft D]
    python -m bench.concurrency --soak 600 [--modes speculative]

The servers inherit the environment: on Linux, run with
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 for the
CPU numbers of bench/results (docs/performance.md: the wheel's own BLAS is slow; on 2 cores a
threaded OpenBLAS spends more time synchronizing than multiplying at these sizes).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench.common import (
    RESULTS,
    machine,
    machine_note,
    server_command,
    supports_max_batch,
    write,
)
from bench.concurrency_clients import (
    combine,
    median_of,
    mismatches,
    request_lists,
    run_clients,
    summarize,
)
from bench.http_replay import Server, probe_extra
from bench.soak import run_soak

MODES = ("plain", "speculative")


# ------------------------------------------------------------------ servers


def served_decoding(server: Server) -> str:
    """What the server's ready line says it serves: "plain decoding" or "draft ..."."""
    match = re.search(r"ready in [\d.]+ s: .*?(\(plain decoding\)|with draft .*)$", server.log_text(), re.MULTILINE)
    return match.group(1).strip("()") if match else "unknown"


class Scrapes:
    """The metrics a server's scrape thread saw between `mark()` and `since()`."""

    def __init__(self, server: Server):
        self.server = server
        self.start = 0
        self.first: dict = {}

    def mark(self) -> None:
        self.first = self.server.scrape()
        self.start = len(self.server.scrapes)

    def since(self) -> dict:
        last = self.server.scrape()
        seen = self.server.scrapes[self.start:]
        running = max((s.get("monolith_num_requests_running", 0) for s in seen), default=0)
        drafts = last.get("spec_decode_num_drafts_total", 0) - self.first.get("spec_decode_num_drafts_total", 0)
        accepted = (last.get("spec_decode_num_accepted_tokens_total", 0)
                    - self.first.get("spec_decode_num_accepted_tokens_total", 0))
        return {"peak_running": int(running), "spec_rounds": int(drafts),
                "tokens_per_round": (1 + accepted / drafts) if drafts else None}


def serve_mode(args, mode: str, lists: dict, servers: list[tuple[str, int | None, bool]], tmp: Path) -> dict:
    """Run every list against each of `servers` ((label, --max-batch or None, concurrent)):
    label -> {command, decoding, extra, rows: C -> row}. The servers run side by side
    and take each list in turn, so a drift of the machine's load between rows hits
    both alike; --serial-servers runs them one after another instead."""
    out = {}
    for group in ([[s] for s in servers] if args.serial_servers else [servers]):
        with ExitStack() as stack:
            live = []
            for label, max_batch, concurrent in group:
                command = server_command(args, mode, max_batch)
                print(f"# {mode} {label}: {' '.join(command[1:])}", flush=True)
                server = stack.enter_context(Server(command, tmp / f"{mode}-{label}.log", scrape_every=0.5))
                extra = probe_extra(server.url)
                run_clients(server.url, lists["warmup"], 1, extra)
                live.append((label, concurrent, server, extra, Scrapes(server)))
                out[label] = {"command": command[1:], "extra": extra, "rows": {}}
            for clients, repeats in lists.items():
                if clients == "warmup":
                    continue
                runs: dict = {label: [] for label, *_ in live}
                for reqs in repeats:  # the servers take turns within each repeat
                    for label, concurrent, server, extra, scrapes in live:
                        scrapes.mark()
                        results, wall = run_clients(server.url, reqs, clients if concurrent else 1, extra)
                        run = {"results": results, **summarize(results, wall), **scrapes.since()}
                        runs[label].append(run)
                        print(f"  {label} C={clients}: {run['aggregate_tok_s']:.1f} tok/s, {wall:.1f} s", flush=True)
                for label, repeated in runs.items():
                    out[label]["rows"][clients] = combine(repeated)
            for label, _, server, _, _ in live:
                out[label]["decoding"] = served_decoding(server)
    return out


# ------------------------------------------------------------------ report


def build_rows(mode: str, seq: dict, conc: dict | None, max_batch: int | None) -> list[dict]:
    rows = []
    for clients, s in seq["rows"].items():
        row = {"mode": mode, "clients": clients, "requests": len(s["results"]),
               "sequential_max_batch": 1 if max_batch is not None else "none (FIFO)",
               "sequential": {k: v for k, v in s.items() if k != "results"}}
        if conc is not None:
            c = conc["rows"][clients]
            pairs = list(zip(c["runs"], s["runs"]))  # each repeat's two runs took turns on the machine
            ratios = [cr["aggregate_tok_s"] / sr["aggregate_tok_s"] for cr, sr in pairs]
            steady_ratios = [cr["steady_tok_s"] / sr["steady_tok_s"] for cr, sr in pairs]
            reference = {r.id: r for r in s["results"]}
            diff = mismatches(c["results"], reference)
            row.update(max_batch=max_batch if max_batch is not None else "none (FIFO)",
                       concurrent={k: v for k, v in c.items() if k != "results"},
                       ratio=median_of(ratios), steady_ratio=median_of(steady_ratios), ratios=ratios,
                       steady_ratios=steady_ratios, mismatches=len(diff), mismatched=diff[:10])
        rows.append(row)
    return rows


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(report: dict) -> str:
    lines = [("| mode | C | requests | max-batch seq / conc | tokens | seq tok/s | conc tok/s | ratio "
              "| steady seq / conc tok/s | steady ratio | end share conc "
              "| per-req tok/s seq / conc | TTFT p50 seq / conc ms | TTFT p95 seq / conc ms | peak running "
              "| tok/round | mismatches |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        s, c = r["sequential"], r.get("concurrent") or {}
        tpr = c.get("tokens_per_round", s.get("tokens_per_round"))
        lines.append(
            f"| {r['mode']} | {r['clients']} | {r['requests']} "
            f"| {r['sequential_max_batch']} / {r.get('max_batch', '-')} "
            f"| {s['completion_tokens']} | {s['aggregate_tok_s']:.1f} | {fmt(c.get('aggregate_tok_s'))} "
            f"| {spread(r, 'ratio')} | {s['steady_tok_s']:.1f} / {fmt(c.get('steady_tok_s'))} "
            f"| {spread(r, 'steady_ratio')} | {fmt(c.get('drain_share'), '.0%')} "
            f"| {fmt(s['per_request_tok_s'])} / {fmt(c.get('per_request_tok_s'))} "
            f"| {s['ttft_p50_ms']:.0f} / {fmt(c.get('ttft_p50_ms'), '.0f')} "
            f"| {s['ttft_p95_ms']:.0f} / {fmt(c.get('ttft_p95_ms'), '.0f')} "
            f"| {c.get('peak_running', s['peak_running'])} | {fmt(tpr, '.2f')} | {r.get('mismatches', '-')} |")
    return "\n".join(lines)


def spread(row: dict, key: str) -> str:
    """A row's median ratio, with the repeats' range when there are several."""
    if row.get(key) is None:
        return "-"
    each = row[key + "s"]
    return f"{row[key]:.2f}" + (f" ({min(each):.2f}-{max(each):.2f})" if len(each) > 1 else "")


def notes(report: dict) -> list[str]:
    out = [machine_note(report["machine"]),
           (f"each row: {report['settings']['repeat']} lists of requests, each sent to the sequential and then the "
            "concurrent server; tok/s are the medians of the repeats, ratios the medians (and range) of each "
            "repeat's own ratio; requests and tokens are totals"),
           (f"model: {report['model']}; max_tokens {report['settings']['max_tokens']}, "
            f"ignore_eos {'sent' if report['ignore_eos'] else 'not accepted by the server'}")]
    for name, server in report["servers"].items():
        out.append(f"{name}: `{' '.join(server['command'])}` -> {server['decoding']}")
    if not report["batching"]:
        out.append("the server has no --max-batch: " + ("concurrent clients against its FIFO queue"
                                                        if report["settings"]["concurrent_anyway"]
                                                        else "sequential runs only"))
    if "spec_vs_plain_mismatches" in report:
        out.append(f"speculative vs plain sequential outputs that differ: {report['spec_vs_plain_mismatches']}")
    return out


# ------------------------------------------------------------------ main


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target (default: the bundled demo pair)")
    ap.add_argument("--draft", help="draft for the speculative mode (the demo pair has its own)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--clients", help="client counts (default 1,2,4,8; --quick 1,4)")
    ap.add_argument("--requests", type=int, help="requests per client count (default max(16, 4C); --quick max(4, C))")
    ap.add_argument("--max-tokens", type=int, help="completion tokens per request (default 128; --quick 48)")
    ap.add_argument("--repeat", type=int, help="lists per client count, each sent to both servers in turn; rows are "
                                               "their medians (default 3; --quick 1)")
    ap.add_argument("--max-batch", type=int, help="--max-batch of the concurrent server (default: the largest C)")
    ap.add_argument("--spec-sched", default="fixed", choices=("fixed", "threshold", "cost", "server-default"),
                    help="speculative mode's --spec-sched (default fixed: always draft; server-default: no flag)")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--server-arg", action="append", default=[], help="one more serve argument (repeatable)")
    ap.add_argument("--concurrent-anyway", action="store_true",
                    help="without --max-batch in the server, send the concurrent clients to its FIFO queue")
    ap.add_argument("--serial-servers", action="store_true",
                    help="start a mode's sequential and concurrent servers one after the other, not side by side "
                         "(when two copies of the model do not fit in memory)")
    ap.add_argument("--quick", action="store_true", help="a ~2 minute smoke run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--soak", type=float, metavar="SECONDS", help="run bench/soak.py's mixed load instead")
    ap.add_argument("--soak-wait-bound", type=float, default=60.0,
                    help="soak: the longest a request may wait for its first token (default 60 s)")
    ap.add_argument("--soak-max-queue", type=int, default=4, help="soak: the server's --max-queue (default 4)")
    ap.add_argument("--soak-max-tokens", type=int, default=192,
                    help="soak: a request's max_tokens is drawn from 8 up to this (default 192)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.soak_max_tokens < 8:
        ap.error("--soak-max-tokens must be at least 8")
    args.modes = [m for m in args.modes.split(",") if m]
    if set(args.modes) - set(MODES):
        ap.error(f"--modes takes {', '.join(MODES)}")
    if args.model and not args.draft and "speculative" in args.modes:
        print("no --draft for --model: the speculative mode is skipped")
        args.modes = [m for m in args.modes if m != "speculative"]
    args.clients = [int(c) for c in (args.clients or ("1,4" if args.quick else "1,2,4,8")).split(",")]
    args.max_tokens = args.max_tokens or (48 if args.quick else 128)
    args.repeat = args.repeat or (1 if args.quick else 3)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    batching = supports_max_batch()
    max_batch = args.max_batch or max(args.clients)
    if args.soak:
        return run_soak(args, batching, max_batch)
    counts = {c: args.requests or (max(4, c) if args.quick else max(16, 4 * c)) for c in args.clients}
    lists = request_lists(counts, args.max_tokens, args.seed, args.repeat)
    concurrent = batching or args.concurrent_anyway
    if not batching:
        print("the server has no --max-batch (no batching yet): "
              + ("concurrent clients go to its FIFO queue" if concurrent else "sequential runs only"))
    report = {"benchmark": "concurrency", "machine": machine(), "model": args.model or "the bundled demo pair",
              "batching": batching, "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
              "requests": {c: [{"id": r.id, "source": r.source, "prompt_chars": len(r.prompt)}
                               for r in (reqs if c == "warmup" else [r for rep in reqs for r in rep])]
                           for c, reqs in lists.items()},
              "servers": {}, "rows": []}
    sequential_text = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            servers = [("sequential", 1 if batching else None, False)]
            if concurrent:
                servers.append(("concurrent", max_batch if batching else None, True))
            runs = serve_mode(args, mode, lists, servers, Path(tmp))
            for label, run in runs.items():
                report["servers"][f"{mode} {label}"] = {k: run[k] for k in ("command", "decoding")}
            seq, conc = runs["sequential"], runs.get("concurrent")
            report["ignore_eos"] = bool(seq["extra"])
            report["rows"] += build_rows(mode, seq, conc, max_batch if batching else None)
            sequential_text[mode] = {r.id: r for row in seq["rows"].values() for r in row["results"]}
    if len(sequential_text) == 2:
        spec = [r for r in sequential_text["speculative"].values()]
        report["spec_vs_plain_mismatches"] = len(mismatches(spec, sequential_text["plain"]))
    report["notes"] = notes(report)
    table = markdown(report)
    print("\n".join(report["notes"]) + "\n\n" + table)
    write(report, "concurrency", table, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
