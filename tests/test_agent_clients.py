"""The agent-client matrix: each pinned client, run as a user runs it, non-interactively,
against a live `python -m monolith.serve` on the demo pair, completes a two-turn task: a
plain turn, then a turn with a tool call, the tool's result and the answer after it.

The server has two models configured (serve's --model given twice, docs/serving.md,
"Several models"): first the demo target without its draft, the default, loaded at
start; then the demo pair as `monolith-demo`, the name every client asks for, so each
client's requests name the non-default model, loaded when the first of them comes.

The demo model is too weak to choose a tool by itself, so the harness forces the call: a
test-only proxy (tests/client_rig.py, not part of the product) sits between the client and
the server, narrows the client's file-reading tool's schema to the note's path on every
request, and on the request whose last message is the user's task (it names the "secret
note") sets `tool_choice` to that tool. It never forces the turn after a tool result: that
answer is the model's own. (The schema is narrowed on every request, not only the forced
one, so that each request's prompt begins with the one before, as the client's own
requests do: the server's prompt cache then serves the tools and history, where a schema
changed on the forced request alone made its ~10K-token prompt a cold prefill.) Each
check asserts the client's exit status, that the reply text reached the client, that the
client really ran the tool (the note's text, which only the file holds, appears in the
request after the forced one), and that the server logged no 5xx.

The Node clients come from tests/clients/package-lock.json (`npm ci`, README's test
command), Aider from its own virtual environment (tests/clients/install.sh: its exact
pins conflict with the test extras), the other Python clients from the test extras.
Everything runs offline: each client gets a private HOME and its telemetry and update
checks are switched off."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from client_rig import (
    CLIENTS,
    KEY,
    MODEL,
    DemoServer,
    ForcingProxy,
    node_client,
    private_env,
    reply_text,
    run_client,
    words,
)

from monolith.pack.demo import bundle_dir

DEFAULT_MODEL = "monolith-demo-plain"  # the server's first model: the clients name the other
AUTH = {"Authorization": f"Bearer {KEY}"}
TASK = "Read the secret note with your file tool and tell me what it says."
FORCE = True  # set tool_choice on the task's request (the proxy): the demo model does not choose the tool itself
AIDER = CLIENTS / ".aider-venv" / "bin" / "aider"
MEASURED: dict = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Claude Code's system prompt and tools are about 32.7K tokens: more than the default context
    demo = bundle_dir()
    two_models = ["--model", demo / "target", "--model", demo / "target", "--draft", demo / "draft",
                  "--served-model-name", DEFAULT_MODEL, MODEL]
    with DemoServer(tmp_path_factory.mktemp("server"), "--max-context", "65536", *two_models) as s:
        listed = {m["id"]: m["loaded"] for m in httpx.get(s.url + "/v1/models", headers=AUTH).json()["data"]}
        assert listed == {DEFAULT_MODEL: True, MODEL: False}  # the clients' model loads on their first request
        yield s


@pytest.fixture
def note(tmp_path) -> Path:
    """The secret note: a file whose text only a client that read it can send back."""
    path = tmp_path / "work" / "secret.txt"
    path.parent.mkdir()
    path.write_text(f"the secret is {uuid.uuid4().hex}\n")
    return path


class Check:
    """One client's run: the proxy it talks to, and what the server logged meanwhile."""

    def __init__(self, server, pins, stop=None, greedy=True, force=FORCE):
        self.server, self.pins = server, pins
        # greedy: the clients sample by default, and a sampled reply of the demo model is
        # sometimes empty or, after a tool result, another call (LiteLLM's script then has no
        # text to print); greedy, each run sends the same replies
        self.proxy = ForcingProxy(server.url, trigger="secret note", pins=pins, stop=stop, greedy=greedy,
                                  force=force)
        self.log_start = len(server.server_errors())

    def __enter__(self):
        self.proxy.__enter__()
        return self

    def __exit__(self, *exc):
        self.proxy.__exit__(*exc)

    def report(self) -> str:
        return "server answers >= 400:\n" + "\n".join(self.proxy.failures())

    def assert_ok(self, result, output: str | None = None):
        """Exit 0, no error answer, and the last reply's text (if any) in the client's output."""
        output = result.stdout if output is None else output
        assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n" \
                                       + self.report()
        assert self.proxy.failures() == [], self.report()
        assert self.server.server_errors()[self.log_start:] == []
        # the last reply's text reached the client (a sampled reply of the demo model may
        # hold none, only reasoning: then there is nothing to show)
        last = words(reply_text(self.proxy.model_calls()[-1]))
        assert last[:40] in words(output), (last, output[-2000:])

    def assert_tool_ran(self, note: Path):
        assert self.proxy.tasks(), "no request was the user's task"
        assert self.proxy.sent_after_task(note.read_text().split()[-1]), "the tool's result never came back"


def timed(label, fn, *args, **kw):
    start = time.monotonic()
    try:
        return fn(*args, **kw)
    finally:
        MEASURED[f"{label} s"] = round(time.monotonic() - start, 1)


def need(path, what):
    if path is None or not Path(path).exists():
        pytest.skip(f"{what} is not installed (tests/clients/install.sh installs it where npm exists)")
    return path


def need_module(name, why):
    """Skip unless `name` is importable; found without importing it (LiteLLM's import
    fetches a price list from the network unless told not to)."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(why)


# ------------------------------------------------------------------ Node clients


def claude_env(home, url):
    return private_env(home, ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY=KEY, DISABLE_AUTOUPDATER="1",
                       DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                       ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL, CLAUDE_CODE_MAX_OUTPUT_TOKENS="256")


FULL_PROMPTS = os.environ.get("MONOLITH_FULL_AGENT_PROMPTS") == "1"


@pytest.mark.parametrize("tools", [
    "--tools=Read",
    pytest.param("--tools=default", marks=pytest.mark.skipif(
        not FULL_PROMPTS, reason="Claude Code's default tools make a ~32,500-token prompt, about 5 minutes of "
                                 "cold prefill on 2 CPU cores; set MONOLITH_FULL_AGENT_PROMPTS=1 to run it")),
])
def test_claude_code(server, note, tmp_path, tools):
    """Claude Code ends with an error on a reply cut at max_tokens: the proxy ends the
    demo model's rambling replies at a sentence or paragraph end instead. In the suite
    it offers the model only its Read tool (`--tools=Read`, a 3,900-token prompt); with
    all its tools the prompt is ~32,500 tokens (bench/archive/claude_code_prefix.py measures a
    prompt that long cold and warm)."""
    claude = need(node_client("claude"), "Claude Code")
    with Check(server, {"Read": {"file_path": str(note)}}, stop=[". ", "\n\n"]) as check:
        env = claude_env(tmp_path / "home", check.proxy.url)
        argv = [claude, "-p", "--model", MODEL, "--allowedTools=Read", tools]
        check.assert_ok(timed("claude turn 1", run_client, argv + ["Say hello."], env, note.parent))
        result = timed("claude turn 2", run_client, argv + ["--continue", TASK], env, note.parent)
        check.assert_ok(result)
        check.assert_tool_ran(note)


def codex_argv(codex, url):
    provider = f'{{name="monolith",base_url="{url}/v1",env_key="MONOLITH_TEST_KEY",wire_api="responses"}}'
    return [codex, "exec", "--skip-git-repo-check", "-m", MODEL, "-c", "model_provider=monolith",
            "-c", f"model_providers.monolith={provider}", "-c", "check_for_update_on_startup=false"]


def test_codex(server, note, tmp_path):
    """Codex speaks only the Responses API, stateless (`store: false`), with its ids in
    `client_metadata`, `include: ["reasoning.encrypted_content"]`, a "namespace" tool
    (multi_agent_v1) and a hosted "web_search" tool (left out); its shell tool is
    `exec_command`, forced on the task turn. The resumed session sends the first turn's
    history back."""
    codex = need(node_client("codex"), "Codex CLI")
    # sampled: Codex bounds no reply, and the demo model's greedy reply to its long prompt
    # runs on (a line of dashes), thinking on or off, until the suite's time-out
    # forced: the demo model loses the thread in Codex's ~10K-token prompt (it was trained on
    # rows of 2,048 tokens; Claude Code's ~4K still work) and writes on in its style
    with Check(server, {"exec_command": {"cmd": f"cat {note.name}"}}, greedy=False, force=True) as check:
        env = private_env(tmp_path / "home", MONOLITH_TEST_KEY=KEY, CODEX_HOME=str(tmp_path / "home" / "codex"))
        (tmp_path / "home" / "codex").mkdir()
        argv = codex_argv(codex, check.proxy.url)
        check.assert_ok(timed("codex turn 1", run_client, argv + ["Say hello."], env, note.parent))
        result = timed("codex turn 2", run_client, argv + ["resume", "--last", TASK], env, note.parent)
        check.assert_ok(result)
        check.assert_tool_ran(note)


def opencode_env(home, url):
    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
              "model": f"monolith/{MODEL}",
              "provider": {"monolith": {"npm": "@ai-sdk/openai-compatible", "name": "monolith",
                                        "options": {"baseURL": url + "/v1", "apiKey": KEY},
                                        "models": {MODEL: {"name": MODEL, "tool_call": True,
                                                           "limit": {"context": 65536, "output": 256}}}}},
              "permission": {"read": "allow", "external_directory": "allow"}}
    return private_env(home, OPENCODE_CONFIG_CONTENT=json.dumps(config), OPENCODE_DISABLE_AUTOUPDATE="1",
                       OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_LSP_DOWNLOAD="1",
                       OPENCODE_DISABLE_DEFAULT_PLUGINS="1", OPENCODE_DISABLE_SHARE="1")


def test_opencode(server, note, tmp_path):
    # the Linux x64 package's binary (tests/clients/package.json says why not opencode-ai)
    opencode = need(CLIENTS / "node_modules" / "opencode-linux-x64" / "bin" / "opencode", "OpenCode")
    with Check(server, {"read": {"filePath": str(note)}}) as check:
        env = opencode_env(tmp_path / "home", check.proxy.url)
        argv = [opencode, "run", "-m", f"monolith/{MODEL}"]
        check.assert_ok(timed("opencode turn 1", run_client, argv + ["Say hello."], env, note.parent))
        result = timed("opencode turn 2", run_client, argv + ["--continue", TASK], env, note.parent)
        check.assert_ok(result)
        check.assert_tool_ran(note)


def replies_of(result) -> str:
    """The JSON line a driver script printed last: its replies, joined."""
    return " ".join(r or "" for r in json.loads(result.stdout.strip().splitlines()[-1])["replies"])


@pytest.mark.parametrize("provider,path", [("openai-compatible", "/v1"), ("anthropic", "/v1")])
def test_ai_sdk(server, note, tmp_path, provider, path):
    need(shutil.which("node") and CLIENTS / "node_modules" / "ai", "The AI SDK")
    with Check(server, {"read_note": {"name": "secret"}}) as check:
        argv = ["node", CLIENTS / "ai_sdk_turns.mjs", provider, check.proxy.url + path, KEY, MODEL, note]
        result = timed(f"ai-sdk {provider}", run_client, argv, private_env(tmp_path / "home"), tmp_path)
        check.assert_ok(result, replies_of(result) if result.returncode == 0 else "")
        check.assert_tool_ran(note)


# ------------------------------------------------------------------ Python clients


def test_openai_agents_sdk(server, note, tmp_path):
    need_module("agents", "openai-agents (the test extras) is not installed")
    with Check(server, {"read_note": {"name": "secret"}}) as check:
        argv = [sys.executable, CLIENTS / "agents_sdk_turns.py", check.proxy.url + "/v1", KEY, MODEL, note]
        env = private_env(tmp_path / "home", OPENAI_AGENTS_DISABLE_TRACING="1")
        result = timed("openai-agents", run_client, argv, env, tmp_path)
        check.assert_ok(result, replies_of(result) if result.returncode == 0 else "")
        check.assert_tool_ran(note)


@pytest.mark.parametrize("provider,path", [("openai", "/v1"), ("anthropic", "")])
def test_litellm(server, note, tmp_path, provider, path):
    need_module("litellm", "litellm (the test extras) is not installed")
    with Check(server, {"read_note": {"name": "secret"}}) as check:
        argv = [sys.executable, CLIENTS / "litellm_turns.py", provider, check.proxy.url + path, KEY, MODEL, note]
        env = private_env(tmp_path / "home", LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False")
        result = timed(f"litellm {provider}", run_client, argv, env, tmp_path)
        check.assert_ok(result, replies_of(result) if result.returncode == 0 else "")
        check.assert_tool_ran(note)


def llm_env(home, url):
    config = home / "llm"
    config.mkdir(parents=True)
    (config / "extra-openai-models.yaml").write_text(
        f"- model_id: {MODEL}\n  model_name: {MODEL}\n  api_base: {url}/v1\n  api_key_name: monolith\n"
        "  supports_tools: true\n")
    (config / "keys.json").write_text(json.dumps({"monolith": KEY}))
    return private_env(home, LLM_USER_PATH=str(config))


def test_llm(server, note, tmp_path):
    need_module("llm", "llm (the test extras) is not installed")
    functions = f"def read_note(name: str) -> str:\n    'Read the note called name.'\n" \
                f"    return open({str(note)!r}).read()\n"
    with Check(server, {"read_note": {"name": "secret"}}) as check:
        env = llm_env(tmp_path / "home", check.proxy.url)
        argv = [sys.executable, "-m", "llm", "-m", MODEL, "-o", "max_tokens", "256"]  # llm sends no bound itself
        check.assert_ok(timed("llm turn 1", run_client, argv + ["Say hello."], env, tmp_path))
        result = timed("llm turn 2", run_client, argv + ["-c", "--functions", functions, TASK], env, tmp_path)
        check.assert_ok(result)
        check.assert_tool_ran(note)


def test_aider(server, note, tmp_path):
    """Aider has no function tools: it reads the files it is given into the prompt. Its
    second turn adds the note and restores the first turn's history; the note's text must
    reach the server."""
    need(AIDER, "Aider (its own virtual environment, tests/clients/install.sh)")
    with Check(server, {}) as check:
        env = private_env(tmp_path / "home", OPENAI_API_BASE=check.proxy.url + "/v1", OPENAI_API_KEY=KEY,
                          LITELLM_LOCAL_MODEL_COST_MAP="True")
        settings = tmp_path / "model-settings.yml"  # a bound on the reply, as for the other clients
        settings.write_text(f"- name: openai/{MODEL}\n  edit_format: whole\n  extra_params:\n    max_tokens: 256\n")
        argv = [AIDER, "--model", f"openai/{MODEL}", "--model-settings-file", settings, "--no-git", "--yes-always", "--no-check-update",
                "--no-show-model-warnings", "--analytics-disable", "--no-show-release-notes", "--map-tokens", "0",
                "--no-stream", "--no-pretty"]
        check.assert_ok(timed("aider turn 1", run_client, argv + ["--message", "Say hello."], env, note.parent))
        result = timed("aider turn 2", run_client, argv + ["--restore-chat-history", note.name, "--message", TASK],
                       env, note.parent)
        check.assert_ok(result)
        sent = json.dumps(check.proxy.model_calls()[-1]["request"])
        assert note.read_text().split()[-1] in sent and "Say hello." in sent
