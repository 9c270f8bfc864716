"""Request bodies drawn from the APIs' published schemas against a live `python -m
monolith.serve` on loopback (issue 48).

Hypothesis draws --requests bodies (default 10,500: an equal share per endpoint) from
the Open Responses OpenAPI document (POST /v1/responses, /v1/responses/compact) and the
`openai` and `anthropic` SDKs' request types (chat, completions, Messages, count_tokens,
input_tokens), half of them with a value of the wrong JSON type at one of their paths
(bench/request_strategies.py). --clients threads send them to the demo server (plain
decoding, replies of at most 8 tokens: --max-output-tokens 8).

Reported per endpoint: the status histogram, the 5xx (0 required: the script exits 1
otherwise) and the 4xx that name no path (OpenAI's and Responses' `param`, Anthropic's
message; 0 required too), with a few of each. Writes bench/results/schema_fuzz.json and
.md (--out-dir for another directory; --port 0 takes a free port).

    python -m bench.schema_fuzz [--requests 10500] [--clients 4] [--seed 0] [--port 8124]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings

from bench.common import free_port
from bench.fuzz import wait_ready
from bench.request_strategies import ENDPOINTS, bodies, names_a_path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "monolith-demo"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_500)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8124, help="0: a free port")
    ap.add_argument("--out", default="schema_fuzz", help="results are written to OUT-DIR/OUT.json and OUT.md")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()
    args.port = args.port or free_port()
    return args


def drawn(endpoint: str, count: int, at_seed: int) -> list:
    """`count` (body, wrong-typed path) cases for `endpoint`, drawn by hypothesis."""
    cases: list = []

    @seed(at_seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(bodies(endpoint, MODEL))
    def draw(case):
        cases.append(case)

    draw()
    return cases[:count]


def send(url: str, work: list, clients: int) -> dict:
    """Each (endpoint, body, path) POSTed; per endpoint the statuses, the 5xx and the 4xx
    naming no path (a few of each kept)."""
    found = {e: {"statuses": collections.Counter(), "server_errors": [], "unnamed_4xx": []} for e in ENDPOINTS}
    lock = threading.Lock()

    def client(part):
        with httpx.Client(base_url=url, timeout=300) as http:
            for endpoint, body, path in part:
                response = http.post(endpoint, json=body)
                status = response.status_code
                unnamed = 400 <= status < 500 and not names_a_path(endpoint, body, _json(response))
                with lock:
                    entry = found[endpoint]
                    entry["statuses"][status] += 1
                    kept = {"body": json.dumps(body)[:400], "wrong_type_at": path, "reply": response.text[:300]}
                    if status >= 500:
                        entry["server_errors"].append(kept)
                    elif unnamed:
                        entry["unnamed_4xx"].append(kept)

    threads = [threading.Thread(target=client, args=(work[i::clients],)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return found


def _json(response: httpx.Response):
    try:
        return response.json()
    except ValueError:
        return None


def markdown(args, result: dict) -> str:
    lines = ["# schema_fuzz", "",
             (f"- {result['requests']} bodies drawn from the published schemas (Open Responses' OpenAPI document, the "
              f"openai and anthropic SDKs' request types), {result['wrong_typed']} with a wrong-typed value at one "
              f"path; {args.clients} clients, {result['seconds']:.0f} s, seed {args.seed}; the demo server, plain "
              "decoding, --max-output-tokens 8"), "",
             "| endpoint | requests | 2xx | 4xx | 5xx | 4xx naming no path |", "|---|---|---|---|---|---|"]
    for endpoint, e in result["endpoints"].items():
        counts = {k: sum(n for s, n in e["statuses"].items() if s.startswith(k)) for k in "245"}
        lines.append(f"| {endpoint} | {sum(e['statuses'].values())} | {counts['2']} | {counts['4']} | "
                     f"{counts['5']} | {e['unnamed_4xx_count']} |")
    lines += ["", f"- 5xx: {result['server_errors']}; 4xx naming no path: {result['unnamed_4xx']}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    per = -(-args.requests // len(ENDPOINTS))
    work = [(endpoint, body, list(path) if path else None) for endpoint in ENDPOINTS
            for body, path in drawn(endpoint, per, args.seed)][:args.requests]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen([sys.executable, "-m", "monolith.serve", "--no-draft", "--port", str(args.port),
                               "--max-context", "4096", "--max-queue", "256", "--max-output-tokens", "8",
                               "--log-level", "error"], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(url)
        started = time.monotonic()
        found = send(url, work, args.clients)
        elapsed = time.monotonic() - started
    finally:
        server.terminate()
        server.wait(30)
    endpoints = {e: {"statuses": {str(k): v for k, v in sorted(f["statuses"].items())},
                     "server_errors_count": len(f["server_errors"]), "unnamed_4xx_count": len(f["unnamed_4xx"]),
                     "server_errors": f["server_errors"][:5], "unnamed_4xx": f["unnamed_4xx"][:5]}
                 for e, f in found.items()}
    result = {"requests": len(work), "wrong_typed": sum(1 for w in work if w[2] is not None), "clients": args.clients,
              "seed": args.seed, "seconds": elapsed, "endpoints": endpoints,
              "server_errors": sum(e["server_errors_count"] for e in endpoints.values()),
              "unnamed_4xx": sum(e["unnamed_4xx_count"] for e in endpoints.values())}
    text = markdown(args, result)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{args.out}.md").write_text(text)
    return 1 if result["server_errors"] or result["unnamed_4xx"] else 0


if __name__ == "__main__":
    sys.exit(main())
