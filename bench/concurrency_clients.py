"""The clients of bench/concurrency.py: its requests (windows of the standard library's
sources, every prompt distinct), C client threads streaming them to a server, and what a
run of them measured (aggregate and steady tok/s, TTFT percentiles, the repeats' medians,
the outputs that differ from a reference's)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np

from bench.common import Prompts
from bench.http_replay import complete

PROMPT_CHARS = (100, 400, 1000, 2000)  # the mix of prompt lengths (characters; the demo: ~35-550 tokens)


@dataclass(frozen=True)
class Request:
    id: str
    prompt: str
    max_tokens: int
    source: str  # file:offset of the window


@dataclass
class Result:
    id: str
    sent: float  # seconds after the run's first send
    ttft: float
    seconds: float
    decode_seconds: float
    tokens: int
    prompt_tokens: int
    finish_reason: str | None
    text: str


# ------------------------------------------------------------------ prompts


def request_lists(counts: dict[int, int], max_tokens: int, seed: int, repeat: int = 1) -> dict:
    """For each client count C, `repeat` lists of N requests (C -> [[N requests], ...]),
    every prompt distinct (so the prompt cache serves none from an earlier list), and
    under "warmup" one short request of each prompt length (sent to a new server first)."""
    rng, prompts, seen = random.Random(seed), Prompts(), set()

    def one(key, n: int, name: str) -> list[Request]:
        out = []
        while len(out) < n:
            chars = PROMPT_CHARS[len(out)] if key == "warmup" else rng.choice(PROMPT_CHARS)
            prompt, source = prompts.window(rng, chars)
            if prompt[:200] in seen:
                continue
            seen.add(prompt[:200])
            out.append(Request(f"{name}-{len(out)}", prompt, 8 if key == "warmup" else max_tokens, source))
        return out

    lists: dict = {"warmup": one("warmup", len(PROMPT_CHARS), "warmup")}
    for c, n in counts.items():
        lists[c] = [one(c, n, f"c{c}" if r == 0 else f"c{c}r{r}") for r in range(repeat)]
    return lists


# ------------------------------------------------------------------ clients


def send(client: httpx.Client, url: str, req: Request, extra: dict, start: float) -> Result:
    sent = time.perf_counter() - start
    reply = complete(client, url, req.prompt, req.max_tokens, extra=extra)
    return Result(req.id, sent, reply.ttft, reply.seconds, reply.decode_seconds,
                  reply.usage.get("completion_tokens", 0), reply.usage.get("prompt_tokens", 0), reply.finish_reason,
                  reply.text)


def run_clients(url: str, reqs: list[Request], clients: int, extra: dict) -> tuple[list[Result], float]:
    """Send reqs from `clients` threads, each taking the next request when its last one
    ended; (results in request order, wall seconds from the first send to the last end)."""
    results: list[Result | None] = [None] * len(reqs)
    errors: list[BaseException] = []
    lock, next_index = threading.Lock(), [0]

    def worker():
        with httpx.Client(timeout=900) as client:
            while not errors:
                with lock:
                    i = next_index[0]
                    next_index[0] += 1
                if i >= len(reqs):
                    return
                try:
                    results[i] = send(client, url, reqs[i], extra, start)
                except BaseException as e:  # noqa: BLE001 - re-raised below, on the main thread
                    errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    start = time.perf_counter()  # before the threads: every send is after it
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return results, wall


def steady(results: list[Result], wall: float) -> tuple[float, float]:
    """(tok/s while every client was busy, the share of the wall after that): the window
    ends when the first request in flight at the last send ends; a stream's tokens count
    up linearly from its first to its last text delta."""
    last_send = max(r.sent for r in results)
    end = min(r.sent + r.seconds for r in results if r.sent <= last_send <= r.sent + r.seconds)

    def tokens_by(t: float, r: Result) -> float:
        first = r.sent + r.ttft
        if r.tokens == 0 or t < first:
            return 0.0
        if r.decode_seconds <= 0 or t >= first + r.decode_seconds:
            return float(r.tokens)
        return 1 + (r.tokens - 1) * (t - first) / r.decode_seconds

    return sum(tokens_by(end, r) for r in results) / end, 1 - end / wall


def combine(runs: list[dict]) -> dict:
    """One row from the repeats of a list: the median of each rate, TTFT percentiles over
    every request, summed tokens and seconds, the peak; each repeat kept under "runs"."""
    results = [r for run in runs for r in run["results"]]
    ttft = [r.ttft for r in results]
    tpr = [run["tokens_per_round"] for run in runs if run["tokens_per_round"] is not None]
    return {"results": results, "runs": [{k: v for k, v in run.items() if k != "results"} for run in runs],
            "wall_seconds": sum(run["wall_seconds"] for run in runs),
            "completion_tokens": sum(run["completion_tokens"] for run in runs),
            **{k: float(np.median([run[k] for run in runs])) for k in ("aggregate_tok_s", "steady_tok_s",
                                                                        "drain_share")},
            "per_request_tok_s": median_of(run["per_request_tok_s"] for run in runs),
            "ttft_p50_ms": 1000 * float(np.percentile(ttft, 50)), "ttft_p95_ms": 1000 * float(np.percentile(ttft, 95)),
            "peak_running": max(run["peak_running"] for run in runs),
            "spec_rounds": sum(run["spec_rounds"] for run in runs),
            "tokens_per_round": float(np.median(tpr)) if tpr else None}


def median_of(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def summarize(results: list[Result], wall: float) -> dict:
    tokens = sum(r.tokens for r in results)
    per_request = [(r.tokens - 1) / r.decode_seconds for r in results if r.tokens > 1 and r.decode_seconds > 0]
    ttft = [r.ttft for r in results]
    steady_tok_s, drain = steady(results, wall)
    return {"wall_seconds": wall, "completion_tokens": tokens, "aggregate_tok_s": tokens / wall,
            "steady_tok_s": steady_tok_s, "drain_share": drain,
            "per_request_tok_s": float(np.median(per_request)) if per_request else None,
            "ttft_p50_ms": 1000 * float(np.percentile(ttft, 50)), "ttft_p95_ms": 1000 * float(np.percentile(ttft, 95))}


def mismatches(results: list[Result], reference: dict[str, Result]) -> list[dict]:
    """The requests whose text differs from the reference's, with the first differing character."""
    out = []
    for r in results:
        ref = reference[r.id].text
        if r.text != ref:
            at = next((i for i, (a, b) in enumerate(zip(r.text, ref)) if a != b), min(len(r.text), len(ref)))
            out.append({"id": r.id, "first_difference_at_char": at, "chars": len(r.text), "reference_chars": len(ref)})
    return out
