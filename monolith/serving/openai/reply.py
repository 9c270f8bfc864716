"""OpenAI chat/completions replies (the reply formats ChatFormat, CompletionFormat):
chat.completion(.chunk) and text_completion objects
(non-streamed and as Server-Sent Events), usage, and the exact token bytes that
logprobs report (docs/serving.md)."""

from __future__ import annotations

import json
import time
import uuid

from ...runtime.events import Delta, Finished
from ..reasoning import ReasoningSplitter
from ..tools.call_stream import CallStream, Piece
from ..tools.calls import ToolCallParser, parse_tool_calls
from .speculation import FIELD, SpecPieces, spec_entries, stats_of

NEG_INF_LOGPROB = -9999.0  # what OpenAI reports for an impossible token (JSON has no -inf)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage_of(finished: Finished) -> dict:
    u = finished.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def reason_of(finished: Finished) -> str:
    return "abort" if finished.finish_reason == "cancelled" else finished.finish_reason


# ------------------------------------------------------------------ response formats


class OpenAIEvents:
    """How an OpenAI stream is written: `data:` lines, comment keep-alives, a final
    `data: [DONE]`, an error as one more `data:` line (other APIs override these)."""

    def event(self, chunk: dict) -> str:
        return sse(chunk)

    def keepalive(self) -> str:
        return ": keep-alive\n\n"

    def failure(self, error) -> str:
        return sse(error.body())

    def end(self) -> str:
        return "data: [DONE]\n\n"


class ChatFormat(OpenAIEvents):
    """chat.completion and chat.completion.chunk bodies (a StreamFormat: ../reply_format.py)."""

    def __init__(self, model: str, token_text: TokenText, logprobs: bool, tools: list | None,
                 reasoning_open: bool = False, spec: bool = False):
        """`reasoning_open`: the prompt left a think block open (reasoning.py); `spec`: the
        request's `monolith.spec` (speculation.py)."""
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.token_text = token_text
        self.logprobs = logprobs
        self.tools = tools
        self.parser = ToolCallParser(tools) if tools else None
        self.calls = CallStream(self.parser) if tools else None  # streamed: content and call pieces
        self.splitter = ReasoningSplitter(reasoning_open)  # reasoning_content | content
        self.texts: list[str] = []
        self.entries: list[dict] = []  # logprobs not yet sent (streaming) / all of them
        self.calls_sent = 0
        self.spec = spec
        self.pieces = SpecPieces(self.splitter, self.parser) if spec else None

    def collect(self, delta: Delta) -> None:
        self.texts.append(delta.text)
        self.entries += [self.token_text.chat_entry(lp) for lp in delta.logprobs]

    def response(self, finished: Finished) -> dict:
        reasoning, text = self.splitter.feed("".join(self.texts))
        more_reasoning, more_text = self.splitter.finish()
        reasoning, text = reasoning + more_reasoning, text + more_text
        calls = []
        if self.tools:  # tool calls are read from the content, never from the reasoning
            content, calls = parse_tool_calls(text, self.tools, cut=finished.finish_reason == "length")
        else:
            content = text
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        reason = "tool_calls" if calls and finished.finish_reason == "stop" else reason_of(finished)
        choice = {"index": 0, "message": message,
                  "logprobs": {"content": self.entries} if self.logprobs else None, "finish_reason": reason}
        body = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage_of(finished)}
        if self.spec:
            body[FIELD] = {"stats": stats_of(finished)}
        return body

    def _chunk(self, delta: dict, finish_reason=None, include_usage=False, with_logprobs=True) -> dict:
        logprobs = None
        if self.logprobs and with_logprobs:
            logprobs, self.entries = {"content": self.entries}, []
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if include_usage:
            body["usage"] = None
        return body

    def stream_start(self, include_usage: bool) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, include_usage=include_usage, with_logprobs=False)]

    def stream_delta(self, delta: Delta, include_usage: bool) -> list[dict]:
        self.entries += [self.token_text.chat_entry(lp) for lp in delta.logprobs]
        if self.pieces is not None:
            self.pieces.add(delta)
        return self._split(self.splitter.feed(delta.text), include_usage)

    def _split(self, pieces: tuple[str, str], include_usage: bool) -> list[dict]:
        """Chunks for a (reasoning, content) pair: the reasoning as delta.reasoning_content,
        the content through the tool-call parser (tools/tools/call_stream.py)."""
        reasoning, text = pieces
        items = [text] if self.calls is None else self.calls.feed(text)
        spec_reasoning, spec_content = self.pieces.take() if self.pieces is not None else ((), ())
        chunks = []
        if reasoning:
            chunks.append(self._chunk(self._text("reasoning_content", reasoning, spec_reasoning, "reasoning"),
                                      include_usage=include_usage))
        return chunks + self._pieces(items, include_usage, spec_content)

    def _text(self, key: str, text: str, pieces, part: str) -> dict:
        """A delta of `text` under `key`, with its pieces when the request asked (speculation.py)."""
        return {key: text, FIELD: spec_entries(pieces, part)} if self.spec else {key: text}

    def stream_finish(self, finished: Finished, include_usage: bool) -> list[dict]:
        chunks = self._split(self.splitter.finish(), include_usage)
        if self.calls is not None:
            items = self.calls.finish(cut=finished.finish_reason == "length")
            spec_content = self.pieces.take()[1] if self.pieces is not None else ()
            chunks += self._pieces(items, include_usage, spec_content)
        reason = "tool_calls" if self.parser and self.parser.calls and finished.finish_reason == "stop" \
            else reason_of(finished)
        chunks.append(self._chunk({}, reason, include_usage))
        if self.spec:
            chunks[-1][FIELD] = {"stats": stats_of(finished)}
        if include_usage:
            chunks.append({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                           "model": self.model, "choices": [], "usage": usage_of(finished)})
        return chunks

    def _pieces(self, items: list, include_usage: bool, spec=()) -> list[dict]:
        """The content of `items` (tools/tools/call_stream.py) as one chunk (a chat message holds its
        content and its calls apart), then the calls: a call's first chunk has its index,
        id, type, name and arguments "", the next ones its arguments as written."""
        chunks = []
        content = "".join(item for item in items if isinstance(item, str))
        if content:
            chunks.append(self._chunk(self._text("content", content, spec, "content"), include_usage=include_usage))
        for piece in items:
            if not isinstance(piece, Piece) or piece.kind == "end":
                continue
            if piece.kind == "start":
                self.calls_sent += 1
                entry = {"id": piece.call.id, "type": "function",
                         "function": {"name": piece.call.name, "arguments": ""}}
            else:
                entry = {"function": {"arguments": piece.text}}
            chunks.append(self._chunk({"tool_calls": [{"index": self.calls_sent - 1, **entry}]},
                                      include_usage=include_usage))
        return chunks


class CompletionFormat(OpenAIEvents):
    """text_completion bodies (the legacy completions API; a StreamFormat: ../reply_format.py)."""

    def __init__(self, model: str, token_text: TokenText, logprobs: bool):
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.token_text = token_text
        self.logprobs = logprobs
        self.texts: list[str] = []
        self.lps: list = []
        self.offset = 0  # text_offset of the next token

    def collect(self, delta: Delta) -> None:
        self.texts.append(delta.text)
        self.lps += delta.logprobs

    def _logprobs(self, lps) -> dict | None:
        if not self.logprobs:
            return None
        out = completion_logprobs(self.token_text, lps, self.offset)
        self.offset += sum(map(len, out["tokens"]))
        return out

    def _body(self, text: str, lps, finish_reason, include_usage=False) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": self._logprobs(lps),
                             "finish_reason": finish_reason}]}
        if include_usage:
            body["usage"] = None
        return body

    def response(self, finished: Finished) -> dict:
        body = self._body("".join(self.texts), self.lps, reason_of(finished))
        body["usage"] = usage_of(finished)
        return body

    def stream_start(self, include_usage: bool) -> list[dict]:
        return []

    def stream_delta(self, delta: Delta, include_usage: bool) -> list[dict]:
        return [self._body(delta.text, delta.logprobs, None, include_usage)]

    def stream_finish(self, finished: Finished, include_usage: bool) -> list[dict]:
        chunks = [self._body("", (), reason_of(finished), include_usage)]
        if include_usage:
            chunks.append({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                           "choices": [], "usage": usage_of(finished)})
        return chunks


def completion_logprobs(token_text: TokenText, lps, offset: int = 0) -> dict:
    """The legacy completions' logprobs object of TokenLogprobs `lps`, the tokens' text
    offsets counted from `offset`; an int in place of a TokenLogprob is a token without
    one (an echoed prompt's first: its logprob and top_logprobs are null)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        bare = isinstance(lp, int)
        token = token_text.text(lp if bare else lp.token_id)
        out["tokens"].append(token)
        out["token_logprobs"].append(None if bare else _finite(lp.logprob))
        out["top_logprobs"].append(None if bare else _top_by_text(token_text, lp.top))
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def _top_by_text(token_text: TokenText, top) -> dict:
    """The legacy top_logprobs object: text -> logprob, likeliest first. Tokens that read as
    the same text (the bytes of one character each read as U+FFFD) share one entry, the
    likeliest's, as a string's probability is at least its likeliest token's."""
    out: dict = {}
    for t, v in top:
        out.setdefault(token_text.text(t), _finite(v))
    return out


# ------------------------------------------------------------------ token text for logprobs


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table (byte-level BPE vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


class TokenText:
    """The exact bytes of single tokens (a token may hold part of a UTF-8 character),
    for the `bytes` and `token` fields of logprobs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        data = read_json(tokenizer.path / "tokenizer.json")
        vocab = (data.get("model") or {}).get("vocab")
        self.pieces = {i: t for t, i in vocab.items()} if isinstance(vocab, dict) else {}
        self.added = {t["id"]: t["content"] for t in data.get("added_tokens") or ()}
        decoder = data.get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
        self.byte_level = "ByteLevel" in kinds
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        if token_id not in self._cache:
            self._cache[token_id] = self._bytes(token_id)
        return self._cache[token_id]

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.pieces.get(token_id)
        if piece is not None and self.byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def chat_entry(self, lp) -> dict:
        def one(token_id, logprob):
            b = self.bytes(token_id)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(b)}

        entry = one(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [one(t, v) for t, v in lp.top]
        return entry


def _finite(value: float) -> float:
    return value if value > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def read_json(path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
