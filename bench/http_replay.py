"""Server subprocesses and the streamed clients of bench/prompt_cache.py and
bench/concurrency.py.

`Server` starts `python -m monolith.serve` (or `mlx_lm.server`) on a free port with its
log in a file, waits for GET /health, and scrapes /metrics in a background thread
while requests run (so a peak inside a prefill is seen, not only the state between
turns). `chat` posts one streamed greedy /v1/chat/completions and times the first
content (or tool call) delta; `complete` does the same for /v1/completions, streamed
or not, and can close a stream early (a client that goes away).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import ROOT, free_port


def parse_metrics(text: str, prefixes: tuple[str, ...] = ("monolith_", "spec_decode_")) -> dict[str, float]:
    """`name{labels} value` lines of a Prometheus text page whose name starts with one of prefixes."""
    values = {}
    for line in text.splitlines():
        if line.startswith(prefixes):
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                pass
    return values


class Server:
    """One server process; use as a context manager (it is terminated on exit)."""

    def __init__(self, command: list[str], log: Path, env: dict | None = None, ready_timeout: float = 900,
                 metrics: bool = True, scrape_every: float = 0.25):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = command + ["--port", str(self.port)]
        self.log = log
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout = ready_timeout
        self.metrics = metrics
        self.scrape_every = scrape_every
        self.scrapes: list[dict[str, float]] = []
        self.started_seconds = None
        self._stop = threading.Event()

    def __enter__(self) -> Server:
        began = time.perf_counter()
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(self.command, stdout=self._log_file, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=ROOT)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log_file.close()
                raise ServerFailed(self, f"exited with status {self.proc.returncode} during startup")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            self.stop()
            raise ServerFailed(self, "did not become ready")
        self.started_seconds = time.perf_counter() - began
        if self.metrics:
            self._thread = threading.Thread(target=self._scrape_loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> int | None:
        """Stop scraping, then end the process gracefully (SIGTERM, then SIGKILL after 60 s)."""
        self._stop.set()
        if getattr(self, "_thread", None) is not None:
            self._thread.join(10)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self._log_file.closed:
            self._log_file.close()
        return self.proc.returncode

    def scrape(self) -> dict[str, float]:
        values = parse_metrics(httpx.get(self.url + "/metrics", timeout=30).text)
        values["_time"] = time.time()
        self.scrapes.append(values)
        return values

    def _scrape_loop(self) -> None:
        while not self._stop.wait(self.scrape_every):
            try:
                self.scrape()
            except httpx.HTTPError:
                pass

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class ServerFailed(RuntimeError):
    def __init__(self, server: Server, why: str):
        tail = "\n".join(server.log_text().splitlines()[-25:])
        super().__init__(f"{' '.join(server.command)}: {why}\n{tail}")
        self.log_tail = tail


class Refused(RuntimeError):
    """The server answered with an error status (before a stream started, or inside it)."""

    def __init__(self, path: str, status: int, body: str):
        super().__init__(f"POST {path}: {status} {body[:500]}")
        self.status = status


@dataclass
class Reply:
    ttft: float  # request sent -> first content or tool-call delta (the finish, if none)
    seconds: float  # request sent -> stream end
    text: str
    tool_calls: list[dict] = field(default_factory=list)
    usage: dict = field(default_factory=dict)
    finish_reason: str | None = None
    decode_seconds: float = 0.0  # first -> last content (or tool-call) delta

    @property
    def cached_tokens(self) -> int | None:
        details = self.usage.get("prompt_tokens_details") or {}
        return details.get("cached_tokens")


def chat(client: httpx.Client, url: str, messages: list[dict], tools: list[dict], max_tokens: int,
         model: str | None = None) -> Reply:
    body = {"messages": messages, "tools": tools, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    first = last = None
    text, calls, usage, finish = [], {}, {}, None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for chunk in _events(r, "/v1/chat/completions"):
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    last = time.perf_counter()
                    first = first or last
                text.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or ():
                    _merge_call(calls, call)
                finish = choice.get("finish_reason") or finish
    end = time.perf_counter()
    return Reply((first or end) - start, end - start, "".join(text), [calls[i] for i in sorted(calls)], usage,
                 finish, (last or end) - (first or end))


def complete(client: httpx.Client, url: str, prompt: str | list[int], max_tokens: int, stream: bool = True,
             close_after: int | None = None, extra: dict | None = None) -> Reply:
    """One greedy /v1/completions request. Streamed, `close_after=k` closes the stream
    after k text deltas (finish_reason "closed"). Raises Refused on an error status."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **(extra or {})}
    if stream:
        body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    if not stream:
        r = client.post(url + "/v1/completions", json=body)
        end = time.perf_counter()
        if r.status_code != 200:
            raise Refused("/v1/completions", r.status_code, r.text)
        choice = r.json()["choices"][0]
        return Reply(end - start, end - start, choice["text"], usage=r.json().get("usage") or {},
                     finish_reason=choice.get("finish_reason"))
    first = last = None
    text, usage, finish, deltas = [], {}, None, 0
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        for chunk in _events(r, "/v1/completions"):
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    last = time.perf_counter()
                    first = first or last
                    text.append(choice["text"])
                    deltas += 1
                finish = choice.get("finish_reason") or finish
            if close_after is not None and deltas >= close_after and finish is None:
                finish = "closed"
                break
    end = time.perf_counter()
    return Reply((first or end) - start, end - start, "".join(text), usage=usage, finish_reason=finish,
                 decode_seconds=(last or end) - (first or end))


def _events(response: httpx.Response, path: str):
    """The JSON chunks of an OpenAI event stream; Refused for an error status or an
    error event inside the stream."""
    if response.status_code != 200:
        response.read()
        raise Refused(path, response.status_code, response.text)
    for line in response.iter_lines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if "error" in chunk:  # no status inside a stream: the busy / shutting-down codes are 503s
                busy = chunk["error"].get("code") in ("queue_timeout", "shutting_down")
                raise Refused(path, 503 if busy else 500, line[6:])
            yield chunk


def _merge_call(calls: dict, delta: dict) -> None:
    """Streamed tool calls arrive whole (monolith) or in argument pieces (others)."""
    entry = calls.setdefault(delta.get("index", len(calls)),
                             {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    entry["id"] = delta.get("id") or entry["id"]
    function = delta.get("function") or {}
    entry["function"]["name"] += function.get("name") or ""
    entry["function"]["arguments"] += function.get("arguments") or ""


def probe_extra(url: str) -> dict:
    """{"ignore_eos": true} if the server accepts it, else {} (this server refuses unknown fields)."""
    with httpx.Client(timeout=300) as client:
        try:
            complete(client, url, "import os\n", 1, extra={"ignore_eos": True})
            return {"ignore_eos": True}
        except Refused as e:
            if e.status != 400:
                raise
            return {}
