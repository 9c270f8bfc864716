"""The official Open Responses compliance suite against a stock demo server (issue 53,
"done when": the suite passes 17/17 on the stock demo server).

The suite is `bin/compliance-test.ts` of the openresponses/openresponses repository (its
cases in src/lib/compliance-tests.ts: 17 at the pinned commit, 10 over HTTP and 7 over the
WebSocket transport). It is not published on npm, so it runs from a checkout of that
repository, CHECKOUT (default: $OPENRESPONSES_CHECKOUT); nothing of it is copied here. Its
runtime is pinned in tests/clients/openresponses: Bun 1.3.12 (the version the suite's
.tool-versions names) and zod 3.25.76 (its bun.lock's; the suite's one import), installed
there with `npm ci` (tests/clients/install.sh does it where $OPENRESPONSES_CHECKOUT is
set). Bun runs the suite with --no-install and NODE_PATH at those packages, so the run
never reaches the network.

The server is `python -m monolith.serve` on the bundled demo pair, started here on a free
port with its defaults, plus --api-key (the suite sends a key, so its Authorization
header, the WebSocket handshake's too, is checked) and any --server-arg, which the notes
name. The suite sends all its cases at once. Its limits: 30 s for each WebSocket turn's
terminal event (fixed in the suite), and for HTTP Bun's fetch idle timeout, 300 s without
a byte; a reply that does not end runs to --max-output-tokens (32768 by default), which
takes longer than either here.

The suite runs --runs times (default 1) against the one server: the demo pair samples, so
a case can pass in one run and fail in the next. Each case of each run comes with the
suite's own errors and, when it failed, a cause: `model` where what the demo model wrote
explains every error (the reply ran to max_output_tokens without ending; it answered in
text where the case wanted a function_call; the suite gave up waiting, a WebSocket turn
at 30 s or a request at Bun's idle timeout, and the server counted a generation the
client cancelled by leaving, in that run, for every such time-out), `server` otherwise.
Also the server's generations by finish reason, each run. Exit status 1 when a case
failed for a `server` cause. Writes bench/results/openresponses_suite.json and .md
(--out-dir for another directory).

    python -m bench.openresponses_suite [CHECKOUT] [--runs 3] [--filter ID,ID] [--server-arg=FLAG] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import RESULTS, ROOT, machine, machine_note, write
from bench.http_replay import Server, parse_metrics

PINNED = "92c12d96d7b61d6d15e2214daa5e9c6000ab6e1c"  # openresponses/openresponses, 2026-07-15 (its PR #77)
RUNTIME = ROOT / "tests" / "clients" / "openresponses" / "node_modules"
BUN = RUNTIME / ".bin" / "bun"
KEY = "openresponses-suite"
MODEL = "monolith-demo"
# the suite's messages at PINNED for what a reply that never ends (or calls no tool) causes
INCOMPLETE = 'Expected status "completed" but got "incomplete"'
NO_CALL = 'Expected output item of type "function_call" but none found'
TIMEOUTS = ("Timed out waiting for terminal WebSocket response event",  # the suite's 30 s a turn
            "The operation timed out.")  # Bun's fetch: 300 s without a byte
# a turn that timed out, or never ran after one (the suite words it both ways)
NO_RESPONSE = ("(root): Expected object, received null", ": Expected object, received null")
NEVER_RAN = ("but got status no terminal response", "but got no error code")  # a turn's expected end, unseen


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkout", nargs="?", type=Path, default=os.environ.get("OPENRESPONSES_CHECKOUT"),
                    help="a checkout of openresponses/openresponses (default: $OPENRESPONSES_CHECKOUT)")
    ap.add_argument("--filter", help="the suite's case ids to run, comma-separated (default: every case)")
    ap.add_argument("--server-arg", action="append", default=[], help="one more flag for monolith.serve")
    ap.add_argument("--runs", type=int, default=1, help="runs of the whole suite against the one server")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one run of the suite may take")
    ap.add_argument("--out", default="openresponses_suite", help="results go to OUT-DIR/OUT.json and OUT.md")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.checkout is None:
        ap.error("name a checkout of openresponses/openresponses (or set $OPENRESPONSES_CHECKOUT)")
    problem = missing(Path(args.checkout))
    if problem:
        ap.error(problem)
    return args


def missing(checkout: Path) -> str | None:
    """Why the suite cannot run from `checkout` here; None when it can."""
    if not (checkout / "bin" / "compliance-test.ts").is_file():
        return f"{checkout} is not a checkout of openresponses/openresponses (it has no bin/compliance-test.ts)"
    if not BUN.exists():
        return f"the suite's runtime is not installed: npm ci --prefix {RUNTIME.parent.relative_to(ROOT)}"
    return None


def commit(checkout: Path) -> str | None:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def run_suite(args, url: str) -> dict:
    """The suite's --json report: {"summary": ..., "results": [one a case]}."""
    argv = [str(BUN), "--no-install", "run", "bin/compliance-test.ts", "--base-url", url + "/v1", "--api-key", KEY,
            "--model", MODEL, "--json"] + (["--filter", args.filter] if args.filter else [])
    env = {**os.environ, "NODE_PATH": str(RUNTIME), "NO_COLOR": "1"}
    done = subprocess.run(argv, cwd=args.checkout, env=env, capture_output=True, text=True, timeout=args.timeout,
                          check=False)
    try:
        return json.loads(done.stdout)
    except ValueError:
        raise SystemExit(f"the suite wrote no JSON report (exit status {done.returncode}):\n"
                         f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}") from None


def responses(found) -> list[dict]:
    """The response objects in a case's `response` (one, a list of one a turn, or named parts)."""
    if isinstance(found, list):
        return [r for part in found for r in responses(part)]
    if isinstance(found, dict):
        return [found] if "object" in found else [r for part in found.values() for r in responses(part)]
    return []


def explain(error: str, found: list[dict], events: int | None, after_timeout: bool,
            cancelled_enough: bool) -> str | None:
    """What in the model's reply explains one of the suite's errors; None when nothing does.
    `events`: the streaming events the case received (None: it streamed nothing);
    `after_timeout`: the case timed out, and as many of its turns have no answer as the
    time-outs and the errors about turns that never ran account for."""
    if error == INCOMPLETE:
        ran_out = [r for r in found if r.get("status") == "incomplete"
                   and (r.get("incomplete_details") or {}).get("reason") == "max_output_tokens"]
        return (f"the reply ran to max_output_tokens ({ran_out[0]['usage']['output_tokens']} tokens) without ending"
                if ran_out else None)
    if error == NO_CALL:
        ended = [r for r in found if r.get("status") in ("completed", "incomplete")]
        texts = [part.get("text", "") for r in ended for item in r["output"] if item["type"] == "message"
                 for part in item["content"]]
        until = " until max_output_tokens" if any(r["status"] == "incomplete" for r in ended) else ""
        if texts:
            return f"it wrote text{until} ({' '.join(texts)[:80]!r}), calling no tool"
        thoughts = [part.get("text", "") for r in ended for item in r["output"] if item["type"] == "reasoning"
                    for part in item.get("content") or []]
        return f"it wrote only reasoning{until} ({' '.join(thoughts)[:80]!r}), calling no tool" if thoughts else None
    if error in TIMEOUTS and cancelled_enough:  # a turn's events start when it leaves the queue (--max-batch)
        return ("the suite gave up waiting: a reply had not ended, or waited in the queue behind replies that had "
                "not" + (" (no event had arrived: queued)" if events == 0 else "")
                + "; the server cancelled a generation for each time-out")
    if error in NO_RESPONSE and after_timeout:
        return ""  # the timed-out turn itself, or one that never ran after it
    if error.endswith(NEVER_RAN) and after_timeout:
        return "the turns after it never ran"  # a time-out ends the suite's WebSocket session
    return None


def errors_of(result: dict) -> list[str]:
    """The suite's errors for a case, without the turn a WebSocket case's carry in front."""
    return [re.sub(r"^Turn \d+: ", "", e) for e in result.get("errors") or []]


def cause(result: dict, cancelled_enough: bool) -> tuple[str | None, str]:
    """(None, "") for a case that passed or was skipped; ("model", why) where the model's
    reply explains every error; ("server", the unexplained errors) otherwise."""
    if result["status"] != "failed":
        return None, ""
    errors = list(dict.fromkeys(errors_of(result)))
    answers = result.get("response")
    if not isinstance(answers, list):
        answers = list(answers.values()) if isinstance(answers, dict) and "object" not in answers else [answers]
    timeouts = sum(e in TIMEOUTS for e in errors_of(result))
    never_ran = sum(e.endswith(NEVER_RAN) for e in errors)
    after_timeout = timeouts > 0 and sum(a is None for a in answers) >= timeouts + never_ran
    whys = {e: explain(e, responses(answers), result.get("streamEvents"), after_timeout, cancelled_enough)
            for e in errors}
    unexplained = [e for e, why in whys.items() if why is None]
    if unexplained or not errors:
        return "server", "; ".join(unexplained) or "failed without an error"
    return "model", "; ".join(dict.fromkeys(why for why in whys.values() if why))


def finish_reasons(url: str, settle_seconds: float = 300) -> dict[str, int]:
    """The server's finished generations by finish reason (its /metrics), once it has none
    running or waiting (a generation the suite gave up on ends when the server sees the
    client gone), or after `settle_seconds`."""
    deadline = time.monotonic() + settle_seconds
    while True:
        page = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
        busy = parse_metrics(page, ("monolith_num_requests_running", "monolith_num_requests_waiting"))
        if not any(busy.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    found = parse_metrics(page, ("monolith_request_finished_total",))
    return {re.search(r'finish_reason="([^"]*)"', name).group(1): int(value) for name, value in found.items()}


def rows(suite: dict, finished: dict[str, int], run: int) -> list[dict]:
    """One row a case of one run of the suite; `finished`: the server's generations in that run."""
    timeouts = sum(e in TIMEOUTS for r in suite["results"] for e in errors_of(r))
    cancelled_enough = finished.get("cancelled", 0) >= timeouts
    out = []
    for result in sorted(suite["results"], key=lambda r: r["id"]):
        kind, why = cause(result, cancelled_enough)
        out.append({"run": run, "id": result["id"], "name": result["name"], "status": result["status"],
                    "seconds": round((result.get("duration") or 0) / 1000, 1),
                    "stream_events": result.get("streamEvents"), "cause": kind, "why": why,
                    "errors": result.get("errors") or []})
    return out


def run_all(args, url: str) -> tuple[list[dict], list[dict]]:
    """--runs runs of the suite: (one record a run, one row a case a run)."""
    runs, cases = [], []
    before = finish_reasons(url)
    for number in range(1, args.runs + 1):
        suite = run_suite(args, url)
        after = finish_reasons(url)
        finished = {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v > before.get(k, 0)}
        before = after
        runs.append({"run": number, "summary": suite["summary"], "finished": finished})
        cases += rows(suite, finished, number)
        print(f"run {number}: {suite['summary']}", flush=True)
    return runs, cases


def table(cases: list[dict], runs: int) -> str:
    lines = ["| case | passed | failures: run, cause |", "|---|---|---|"]
    for case in dict.fromkeys(c["id"] for c in cases):
        own = [c for c in cases if c["id"] == case]
        failures = "; ".join(f"{c['run']}, {c['cause']}: {c['why']}" for c in own if c["cause"])
        passed = sum(c["status"] == "passed" for c in own)
        lines.append(f"| `{case}` | {passed} of {runs} | {failures.replace('|', '/')} |")
    return "\n".join(lines)


def notes(found_commit: str | None, bun: str, flags: list[str], runs: list[dict], cases: list[dict],
          load: float) -> list[str]:
    by_cause = {k: sum(c["cause"] == k for c in cases) for k in ("model", "server")}
    pin = "the pinned commit" if found_commit == PINNED else f"not the pinned {PINNED[:12]}: the causes may misread it"
    zod = json.loads((RUNTIME / "zod" / "package.json").read_text())["version"]
    passed = ", ".join(f"{r['summary']['passed']}" for r in runs)
    finished = "; ".join(", ".join(f"{k} {v}" for k, v in r["finished"].items()) or "none" for r in runs)
    return [f"the official Open Responses compliance suite (openresponses/openresponses bin/compliance-test.ts at "
            f"{(found_commit or 'an unknown commit')[:12]}, {pin}), run by Bun {bun} (zod {zod}) from a checkout",
            f"server: `python {' '.join(flags)}` on a free port (the bundled demo pair; every setting not named is "
            "its default), sampling as the pair's generation_config says, so a case's result varies from run to run",
            f"{len(runs)} run(s) of {runs[0]['summary']['total']} cases, passed in each: {passed}; of the failures, "
            f"the demo model's reply explains {by_cause['model']} and does not explain {by_cause['server']}",
            f"the server's generations by finish reason, each run: {finished}",
            "the suite's limits: 30 s for a WebSocket turn's terminal event, Bun's 300 s fetch idle timeout for HTTP; "
            f"its cases run at once; load average at the start {load:.2f}",
            machine_note(machine())]


def main(argv=None) -> int:
    args = parse_args(argv)
    bun = subprocess.run([str(BUN), "--version"], capture_output=True, text=True, check=True).stdout.strip()
    load = os.getloadavg()[0]
    flags = ["-m", "monolith.serve", "--api-key", KEY, "--log-level", "info", *args.server_arg]
    with tempfile.TemporaryDirectory() as work, Server([sys.executable, *flags], Path(work) / "server.log",
                                                       env={"HF_HUB_OFFLINE": "1"}, metrics=False) as server:
        runs, cases = run_all(args, server.url)
        if any(c["cause"] == "server" for c in cases):
            print(server.log_text()[-4000:])
    found_commit = commit(Path(args.checkout))
    report = {"notes": notes(found_commit, bun, flags, runs, cases, load),
              "suite": {"repository": "openresponses/openresponses", "commit": found_commit, "pinned": PINNED,
                        "bun": bun},
              "server": {"flags": flags[2:]}, "runs": runs, "cases": cases, "machine": machine()}
    text = table(cases, args.runs)
    print("\n".join(report["notes"]) + "\n\n" + text)
    write(report, args.out, text, args.out_dir)
    return 1 if any(c["cause"] == "server" for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
