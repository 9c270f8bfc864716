"""What each coding agent gets from `python -m monolith.launch`: the environment and
arguments that point Claude Code, Codex CLI or OpenCode at a monolith server, without
touching the user's own configuration files.

Each client is also told the server's context (`max_model_len` from /v1/models) where
it has a setting for it: for a model name it does not know, each of them otherwise
assumes a window of its own (Claude Code 200K; Codex a generic default; OpenCode none,
which turns its compaction off), so a long session would overflow instead of compacting.

Checked by hand against the demo pair with Claude Code 2.1.197 (no login screen; the
request reaches /v1/messages with a bearer token and no attribution block), Codex CLI
0.171.0 (`exec` takes the provider and reaches /v1/responses) and OpenCode 1.18.33
(`run` answers through /v1/chat/completions, the title through the same model).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

PROVIDER = "monolith"  # the provider id given to Codex and OpenCode
KEY_VARIABLE = "MONOLITH_API_KEY"  # where Codex reads the key (serve reads the same variable)
NO_KEY = "none"  # a server without a key accepts anything, but the clients want some credential


@dataclass(frozen=True)
class Server:
    origin: str  # http://HOST:PORT, as the client reaches it
    key: str | None
    model: str  # the served model name the client asks for
    context: int | None  # the server's max_model_len, when it reports one


@dataclass(frozen=True)
class Setup:
    env: dict[str, str]
    unset: tuple[str, ...] = ()  # variables removed from the client's environment
    args: tuple[str, ...] = ()  # arguments put before the user's own


@dataclass(frozen=True)
class Client:
    command: str
    title: str
    npm_package: str  # what `npm install -g` takes, named in the missing-binary error
    setup: Callable[[Server], Setup]


def claude_setup(server: Server) -> Setup:
    """Claude Code reads everything from its environment (code.claude.com/docs/en/env-vars,
    authentication, model-config, llm-gateway-protocol):
    - ANTHROPIC_AUTH_TOKEN goes out as `Authorization: Bearer` and comes second in its
      credential order, above ANTHROPIC_API_KEY and a saved claude.ai login, so a session
      starts at once without the login screen or the one-time prompt to approve an
      ANTHROPIC_API_KEY. A user's own ANTHROPIC_API_KEY is removed: it would not reach
      Anthropic anyway, and both set is an auth-conflict warning.
    - ANTHROPIC_MODEL is the session's model; the opus / sonnet / haiku aliases, the
      background model (ANTHROPIC_DEFAULT_HAIKU_MODEL; ANTHROPIC_SMALL_FAST_MODEL is its
      deprecated name, still read by older versions) and subagents
      (CLAUDE_CODE_SUBAGENT_MODEL) are all the served model, which is the only one there is.
    - CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC turns off auto-updates, telemetry, error
      reporting, /feedback and release notes: nothing but the local endpoint is contacted.
    - CLAUDE_CODE_ATTRIBUTION_HEADER=0 leaves out the block Claude Code otherwise puts
      first in the system prompt (client version and a per-conversation fingerprint),
      which would differ at its first tokens from one session to the next and defeat the
      prompt cache.
    - CLAUDE_CODE_MAX_CONTEXT_TOKENS declares the window for a model id that does not
      start with `claude-`, so compaction happens at the server's context."""
    model = server.model
    env = {"ANTHROPIC_BASE_URL": server.origin, "ANTHROPIC_AUTH_TOKEN": server.key or NO_KEY,
           "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
           "CLAUDE_CODE_SUBAGENT_MODEL": model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "CLAUDE_CODE_ATTRIBUTION_HEADER": "0"}
    if server.context:
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(server.context)
    return Setup(env, unset=("ANTHROPIC_API_KEY",))


def codex_setup(server: Server) -> Setup:
    """Codex CLI takes `-c key=value` overrides (TOML values) before its subcommand and
    hands them to `exec` and the TUI alike, so ~/.codex stays as it is
    (developers.openai.com/codex/config-advanced, config-reference). A custom provider
    (its id may not be openai, ollama or lmstudio, which are built in) names `base_url`
    (Codex appends /responses), `wire_api = "responses"` (the only wire API current
    versions accept) and `env_key`, the variable whose value it sends as
    `Authorization: Bearer`; such a provider does not require an OpenAI login.
    `model_context_window` stands in for the catalog entry Codex has only for OpenAI's
    own models."""
    prefix = f"model_providers.{PROVIDER}"
    settings = {"model": server.model, "model_provider": PROVIDER, f"{prefix}.name": PROVIDER,
                f"{prefix}.base_url": f"{server.origin}/v1", f"{prefix}.wire_api": "responses",
                f"{prefix}.env_key": KEY_VARIABLE}
    if server.context:
        settings["model_context_window"] = server.context
    args = [part for key, value in settings.items() for part in ("-c", f"{key}={json.dumps(value)}")]
    return Setup({KEY_VARIABLE: server.key or NO_KEY}, args=tuple(args))


def opencode_setup(server: Server) -> Setup:
    """OpenCode merges OPENCODE_CONFIG_CONTENT, inline JSON, over every config file it
    reads, the user's and the project's (opencode.ai/docs/config, "Precedence order"), so
    nothing is written. The provider is the AI SDK's `@ai-sdk/openai-compatible` (chat
    completions) with `baseURL`, `apiKey` and the one model (opencode.ai/docs/providers,
    custom provider); `model` and `small_model` (titles, summaries) both name it. Its
    `limit` gives the context, and an output limit of a quarter of it: OpenCode keeps that
    much of the window free for the reply (up to its own cap of 32K)."""
    model = {"name": server.model}
    if server.context:
        model["limit"] = {"context": server.context, "output": server.context // 4}
    config = {"$schema": "https://opencode.ai/config.json",
              "provider": {PROVIDER: {"npm": "@ai-sdk/openai-compatible", "name": PROVIDER,
                                      "options": {"baseURL": f"{server.origin}/v1", "apiKey": server.key or NO_KEY},
                                      "models": {server.model: model}}},
              "model": f"{PROVIDER}/{server.model}", "small_model": f"{PROVIDER}/{server.model}"}
    return Setup({"OPENCODE_CONFIG_CONTENT": json.dumps(config)})


CLIENTS = {client.command: client for client in (
    Client("claude", "Claude Code", "@anthropic-ai/claude-code", claude_setup),
    Client("codex", "Codex CLI", "@openai/codex", codex_setup),
    Client("opencode", "OpenCode", "opencode-ai", opencode_setup),
)}
