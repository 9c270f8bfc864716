"""What the agent-client tests share: a live `python -m monolith.serve` on the demo pair
(`DemoServer`), a test-only proxy between a client and that server that can force a
tool call (`ForcingProxy`), the clients' private homes, and helpers to read replies."""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

KEY = "test-key"
MODEL = "monolith-demo"
CLIENTS = Path(__file__).parent / "clients"
NODE_BIN = CLIENTS / "node_modules" / ".bin"
HOP_HEADERS = {"connection", "content-length", "transfer-encoding", "host", "keep-alive", "accept-encoding"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def private_env(home: Path, **extra) -> dict:
    """os.environ with HOME, the XDG dirs and the caches moved under `home`, offline."""
    dirs = {"HOME": home, "XDG_CONFIG_HOME": home / ".config", "XDG_DATA_HOME": home / ".local" / "share",
            "XDG_CACHE_HOME": home / ".cache", "XDG_STATE_HOME": home / ".local" / "state",
            "HF_HOME": home / "hf", "MONOLITH_CACHE": home / "monolith"}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **{k: str(v) for k, v in dirs.items()}, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    return {**env, **extra}


def node_client(name: str) -> Path | None:
    """The pinned Node client's executable, or None where `npm ci` did not install it."""
    path = NODE_BIN / name
    return path if path.exists() and shutil.which("node") else None


def run_client(argv, env, cwd, timeout=300) -> subprocess.CompletedProcess:
    """Run a client as a user would, non-interactively: no stdin, a bound on time."""
    env = {**env, "PWD": str(cwd)}  # some clients (OpenCode) take their project from $PWD
    return subprocess.run([str(a) for a in argv], env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, check=False)


def words(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------ the server

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")


def openblas() -> dict:
    """Debian's OpenBLAS preloaded, one thread, where it is installed: how docs/performance.md
    runs serve on Linux (MLX's bundled BLAS makes the clients' 10-15K-token first prefills
    about 3 times slower; the clients' tests check behaviour, not bits)."""
    return {"LD_PRELOAD": str(OPENBLAS), "OPENBLAS_NUM_THREADS": "1"} if OPENBLAS.is_file() else {}


class DemoServer:
    """`python -m monolith.serve --api-key KEY` on the bundled demo pair, as a process,
    its log in a file."""

    def __init__(self, home: Path, *flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = home / "server.log"
        self.env = private_env(home, **openblas())
        self.argv = [sys.executable, "-m", "monolith.serve", "--api-key", KEY, "--port", str(self.port), *flags]

    def __enter__(self):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_text()
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("the server never became ready:\n" + self.log_text())

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def server_errors(self) -> list[str]:
        """The access-log lines of 5xx answers and any traceback the server printed."""
        lines = self.log_text().splitlines()
        return [line for line in lines if re.search(r'HTTP/1\.[01]" 5\d\d', line) or "Traceback" in line]

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


# ------------------------------------------------------------------ the forcing proxy


def message_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return ""


def is_users_task(api: str, body: dict, trigger: str) -> bool:
    """True when the request's last message is the user's, holds `trigger` and is no tool result."""
    if api == "responses":
        items = body.get("input")
        if isinstance(items, str):
            return trigger in items
        last = (items or [{}])[-1]
        return last.get("role") == "user" and trigger in message_text(last.get("content"))
    last = (body.get("messages") or [{}])[-1]
    if last.get("role") != "user":
        return False
    content = last.get("content")
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "tool_result" for p in content):
        return False
    return trigger in message_text(content)


def tool_name(api: str, tool: dict) -> str | None:
    return tool.get("function", {}).get("name") if api == "chat" else tool.get("name")


def pin_arguments(api: str, tool: dict, arguments: dict) -> None:
    """Narrow the tool's schema to exactly `arguments` (each value a const), so the weak
    demo model can only write those."""
    schema = {"type": "object", "properties": {k: {"const": v} for k, v in arguments.items()},
              "required": list(arguments), "additionalProperties": False}
    if api == "chat":
        tool["function"]["parameters"] = schema
    elif api == "messages":
        tool["input_schema"] = schema
    else:
        tool["parameters"] = schema


def pin_tools(api: str, body: dict, pins: dict) -> None:
    """Narrow each offered tool named in `pins` to its pinned arguments."""
    for tool in body.get("tools") or []:
        if tool_name(api, tool) in pins:
            pin_arguments(api, tool, pins[tool_name(api, tool)])


def force_tool(api: str, body: dict, pins: dict) -> str | None:
    """Set tool_choice on `body` for the first tool named in `pins` (or any tool when pins
    is empty); returns the tool forced. Its arguments are pinned already (pin_tools)."""
    tools = body.get("tools") or []
    named = [tool_name(api, t) for t in tools if tool_name(api, t) in pins]
    if not tools or (pins and not named):
        return None
    if not named:
        body["tool_choice"] = {"type": "any"} if api == "messages" else "required"
        return "any"
    name = named[0]
    if api == "chat":
        body["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif api == "messages":
        body["tool_choice"] = {"type": "tool", "name": name}
    else:
        body["tool_choice"] = {"type": "function", "name": name}
    return name


API_OF_PATH = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/messages": "messages",
               "/v1/responses": "responses", "/responses": "responses"}


class ForcingProxy:
    """A test-only HTTP proxy in front of the server. On every request it narrows each tool
    named in `pins` to the pinned arguments (so that consecutive requests share their
    prefix, as the client's own do, for the server's prompt cache); on a request whose
    last message is the user's task (it holds `trigger`; never a tool result), it sets
    `tool_choice` to the first tool named in `pins`. With
    `stop`, it sets those stop sequences on every other Messages request, so that the weak
    model's reply ends as a stop, not at max_tokens (which Claude Code reports as an
    error), and switches thinking off there (the demo model opens its reply with an empty
    reasoning block, whose blank line would meet a "\n\n" stop before any text). With `greedy`, every model request is sent with temperature 0, for a client
    that samples by default (its reply is then the same on every run). It records every
    exchange: path, the body as forwarded, status, reply bytes."""

    def __init__(self, upstream: str, trigger: str = "", pins: dict | None = None, stop: list | None = None,
                 greedy: bool = False, force: bool = True):
        self.upstream, self.trigger, self.pins, self.stop = upstream, trigger, pins or {}, stop
        self.greedy, self.force = greedy, force
        self.exchanges: list[dict] = []
        self.http = httpx.Client(base_url=upstream, timeout=httpx.Timeout(600, connect=10))
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                proxy.forward(self, None)

            def do_POST(self):
                proxy.forward(self, self.rfile.read(int(self.headers.get("content-length") or 0)))

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.http.close()

    def rewrite(self, path: str, raw: bytes | None) -> tuple[bytes | None, dict]:
        record = {"path": path, "request": None, "task": False, "forced": None, "status": None, "reply": b""}
        api = API_OF_PATH.get(path.split("?")[0])
        if not raw:
            return raw, record
        try:
            body = json.loads(raw)
        except ValueError:
            return raw, record
        if api:
            pin_tools(api, body, self.pins)
        if api and self.trigger and is_users_task(api, body, self.trigger):
            record["task"] = True
            record["forced"] = force_tool(api, body, self.pins) if self.force else None
        elif api == "messages" and self.stop:
            body["stop_sequences"] = self.stop
            body["thinking"] = {"type": "disabled"}
        if api and self.greedy:
            body["temperature"] = 0
        raw = json.dumps(body).encode() if api else raw
        record["request"] = body
        return raw, record

    def forward(self, handler, raw):
        raw, record = self.rewrite(handler.path, raw)
        self.exchanges.append(record)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_HEADERS}
        request = self.http.build_request(handler.command, handler.path, content=raw, headers=headers)
        response = self.http.send(request, stream=True)
        record["status"] = response.status_code
        try:
            self.relay(handler, response, record)
        except (BrokenPipeError, ConnectionResetError):
            # the client went away: often right after the event that ends a stream (Codex
            # closes on response.completed, before the [DONE] line); what it got is kept
            record["client_left"] = True
        finally:
            record["reply"] = bytes(record["reply"])
            response.close()

    @staticmethod
    def relay(handler, response, record: dict) -> None:
        """Send the server's answer on to the client as it comes (chunked), its bytes into
        record["reply"] as they pass."""
        handler.send_response(response.status_code)
        for k, v in response.headers.items():
            if k.lower() not in HOP_HEADERS and k.lower() != "content-encoding":
                handler.send_header(k, v)
        handler.send_header("transfer-encoding", "chunked")
        handler.end_headers()
        record["reply"] = reply = bytearray()
        for chunk in response.iter_raw():
            reply += chunk
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            handler.wfile.flush()
        handler.wfile.write(b"0\r\n\r\n")

    # -------------------------------------------------------------- what it saw

    def model_calls(self) -> list[dict]:
        return [x for x in self.exchanges if API_OF_PATH.get(x["path"].split("?")[0])]

    def failures(self) -> list[str]:
        """Each answer of status 400 or more: the path, the status and the reply."""
        return [f'{x["path"]} {x["status"]}: {x["reply"][:600].decode(errors="replace")}'
                for x in self.exchanges if (x["status"] or 600) >= 400]

    def tasks(self) -> list[dict]:
        """The exchanges whose request was the user's task (forced or not)."""
        return [x for x in self.exchanges if x["task"]]

    def sent_after_task(self, marker: str) -> bool:
        """True when a model request after the first of the user's task carries `marker`,
        i.e. the client ran the tool and sent its result back."""
        calls = self.model_calls()
        first = next(i for i, x in enumerate(calls) if x["task"])
        return any(marker in json.dumps(x["request"]) for x in calls[first + 1:])


def sse_events(raw: bytes) -> list[dict]:
    events = []
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            try:
                events.append(json.loads(line[5:]))
            except ValueError:
                pass
    return events


def reply_text(exchange: dict) -> str:
    """The text the server answered in one exchange, from JSON or a stream, any API."""
    raw = exchange["reply"]
    try:
        bodies = [json.loads(raw)]
    except ValueError:
        bodies = sse_events(raw)
    parts = []
    for body in bodies:
        for choice in body.get("choices") or []:
            part = choice.get("message") or choice.get("delta") or {}
            parts.append(part.get("content") or "")
        if body.get("type") == "message":
            parts += [b.get("text") or "" for b in body.get("content") or []]
        if body.get("type") == "content_block_delta":
            parts.append(body["delta"].get("text") or "")
        if body.get("type") == "response.output_text.delta":
            parts.append(body.get("delta") or "")
        if body.get("object") == "response":
            parts += [c.get("text") or "" for item in body.get("output") or [] for c in item.get("content") or []]
    return "".join(parts)
