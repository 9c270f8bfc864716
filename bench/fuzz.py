"""Hostile requests against a live `python -m monolith.serve` on loopback (issue 20).

A seeded generator writes --requests (default 12,000) requests over every endpoint:
malformed and truncated JSON, random bytes, nesting near and past the parser's depth,
integer literals past Python's 4300-digit limit, 1e999, lone surrogates, every field of
a valid body replaced by a value of another type (or a huge, negative or NaN one),
tool schemas that are not schemas, chat_template_kwargs that clash with the renderer,
hostile Anthropic blocks and Responses items, multi-MiB prompts, foreign Host and
Origin headers, bad Content-Length, wrong methods and unknown paths. Valid requests
generate at most 2 tokens. --clients threads send them at once.

Then --waves waves of --wave-requests valid requests, the RSS after each (where the
memory settles), split by the server's /metrics into the prompt cache, MLX's arrays (the
prompt cache among them), MLX's buffer cache and the rest (the C heap, code, Python).

Reported: the status histogram (0 5xx required: the script exits 1 otherwise), the 4xx
replies not in the API's error shape (uvicorn's plain-text 400 for malformed HTTP is
accepted), the server's RSS (VmRSS) before, its peak during and after, throughput,
and whether the server still answers a plain request at the end. Also the grammar
engines' control-token finding from bench/archive/results/grammar_engines.json (xgrammar lets
<|im_start|> into a JSON string; llguidance allows none). Writes bench/results/fuzz.json
and .md (--out-dir for another directory; --port 0 takes a free port).

    python -m bench.fuzz [--requests 12000] [--clients 8] [--seed 0] [--port 8123]
    python -m bench.fuzz --requests 0 --waves 8 --wave-requests 150 \
        --server-arg=--prompt-cache-size=0 --out fuzz_no_prompt_cache   # memory only
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.common import free_port

ROOT = Path(__file__).resolve().parent.parent
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/responses"]
MSG = [{"role": "user", "content": "hi"}]
VALID = {
    "/v1/chat/completions": {"model": "monolith-demo", "messages": MSG, "max_tokens": 2},
    "/v1/completions": {"model": "monolith-demo", "prompt": "def f(", "max_tokens": 2},
    "/v1/messages": {"model": "monolith-demo", "messages": MSG, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "monolith-demo", "messages": MSG},
    "/v1/responses": {"model": "monolith-demo", "input": "hi", "max_output_tokens": 2},
}
BAD_SCHEMAS = [{"type": "object", "properties": ["x"]}, {"type": "object", "properties": "x"},
               {"type": "object", "properties": {"x": "string"}}, {"type": "object", "required": "x"},
               {"type": "object", "properties": {"x": {"type": "object", "properties": [1]}}}, [], "object", 5,
               {"$ref": "#/nope"}, {"type": "frobnicate"}, {"anyOf": 3}, {"type": "string", "pattern": "("}]


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def junk_value(rng: random.Random):
    return rng.choice([None, True, False, 0, -1, 2**64, -(2**63), 1e308, "", "x" * rng.randint(1, 300), [], {},
                       [None], {"": None}, "\ud83d", "<|im_start|>system", 10**30, [[[[]]]], {"a": {"b": {"c": 1}}}])


def body_mutation(rng: random.Random, path: str) -> dict:
    body = json.loads(json.dumps(VALID[path]))
    kind = rng.randrange(9)
    if kind == 0:  # a field of the wrong type
        body[rng.choice(list(body) + ["stream", "temperature", "top_p", "top_k", "stop", "seed", "logprobs",
                                      "n", "tools", "tool_choice", "response_format", "system", "thinking",
                                      "instructions", "stream_options", "metadata"])] = junk_value(rng)
    elif kind == 1:  # a broken tool schema, maybe forced
        schema = rng.choice(BAD_SCHEMAS)
        if path.startswith("/v1/messages"):
            body["tools"] = [{"name": "t", "input_schema": schema}]
            body["tool_choice"] = rng.choice([{"type": "any"}, {"type": "tool", "name": "t"}, {"type": "auto"}])
        elif path == "/v1/responses":
            body["tools"] = [{"type": "function", "name": "t", "parameters": schema}]
            body["tool_choice"] = rng.choice(["required", "auto"])
        else:
            body["tools"] = [{"type": "function", "function": {"name": "t", "parameters": schema}}]
            body["tool_choice"] = rng.choice(["required", "auto", {"type": "function", "function": {"name": "t"}}])
    elif kind == 2:  # template kwargs that clash, or junk
        body["chat_template_kwargs"] = {rng.choice(["self", "messages", "tools", "add_generation_prompt",
                                                    "bos_token", "enable_thinking", "x" * 50]): junk_value(rng)}
    elif kind == 3:  # hostile messages / blocks / items
        item = rng.choice([{"role": "system"}, {"role": "tool", "content": "x"}, {"role": "assistant"},
                           {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc"}}]},
                           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": 3}]},
                           {"role": "user", "content": [{"type": "thinking"}]}, {"role": "x", "content": "y"},
                           {"type": "function_call_output", "call_id": "nope", "output": "x"}, "hi", 5, None])
        key = "input" if path == "/v1/responses" else "messages"
        body[key] = [item] * rng.randint(1, 3)
    elif kind == 4:  # a structured-output request with a junk schema
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s",
                                                                         "schema": rng.choice(BAD_SCHEMAS)}}
    elif kind == 5:  # a long prompt, up to ~6 MiB
        most = 1_500_000 if rng.random() < 0.05 else 100_000  # past the context's byte bound; rarely ~6 MiB
        text = rng.choice(["a", "def ", "\u00e9", "<|im_start|>"]) * rng.randint(20_000, most)
        if path == "/v1/completions":
            body["prompt"] = text
        elif path == "/v1/responses":
            body["input"] = text
        else:
            body["messages"] = [{"role": "user", "content": text}]
    elif kind == 6:  # limits
        body[rng.choice(["max_tokens", "max_output_tokens", "max_completion_tokens"])] = rng.choice(
            [0, -5, 2**64, 10**5, 1.5, "2"])
    elif kind == 7:  # stop strings
        body[rng.choice(["stop", "stop_sequences"])] = rng.choice([["x"] * 1000, [""], "x" * 100_000, [1, 2]])
    else:  # a valid request, maybe streamed
        body["stream"] = rng.random() < 0.5
    return body


def raw_body(rng: random.Random) -> bytes:
    kind = rng.randrange(10)
    if kind == 0:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 400)))
    if kind == 1:
        return nested(rng.randint(900, 1100))
    if kind == 2:
        return b'{"max_tokens": ' + b"9" * rng.randint(4290, 6000) + b', "messages": [], "prompt": "x"}'
    if kind == 3:
        return b'{"prompt": "' + b"\\ud800" * rng.randint(1, 5) + b'", "messages": [{"role": "user", "content": ' \
               b'"\\udfff"}], "input": "\\ud800"}'
    if kind == 4:
        return b'{"temperature": 1e999, "prompt": "x", "messages": [], "max_tokens": NaN}'
    if kind == 5:
        return b'{"messages": [{"role": "user", "content": "hi"'  # truncated
    if kind == 6:
        return rng.choice([b"", b"null", b"[]", b'"x"', b"5", b"\xef\xbb\xbf{}", b"{}" * 1000])
    if kind == 7:
        return b'{"a": ' * 500 + b"1" + b"}" * 500
    if kind == 8:
        return json.dumps({"prompt": "x", "max_tokens": 1, "x": "y" * 100_000}).encode()
    return b'{"messages": "' + b"\\" * rng.randint(1, 9) + b'"}'


def request_for(rng: random.Random) -> tuple[str, str, bytes, dict]:
    """(method, path, body, headers)."""
    headers = {"Content-Type": "application/json"}
    roll = rng.random()
    if roll < 0.05:  # foreign Host / Origin, junk auth, content-length lies
        h = rng.choice([{"Host": "evil.example"}, {"Origin": "https://evil.example"}, {"Origin": "null"},
                        {"Authorization": "Bearer " + "x" * 5000}, {"Content-Type": "text/plain"},
                        {"x-api-key": "k" * 10_000}])
        headers.update(h)
        path = rng.choice(ENDPOINTS)
        return "POST", path, json.dumps(VALID[path]).encode(), headers
    if roll < 0.09:  # methods and paths
        return (rng.choice(["GET", "PUT", "DELETE", "PATCH", "POST"]),
                rng.choice(["/v1/chat/completions", "/v1/models", "/health", "/metrics", "/v1/responses/" + "x" * 300,
                            "/v1/responses/resp_nope", "/v1/../../etc/passwd", "/%00", "/v1/embeddings", "/"]),
                b"{}", headers)
    path = rng.choice(ENDPOINTS)
    if roll < 0.35:
        return "POST", path, raw_body(rng), headers
    return "POST", path, json.dumps(body_mutation(rng, path)).encode(), headers


def in_shape(response: httpx.Response) -> bool:
    """A 4xx body in the API's error shape (OpenAI's or Anthropic's), or uvicorn's
    plain-text reply to malformed HTTP."""
    if response.headers.get("content-type", "").startswith("text/plain"):
        return "Invalid HTTP request" in response.text
    try:
        body = response.json()
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and bool(error["message"])


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_waves(url: str, pid: int, waves: int, per_wave: int, seed: int) -> list[dict]:
    """After the hostile run: waves of valid requests (prompts of 50-6000 characters of
    the standard library's source, 4 tokens each), the RSS and the prompt cache's bytes
    after each wave, to show where the memory settles."""
    rng = random.Random(seed + 1)
    source = Path(os.__file__).read_text()
    out = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for wave in range(waves):
            for _ in range(per_wave):
                start = rng.randrange(len(source) - 7000)
                prompt = source[start:start + rng.choice([50, 300, 1500, 6000])]
                http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
            metrics = {line.split()[0]: float(line.split()[-1]) for line in http.get("/metrics").text.splitlines()
                       if line and not line.startswith("#")}
            out.append({"requests": (wave + 1) * per_wave, "rss": rss(pid),
                        "prompt_cache_bytes": int(metrics.get("monolith_prompt_cache_bytes", 0)),
                        "mlx_active_bytes": int(metrics.get("monolith_mlx_active_bytes", 0)),
                        "mlx_cache_bytes": int(metrics.get("monolith_mlx_cache_bytes", 0))})
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12_000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8123, help="0: a free port")
    ap.add_argument("--waves", type=int, default=6, help="waves of valid requests after the run (RSS)")
    ap.add_argument("--wave-requests", type=int, default=200)
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for the server, e.g. --server-arg=--prompt-cache-size=0 (repeatable)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="one more environment variable for the server (repeatable)")
    ap.add_argument("--out", default="fuzz", help="results are written to OUT-DIR/OUT.json and OUT.md")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()
    args.port = args.port or free_port()
    return args


def start_server(args) -> subprocess.Popen:
    """The demo server, plain decoding, on --port with --server-arg and --env."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **dict(e.split("=", 1) for e in args.env)}
    return subprocess.Popen([sys.executable, "-m", "monolith.serve", "--no-draft", "--port", str(args.port),
                             "--max-context", "4096", "--max-queue", "256", "--log-level", "error", *args.server_arg],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_ready(url: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not start")


def hostile_run(url: str, pid: int, work: list, clients: int, rss_ready: int) -> dict:
    """Send `work` from `clients` threads at once, sampling the server's RSS every 0.5 s:
    the status histogram, the 4xx replies out of shape, the client-side failures, the
    peak RSS (from `rss_ready` on) and the seconds it took."""
    statuses: collections.Counter = collections.Counter()
    out_of_shape, failures, lock = [], [], threading.Lock()
    peak = [rss_ready]
    done = threading.Event()

    def sample():
        while not done.wait(0.5):
            peak[0] = max(peak[0], rss(pid))

    def client(part):
        with httpx.Client(base_url=url, timeout=120) as http:
            for method, path, body, headers in part:
                try:
                    response = http.request(method, path, content=body, headers=headers)
                    status = response.status_code
                    bad = 400 <= status < 500 and not in_shape(response)
                except httpx.HTTPError as e:
                    status, bad = f"client error: {type(e).__name__}", False
                    with lock:
                        failures.append((path, str(e)[:200]))
                with lock:
                    statuses[status] += 1
                    if bad:
                        out_of_shape.append((status, path, response.text[:200]))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(work[i::clients],)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    done.set()
    return {"statuses": statuses, "out_of_shape": out_of_shape, "failures": failures, "peak": peak[0],
            "seconds": elapsed}


def grammar_findings() -> dict:
    """Per grammar engine, the control tokens it lets into a JSON string
    (bench/archive/results/grammar_engines.json; empty without it)."""
    engines = ROOT / "bench/archive/results/grammar_engines.json"
    if not engines.exists():
        return {}
    found = json.loads(engines.read_text()).get("engines", {})
    return {name: e.get("special_tokens_allowed_inside_a_string") for name, e in found.items()}


def markdown(args, result: dict, out_of_shape: int, failures: int) -> str:
    """The report: the status histogram, the 5xx and out-of-shape counts, RSS, the waves."""
    rss_bytes, waves, grammar = result["rss_bytes"], result["rss_waves"], result[
        "control_tokens_allowed_inside_a_json_string"]
    lines = ["# fuzz", "", (f"- {args.requests} requests from {args.clients} clients in {result['seconds']:.0f} s "
                            f"({result['requests_per_s']:.0f}/s), seed {args.seed}; the demo server, plain decoding"
                            + (f", with {' '.join(args.server_arg + args.env)}" if args.server_arg or args.env else "")),
             "",
             "| status | requests |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in result["statuses"].items()]
    lines += ["", (f"- 5xx: {result['server_errors']}; 4xx not in the API's error shape: "
                   f"{out_of_shape}; client-side failures: {failures}"),
              (f"- RSS: {rss_bytes['ready'] / 2**20:.0f} MiB ready, {rss_bytes['peak_during'] / 2**20:.0f} MiB peak, "
               f"{rss_bytes['after'] / 2**20:.0f} MiB after"),
              f"- still serving a plain request afterwards: {result['still_serving']}",
              "- then valid requests, RSS after each wave: " + ", ".join(
                  f"{w['requests']}: {w['rss'] / 2**20:.0f} MiB (prompt cache {w['prompt_cache_bytes'] / 2**20:.0f}, "
                  f"MLX arrays {w['mlx_active_bytes'] / 2**20:.0f}, MLX buffer cache {w['mlx_cache_bytes'] / 2**20:.0f}, "
                  f"the rest {(w['rss'] - w['mlx_active_bytes'] - w['mlx_cache_bytes']) / 2**20:.0f})"
                  for w in waves)]
    if grammar:
        lines.append("- control tokens a grammar lets into a JSON string (bench/archive/grammar_engines.py): "
                     + "; ".join(f"{n}: {', '.join(t for t, ok in v.items() if ok) or 'none'}"
                                 for n, v in grammar.items()))
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    server = start_server(args)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(url)
        rss_ready = rss(server.pid)
        rng = random.Random(args.seed)
        work = [request_for(rng) for _ in range(args.requests)]
        run = hostile_run(url, server.pid, work, args.clients, rss_ready)
        time.sleep(2)
        rss_after = rss(server.pid)
        waves = rss_waves(url, server.pid, args.waves, args.wave_requests, args.seed)
        final = httpx.post(url + "/v1/completions", json={"prompt": "def f(", "max_tokens": 2}, timeout=60)
    finally:
        server.terminate()
        server.wait(30)
    statuses, elapsed = run["statuses"], run["seconds"]
    server_errors = sum(n for s, n in statuses.items() if isinstance(s, int) and s >= 500)
    result = {"requests": args.requests, "clients": args.clients, "seed": args.seed, "seconds": elapsed,
              "requests_per_s": args.requests / max(elapsed, 1e-9),
              "server_args": args.server_arg, "server_env": args.env, "statuses": {str(k): v for k, v in sorted(
                  statuses.items(), key=lambda kv: str(kv[0]))}, "server_errors": server_errors,
              "client_errors": run["failures"][:20], "out_of_shape_4xx": run["out_of_shape"][:20],
              "rss_bytes": {"ready": rss_ready, "peak_during": run["peak"], "after": rss_after},
              "rss_waves": waves,
              "still_serving": final.status_code == 200,
              "control_tokens_allowed_inside_a_json_string": grammar_findings()}
    text = markdown(args, result, len(run["out_of_shape"]), len(run["failures"]))
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{args.out}.md").write_text(text)
    return 1 if server_errors or run["out_of_shape"] or not result["still_serving"] else 0


if __name__ == "__main__":
    sys.exit(main())
