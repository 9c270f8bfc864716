"""`python -m monolith.launch` as a process, with fake clients: small executables named
claude / codex / opencode, first on PATH, that record their arguments and environment
and make one request with them through the official SDK (anthropic for Claude Code,
openai for Codex's Responses and OpenCode's chat completions). Against a server launch
starts on the demo pair and one it must find and leave running; the missing-binary,
taken-port and wrong-key errors; --print-env. The real clients run elsewhere
(tests/clients/)."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from monolith import blas

FAKE_CLIENT = """#!{python}
import json, os, signal, sys, time

name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
record = {{"argv": args, "env": dict(os.environ)}}
got_sigint = []
signal.signal(signal.SIGINT, lambda *_: got_sigint.append(True))
try:
    if name == "claude":
        import anthropic  # ANTHROPIC_BASE_URL and ANTHROPIC_AUTH_TOKEN come from the environment
        reply = anthropic.Anthropic(max_retries=0).messages.create(
            model=os.environ["ANTHROPIC_MODEL"], max_tokens=3, messages=[{{"role": "user", "content": "hi"}}])
        record["generated"] = reply.usage.output_tokens
    elif name == "codex":
        import openai
        settings = dict(args[i + 1].split("=", 1) for i in range(len(args) - 1) if args[i] == "-c")
        settings = {{key: json.loads(value) for key, value in settings.items()}}
        provider = "model_providers." + settings["model_provider"]
        client = openai.OpenAI(base_url=settings[provider + ".base_url"],
                               api_key=os.environ[settings[provider + ".env_key"]], max_retries=0)
        reply = client.responses.create(model=settings["model"], input="hi", max_output_tokens=3)
        record["generated"] = reply.usage.output_tokens
    else:
        import openai
        config = json.loads(os.environ["OPENCODE_CONFIG_CONTENT"])
        provider, model = config["model"].split("/", 1)
        options = config["provider"][provider]["options"]
        client = openai.OpenAI(base_url=options["baseURL"], api_key=options["apiKey"], max_retries=0)
        reply = client.chat.completions.create(model=model, max_tokens=3,
                                               messages=[{{"role": "user", "content": "hi"}}])
        record["generated"] = reply.usage.completion_tokens
except Exception as e:
    record["error"] = repr(e)
with open(os.environ["FAKE_CLIENT_RECORD"], "w") as f:
    json.dump(record, f)
if "--wait-for-sigint" in args:
    print("waiting for SIGINT", flush=True)
    while not got_sigint:
        time.sleep(0.05)
    time.sleep(1)  # room for a second one, which a double delivery would send
    print("SIGINTs:", len(got_sigint), flush=True)
    sys.exit(3)
sys.exit(int(args[args.index("--exit") + 1]) if "--exit" in args else 0)
"""

SERVE_FLAGS = ("--no-draft", "--no-warmup", "--max-batch", "1", "--log-level", "warning")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One pack cache for the module: the demo pair is packed once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def env(tmp_path, cache):
    """The launcher's environment: fake clients first on PATH, HOME and the caches in tmp_path,
    and an ANTHROPIC_API_KEY of the user's that Claude Code must not get."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("claude", "codex", "opencode"):
        path = bin_dir / name
        path.write_text(FAKE_CLIENT.format(python=sys.executable))
        path.chmod(0o755)
    (tmp_path / "home").mkdir()
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path / "home"),
            "MONOLITH_CACHE": str(cache), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
            "FAKE_CLIENT_RECORD": str(tmp_path / "record.json"), "ANTHROPIC_API_KEY": "sk-ant-users-own"}


def _launch(env, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "monolith.launch", *args], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _record(env) -> dict:
    with open(env["FAKE_CLIENT_RECORD"]) as f:
        record = json.load(f)
    assert "error" not in record, record["error"]
    assert record["generated"] >= 1  # the request went through the server and generated
    return record


def _assert_setup(client, record, port, key, model, context):
    """What each client gets (monolith/agents.py)."""
    env, origin = record["env"], f"http://127.0.0.1:{port}"
    if client == "claude":
        assert env["ANTHROPIC_BASE_URL"] == origin and env["ANTHROPIC_AUTH_TOKEN"] == key
        assert "ANTHROPIC_API_KEY" not in env
        for name in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                     "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
            assert env[name] == model
        assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
        assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(context)
    elif client == "codex":
        settings = [record["argv"][i + 1] for i, arg in enumerate(record["argv"]) if arg == "-c"]
        assert settings == [f'model="{model}"', 'model_provider="monolith"', 'model_providers.monolith.name="monolith"',
                            f'model_providers.monolith.base_url="{origin}/v1"',
                            'model_providers.monolith.wire_api="responses"',
                            'model_providers.monolith.env_key="MONOLITH_API_KEY"', f"model_context_window={context}"]
        assert env["MONOLITH_API_KEY"] == key
    else:
        config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
        assert config["model"] == config["small_model"] == f"monolith/{model}"
        assert config["provider"]["monolith"] == {
            "npm": "@ai-sdk/openai-compatible", "name": "monolith",
            "options": {"baseURL": f"{origin}/v1", "apiKey": key},
            "models": {model: {"name": model, "limit": {"context": context, "output": context // 4}}}}


# ------------------------------------------------------------------ a server launch starts


@pytest.mark.parametrize("client", ["claude", "codex", "opencode"])
def test_launch_starts_a_server_runs_the_client_and_stops_the_server(env, client):
    port = _free_port()
    r = _launch(env, client, "--port", str(port), *SERVE_FLAGS, "--log-level", "info", "--max-context", "2048", "--",
                "--exit", "7", "--some-client-flag")
    assert r.returncode == 7, r.stderr  # the client's exit status
    record = _record(env)
    assert record["argv"][-3:] == ["--exit", "7", "--some-client-flag"]  # after `--`: verbatim, last
    key = {"claude": "ANTHROPIC_AUTH_TOKEN", "codex": "MONOLITH_API_KEY"}.get(client)
    key = record["env"][key] if key else json.loads(record["env"]["OPENCODE_CONFIG_CONTENT"])[
        "provider"]["monolith"]["options"]["apiKey"]
    assert len(key) >= 32  # generated: the server launch started wanted it
    _assert_setup(client, record, port, key, "monolith-demo", 2048)  # --max-context reached serve
    assert "starting python -m monolith.serve" in r.stderr and "stopped the server" in r.stderr
    assert not _answers(port)  # the server launch started is gone
    # the server runs on an installed OpenBLAS, preloaded by serve itself (monolith/blas.py)
    openblas = sys.platform.startswith("linux") and blas.find_openblas({}) is not None
    assert ("INFO:     BLAS: OpenBLAS (" in r.stderr) == openblas


def test_a_server_that_cannot_load_is_a_clear_error_with_its_last_lines(env, tmp_path):
    port = _free_port()
    r = _launch(env, "claude", "--port", str(port), "--model", str(tmp_path / "missing"), "--local-files-only")
    assert r.returncode == 1 and "the server exited (status 1) before it was ready" in r.stderr
    assert "missing" in r.stderr.split("before it was ready")[1]  # serve's own error line, shown again
    assert not os.path.exists(env["FAKE_CLIENT_RECORD"]) and not _answers(port)


def test_ctrl_c_goes_to_the_client_and_the_server_is_stopped_after_it(env):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "monolith.launch", "claude", "--port", str(port), *SERVE_FLAGS,
                             "--", "--wait-for-sigint"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(env["FAKE_CLIENT_RECORD"]):  # the client has made its request
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        assert _answers(port)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 3, err  # the client's status on SIGINT: it got the Ctrl-C, launch lived on
    _record(env)
    assert "stopped the server" in err and not _answers(port)


def test_a_ctrl_c_in_the_terminal_reaches_the_client_once(env):
    """In a terminal the Ctrl-C reaches the client from the terminal itself: launch must not
    send it a second one (a double press quits Claude Code)."""
    pexpect = pytest.importorskip("pexpect")
    port = _free_port()
    child = pexpect.spawn(sys.executable, ["-m", "monolith.launch", "claude", "--port", str(port), *SERVE_FLAGS, "--",
                                           "--wait-for-sigint"], env=env, encoding="utf-8", timeout=300)
    try:
        child.expect("waiting for SIGINT")
        child.sendcontrol("c")
        child.expect(r"SIGINTs: (\d+)")
        assert child.match.group(1) == "1"
        child.expect("stopped the server")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 3 and not _answers(port)


# ------------------------------------------------------------------ a server that is already there


@pytest.fixture(scope="module")
def running(cache):
    """A monolith server started by hand, with a key and its own model name: (port, key)."""
    port, key = _free_port(), "found-server-key"
    proc = subprocess.Popen([sys.executable, "-m", "monolith.serve", "--port", str(port), *SERVE_FLAGS,
                             "--max-context", "1024", "--served-model-name", "found-model"],
                            env={**os.environ, "MONOLITH_CACHE": str(cache), "MONOLITH_API_KEY": key},
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not _answers(port):
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)
    yield port, key
    proc.terminate()
    proc.wait(timeout=60)


@pytest.mark.parametrize("client", ["claude", "codex", "opencode"])
def test_launch_finds_a_running_server_and_leaves_it_running(env, running, client):
    port, key = running
    r = _launch(env, client, "--port", str(port), "--api-key", key, "--max-context", "4096")
    assert r.returncode == 0, r.stderr
    _assert_setup(client, _record(env), port, key, "found-model", 1024)  # the server's own model and context
    assert f"using the monolith server already at http://127.0.0.1:{port} (found-model)" in r.stderr
    assert "these are not used: --max-context" in r.stderr  # said, not silently dropped
    assert "starting" not in r.stderr and _answers(port)


@pytest.mark.parametrize("args,message", [
    ((), "wants an API key: give its key with --api-key"),
    (("--api-key", "wrong"), "refuses the key given"),
    (("--api-key", "found-server-key", "--served-model-name", "other"), "serves found-model, not other"),
])
def test_a_running_server_that_does_not_fit_is_a_clear_error(env, running, args, message):
    port, _ = running
    r = _launch(env, "claude", "--port", str(port), *args)
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(env["FAKE_CLIENT_RECORD"]) and _answers(port)


def test_print_env_shows_what_the_client_gets_and_runs_nothing(env, running):
    port, key = running
    r = _launch(env, "codex", "--port", str(port), "--api-key", key, "--print-env", "--", "exec", "hi")
    assert r.returncode == 0, r.stderr
    assert f"export MONOLITH_API_KEY={key}" in r.stdout.splitlines()
    assert ("# then: codex -c 'model=\"found-model\"' -c 'model_provider=\"monolith\"'" in r.stdout
            and r.stdout.rstrip().endswith("model_context_window=1024 exec hi"))
    free = _free_port()
    r = _launch(env, "claude", "--port", str(free), "--print-env")
    assert r.returncode == 0 and "no server answers" in r.stdout and "unset ANTHROPIC_API_KEY" in r.stdout
    assert not os.path.exists(env["FAKE_CLIENT_RECORD"]) and not _answers(free)


# ------------------------------------------------------------------ errors before anything runs


@pytest.mark.parametrize("client,package", [("claude", "@anthropic-ai/claude-code"), ("codex", "@openai/codex"),
                                            ("opencode", "opencode-ai")])
def test_a_missing_client_says_how_to_install_it(env, tmp_path, client, package):
    port = _free_port()
    r = _launch({**env, "PATH": str(tmp_path / "empty")}, client, "--port", str(port))
    assert r.returncode == 1 and f"npm install -g {package}" in r.stderr and "--client-bin" in r.stderr
    assert "starting" not in r.stderr and not _answers(port)


def test_a_port_taken_by_something_else_is_a_clear_error(env):
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = _launch(env, "claude", "--port", str(server.server_port))
    finally:
        server.shutdown()
    assert r.returncode == 1 and "not a monolith server" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(env["FAKE_CLIENT_RECORD"])


class _LoadingServer(http.server.BaseHTTPRequestHandler):
    """Answers as a monolith server that is loading for its first two /health polls (or fails)."""

    polls = 0
    outcome = {"status": "ok"}

    def do_GET(self):
        if self.path == "/health":
            type(self).polls += 1
            body = {"status": "loading"} if self.polls <= 2 else self.outcome
            status = 200 if body["status"] == "ok" else 503
        else:
            entry = {"id": "m", "owned_by": "monolith"}
            body, status = {"data": [entry | ({"max_model_len": 512} if self.polls > 2 else {})]}, 200
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("outcome", [{"status": "ok"}, {"status": "failed", "message": "no such model"}])
def test_a_found_server_still_loading_is_waited_for(outcome):
    from monolith.launch import LaunchError, found_server, health

    handler = type("Handler", (_LoadingServer,), {"outcome": outcome})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{server.server_port}"
    try:
        state = health(origin)
        assert state == {"status": "loading"}
        if outcome["status"] == "ok":
            found = found_server(origin, None, None, state, [])
            assert (found.model, found.context) == ("m", 512)  # the context once loaded
        else:
            with pytest.raises(LaunchError, match="did not become ready: no such model"):
                found_server(origin, None, None, state, [])
    finally:
        server.shutdown()


def test_serve_gets_the_flags_as_typed_less_launchs_own_and_never_the_key():
    from monolith.launch import client_origin, serve_flags

    typed = ["--model", "M", "--api-key", "K", "--served-model-name", "a", "b", "--client-bin=/x/claude",
             "--prompt-cache-size", "4G", "--print-env", "--api-key=K2", "--port", "9"]
    assert serve_flags(typed) == ["--model", "M", "--served-model-name", "a", "b", "--prompt-cache-size", "4G",
                                  "--port", "9"]
    assert [client_origin(h, 9) for h in ("127.0.0.1", "0.0.0.0", "::", "[::1]", "localhost")] == [
        "http://127.0.0.1:9", "http://127.0.0.1:9", "http://[::1]:9", "http://[::1]:9", "http://localhost:9"]


def test_usage_errors_exit_1(env):
    for args, message in ((("--port", "1", "claude"), "name the client first"), (("aider",), "invalid choice"),
                          (("claude", "--api-key", " "), "--api-key is empty"),
                          (("claude", "--distributed"), "--distributed")):
        r = _launch(env, *args)
        assert r.returncode == 1 and message in r.stderr, (args, r.stderr)
