"""Ollama's replies: the chat and generate reply format (`OllamaFormat`: one JSON object
per line, NDJSON, when streamed; one object when not), the final object's statistics in
nanoseconds, the model descriptions of /api/tags, /api/ps and /api/show, and Ollama's
error body {"error": "..."}."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from ...runtime.events import Delta, Finished
from ..errors import APIError
from ..reasoning import ReasoningSplitter
from ..requests import ChatRequest
from ..tools.calls import ToolCall, ToolCallParser

NS = 1_000_000_000
MEDIA_TYPE = "application/x-ndjson"
FOREVER = "9999-12-31T23:59:59Z"  # a model kept loaded for good (keep_alive < 0) expires never


def json_line(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False) + "\n"


def error_body(e: APIError) -> dict:
    """Ollama's error body: a message alone, so it starts with the field it names."""
    if e.param and not e.message.startswith(e.param):
        return {"error": f"{e.param}: {e.message}"}
    return {"error": e.message}


def timestamp(at: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama's created_at and expires_at."""
    moment = datetime.fromtimestamp(time.time() if at is None else at, timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


class OllamaFormat:
    """/api/chat's `message` or /api/generate's `response` (a StreamFormat:
    ../reply_format.py) of a chat `request`: reasoning as `thinking`, tool calls whole in Ollama's shape
    (arguments an object), the final object `done` with its statistics. `started`: when
    the request arrived (time.monotonic()); `held`: when its model was held, loaded if it
    was not (load_duration is the time in between)."""

    def __init__(self, model: str, chat: bool, request: ChatRequest, reasoning_open: bool, token_text,
                 started: float, held: float):
        tools = request.tools
        self.model, self.chat, self.token_text = model, chat, token_text
        self.logprobs = request.logprobs is not None
        self.started, self.held = started, held
        self.tools = tools
        self.parser = ToolCallParser(tools) if tools else None
        self.splitter = ReasoningSplitter(reasoning_open)
        self.texts: list[str] = []
        self.entries: list[dict] = []  # logprobs not yet sent (streaming) / all of them
        self.calls = 0

    # ---------------------------------------------------------------- collected

    def collect(self, delta: Delta) -> None:
        self.texts.append(delta.text)
        self.entries += [self.token_text.chat_entry(lp) for lp in delta.logprobs]

    def response(self, finished: Finished) -> dict:
        reasoning, content = self.splitter.feed("".join(self.texts))
        more_reasoning, more_content = self.splitter.finish()
        items = self._items(content + more_content, finished)
        text = "".join(item for item in items if isinstance(item, str))
        calls = [item for item in items if isinstance(item, ToolCall)]
        body = self._body(reasoning + more_reasoning, text, calls, self.entries)
        return {**body, **self.stats(finished)}

    def _items(self, text: str, finished: Finished | None) -> list:
        """Content strings and whole ToolCalls, in order (`finished`: the text's end)."""
        if self.parser is None:
            return [text]
        items = self.parser.read(text)
        if finished is not None:
            items += self.parser.read_end(cut=finished.finish_reason == "length")
        return items

    # ---------------------------------------------------------------- streamed

    def stream_start(self, include_usage: bool) -> list[dict]:
        return []

    def stream_delta(self, delta: Delta, include_usage: bool) -> list[dict]:
        self.entries += [self.token_text.chat_entry(lp) for lp in delta.logprobs]
        reasoning, content = self.splitter.feed(delta.text)
        return self._chunks(reasoning, self._items(content, None))

    def stream_finish(self, finished: Finished, include_usage: bool) -> list[dict]:
        reasoning, content = self.splitter.finish()
        chunks = self._chunks(reasoning, self._items(content, finished))
        return chunks + [{**self._body("", "", [], []), **self.stats(finished)}]

    def _chunks(self, reasoning: str, items: list) -> list[dict]:
        """A chunk for the reasoning and text of one delta, and one for each whole call."""
        text = "".join(item for item in items if isinstance(item, str))
        calls = [item for item in items if isinstance(item, ToolCall)]
        out = []
        if reasoning or text or self.entries:
            out.append(self._body(reasoning, text, [], self.entries))
            self.entries = []
        if calls:
            out.append(self._body("", "", calls, []))
        return out

    def _body(self, reasoning: str, text: str, calls: list[ToolCall], entries: list[dict]) -> dict:
        body: dict = {"model": self.model, "created_at": timestamp()}
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if reasoning:
                message["thinking"] = reasoning
            whole = [call for call in calls if call.whole]  # a call cut off by num_predict is not sent
            if whole:
                message["tool_calls"] = [self._call(call) for call in whole]
            body["message"] = message
        else:
            body["response"] = text
            if reasoning:
                body["thinking"] = reasoning
        if self.logprobs and entries:
            body["logprobs"] = entries
        body["done"] = False
        return body

    def _call(self, call: ToolCall) -> dict:
        self.calls += 1
        return {"id": call.id, "function": {"index": self.calls - 1, "name": call.name,
                                            "arguments": json.loads(call.arguments)}}

    def stats(self, finished: Finished) -> dict:
        """The final object's fields: why it ended, and Ollama's statistics in ns."""
        usage = finished.usage
        reason = finished.finish_reason if finished.finish_reason in ("stop", "length") else "stop"
        return {"done": True, "done_reason": reason,
                "total_duration": int((time.monotonic() - self.started) * NS),
                "load_duration": int((self.held - self.started) * NS),
                "prompt_eval_count": usage.prompt_tokens,
                "prompt_eval_duration": int(finished.prefill_seconds * NS),
                "eval_count": usage.completion_tokens,
                "eval_duration": int(finished.decode_seconds * NS)}

    # ---------------------------------------------------------------- framing

    def event(self, chunk: dict) -> str:
        return json_line(chunk)

    def keepalive(self) -> str:
        return ""  # NDJSON has no comment line; Ollama's own streams send nothing either

    def failure(self, error: APIError) -> str:
        return json_line(error_body(error))

    def end(self) -> str:
        return ""


def done_without_generating(model: str, chat: bool, reason: str) -> dict:
    """The reply to a request with no prompt (Ollama's way to load a model, or with
    keep_alive 0 to unload it): done at once, `reason` "load" or "unload"."""
    body: dict = {"model": model, "created_at": timestamp()}
    if chat:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return {**body, "done": True, "done_reason": reason}


# ------------------------------------------------------------------ model descriptions


def pack_facts(engine) -> dict:
    """What a loaded model's pack says of it: its manifest's architecture, digest and
    quantization, its config's model_type."""
    path = engine.tokenizer.path
    manifest, config = _read(path / "manifest.json"), _read(path / "config.json")
    family = manifest.get("architecture") or config.get("model_type") or ""
    return {"family": family, "digest": manifest.get("pack_sha256", ""),
            "quantization": str(manifest.get("quantization", "")), "config": config}


def details(facts: dict | None) -> dict:
    facts = facts or {}
    family = facts.get("family", "")
    return {"parent_model": "", "format": "monolith-pack", "family": family, "families": [family] if family else [],
            "parameter_size": "", "quantization_level": facts.get("quantization", "")}


def tag_entry(name: str, size: int, facts: dict | None, modified: float) -> dict:
    """One model of /api/tags (`facts`: pack_facts, None before its first load)."""
    return {"name": name, "model": name, "modified_at": timestamp(modified), "size": size,
            "digest": (facts or {}).get("digest", ""), "details": details(facts)}


def expires_at(keep_alive: float, idle_since: float | None) -> str:
    """When an idle model unloads (`idle_since`: time.monotonic() it went idle; None: it is
    busy now, so it is a keep-alive from now at the soonest)."""
    if keep_alive == float("inf"):
        return FOREVER
    now = time.monotonic()
    left = keep_alive - (0.0 if idle_since is None else now - idle_since)
    return timestamp(time.time() + max(left, 0.0))


def show_body(engine, facts: dict, modified: float) -> dict:
    config = facts["config"]
    family = facts["family"] or "model"
    capabilities = ["completion", "tools"]
    if "<think>" in (engine.tokenizer.chat_template or ""):
        capabilities.append("thinking")
    if engine.vision is not None:
        capabilities.append("vision")
    info = {"general.architecture": family, f"{family}.context_length": engine.max_context,
            f"{family}.vocab_size": engine.vocab_size}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key, name in (("num_hidden_layers", "block_count"), ("hidden_size", "embedding_length"),
                      ("num_attention_heads", "attention.head_count"),
                      ("num_key_value_heads", "attention.head_count_kv")):
        if isinstance(text.get(key), int):
            info[f"{family}.{name}"] = text[key]
    return {"modelfile": "", "parameters": "", "template": engine.tokenizer.chat_template or "",
            "details": details(facts), "model_info": info, "capabilities": capabilities,
            "modified_at": timestamp(modified)}


def _read(path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
