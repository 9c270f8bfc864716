"""`bench/concurrency.py --soak SECONDS`: mixed load on one server per mode, for the
issue's "no deadlock or starvation" goal.

Eight client threads; every 3-15 s the number of active ones changes (1-8, from a fixed
seed). Each active client sends request after request: random prompt lengths (50-3000
characters of standard-library source) and max_tokens (8-192: --soak-max-tokens), 60% streamed to the end,
20% streamed and closed after 1-16 text deltas (a client that goes away), 20% not
streamed. The server gets a small --max-queue (--soak-max-queue) so that the queue limit
is hit too; a 429 or 503 is counted and the client tries again after 1 s.

Passes when: every request either completed (a finish reason, no more tokens than
max_tokens, exactly max_tokens when the reason is "length"), was closed by its client,
or got 429 / 503; none waited longer than --soak-wait-bound for its first token (the
whole answer, when not streamed); and after the load the server is idle
(monolith_num_requests_running and _waiting back to 0) and healthy. Writes
bench/results/concurrency_soak.json and .md.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from bench.common import Prompts, machine, machine_note, server_command, write
from bench.http_replay import Refused, Server, complete, probe_extra

CLIENTS = 8
KINDS = ("stream", "close", "whole")
KIND_WEIGHTS = (0.6, 0.2, 0.2)


def one_request(client: httpx.Client, url: str, rng: random.Random, prompts: Prompts, extra: dict,
                longest: int = 192) -> dict:
    kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
    prompt, _ = prompts.window(rng, rng.randint(50, 3000))
    max_tokens = rng.randint(8, longest)
    close_after = rng.randint(1, 16) if kind == "close" else None
    outcome = {"kind": kind, "max_tokens": max_tokens}
    try:
        reply = complete(client, url, prompt, max_tokens, stream=kind != "whole", close_after=close_after,
                         extra=extra)
    except Refused as e:
        return outcome | {"status": str(e.status) if e.status in (429, 503) else "error", "detail": str(e)[:300]}
    except httpx.HTTPError as e:
        return outcome | {"status": "error", "detail": f"{type(e).__name__}: {e}"[:300]}
    tokens = reply.usage.get("completion_tokens")
    outcome |= {"wait": reply.ttft, "seconds": reply.seconds, "tokens": tokens, "finish": reply.finish_reason}
    if reply.finish_reason == "closed":
        return outcome | {"status": "closed"}
    problem = None
    if reply.finish_reason not in ("stop", "length"):
        problem = f"finish_reason {reply.finish_reason!r}"
    elif tokens is None or tokens > max_tokens or (reply.finish_reason == "length" and tokens != max_tokens):
        problem = f"{tokens} tokens for max_tokens {max_tokens}, finish {reply.finish_reason}"
    return outcome | ({"status": "error", "detail": problem} if problem else {"status": "ok"})


def load(url: str, seconds: float, seed: int, extra: dict,
         longest: int = 192) -> tuple[list[dict], list[tuple[float, int]]]:
    """(every request's outcome, the (time, active clients) schedule) of one soak."""
    prompts, outcomes, lock = Prompts(), [], threading.Lock()
    active, stop = [CLIENTS], threading.Event()
    schedule_rng = random.Random(seed)

    def client(i: int):
        rng = random.Random(seed * 100 + i + 1)
        with httpx.Client(timeout=300) as http:
            while not stop.is_set():
                if i >= active[0]:
                    time.sleep(0.1)
                    continue
                outcome = one_request(http, url, rng, prompts, extra, longest)
                with lock:
                    outcomes.append(outcome)
                if outcome["status"] in ("429", "503"):
                    time.sleep(1.0)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    start, schedule = time.monotonic(), []
    while (left := seconds - (time.monotonic() - start)) > 0:
        active[0] = schedule_rng.randint(1, CLIENTS)
        schedule.append((round(time.monotonic() - start, 1), active[0]))
        time.sleep(min(left, schedule_rng.uniform(3, 15)))
    stop.set()
    for t in threads:
        t.join()
    return outcomes, schedule


def idle(server: Server, within: float = 30.0) -> bool:
    """The server reports nothing running or waiting (within `within` seconds) and is healthy."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        m = server.scrape()
        if not m.get("monolith_num_requests_running") and not m.get("monolith_num_requests_waiting"):
            return httpx.get(server.url + "/health", timeout=10).status_code == 200
        time.sleep(0.5)
    return False


def summarize(mode: str, outcomes: list[dict], schedule, drained: bool, bound: float) -> dict:
    counts = Counter((o["kind"], o["status"]) for o in outcomes)
    waits = [o["wait"] for o in outcomes if "wait" in o]
    errors = [o for o in outcomes if o["status"] == "error"]
    max_wait = max(waits, default=0.0)
    return {"mode": mode, "requests": len(outcomes),
            "counts": {f"{kind} {status}": n for (kind, status), n in sorted(counts.items())},
            "completion_tokens": sum(o.get("tokens") or 0 for o in outcomes if o["status"] == "ok"),
            "wait_p50_s": float(np.percentile(waits, 50)) if waits else None,
            "wait_p95_s": float(np.percentile(waits, 95)) if waits else None,
            "max_wait_s": max_wait, "wait_bound_s": bound, "errors": len(errors), "first_errors": errors[:10],
            "idle_after": drained, "schedule": schedule,
            "passed": not errors and max_wait <= bound and drained and bool(waits)}


def run_soak(args, batching: bool, max_batch: int) -> int:
    report = {"benchmark": "concurrency_soak", "machine": machine(), "model": args.model or "the bundled demo pair",
              "batching": batching, "seconds": args.soak, "settings": {k: v for k, v in vars(args).items()
                                                                      if k != "out_dir"}, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            command = server_command(args, mode, max_batch if batching else None, args.soak_max_queue)
            print(f"# soak {mode} for {args.soak:.0f} s: {' '.join(command[1:])}", flush=True)
            with Server(command, Path(tmp) / f"soak-{mode}.log", scrape_every=1.0) as server:
                extra = probe_extra(server.url)
                outcomes, schedule = load(server.url, args.soak, args.seed, extra, args.soak_max_tokens)
                run = summarize(mode, outcomes, schedule, idle(server), args.soak_wait_bound)
            report["runs"].append(run | {"command": command[1:]})
            print(f"  {run['requests']} requests, max wait {run['max_wait_s']:.2f} s, {run['errors']} errors, "
                  f"idle after: {run['idle_after']}: {'PASS' if run['passed'] else 'FAIL'}", flush=True)
    lines = ["| mode | requests | outcomes | tokens | wait p50 / p95 / max s | bound s | errors | idle after | result |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        counts = ", ".join(f"{k}: {n}" for k, n in r["counts"].items())
        lines.append(f"| {r['mode']} | {r['requests']} | {counts} | {r['completion_tokens']} "
                     f"| {r['wait_p50_s'] or 0:.2f} / {r['wait_p95_s'] or 0:.2f} / {r['max_wait_s']:.2f} "
                     f"| {r['wait_bound_s']:.0f} | {r['errors']} | {r['idle_after']} "
                     f"| {'pass' if r['passed'] else 'FAIL'} |")
    table = "\n".join(lines)
    report["notes"] = [machine_note(report["machine"]),
                       (f"model: {report['model']}; {args.soak:.0f} s per mode, max-batch "
                        f"{max_batch if batching else 'none (the server has no --max-batch: FIFO)'}, "
                        f"max-queue {args.soak_max_queue}")]
    print("\n".join(report["notes"]) + "\n\n" + table)
    write(report, "concurrency_soak", table, args.out_dir)
    return 0 if all(r["passed"] for r in report["runs"]) else 1
