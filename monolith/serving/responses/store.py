"""The Responses API's response store: what `previous_response_id`, GET / DELETE
/v1/responses/{id} and its input_items read. A response (unless sent with `store:
false`) is kept with its whole conversation as chat messages and its request's input
items; the store holds at most `size` responses and `max_bytes` bytes (an entry's size:
its file's, the JSON of the three), dropping the least recently used first.

With a directory (serve's --prompt-cache-dir DIR: DIR/responses) every stored response
is also a file there, written atomically (state_file.write_atomically) on a writer
thread, so the store survives a restart: the files are listed at start and read when a
response is first asked for. A file is one JSON header line (format, version, id, the
payload's byte count and SHA-256) and the payload; one that fails a check (corrupt,
truncated, foreign) is never served: it is removed with a warning, as if evicted.

The responses being generated (`running`) are here too, by id, for POST
/v1/responses/{id}/cancel."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ...runtime.state_file import write_atomically
from ..errors import APIError

log = logging.getLogger("monolith.serve")

STORED_RESPONSES = 256
STORED_BYTES = 256 << 20
FORMAT = "monolith-response"
VERSION = "1"
SUFFIX = ".json"
ITEM_IDS = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}
_NAME = re.compile(r"resp_[0-9A-Za-z_-]{1,120}")  # a response id, and its file's name without the suffix


class Stored(NamedTuple):
    body: dict  # the response object
    messages: list[dict]  # the conversation (input and output, without the instructions) as chat messages
    input: list[dict]  # the request's input as items with ids (GET /v1/responses/{id}/input_items)


@dataclass
class Running:
    """A response being generated: its engine job, its response object at a status
    (ResponseFormat._body), and the finished object once its handler has it."""

    job: object
    body: Callable[[str], dict]
    outcome: Future


@dataclass
class _Entry:
    nbytes: int
    stored: Stored | None  # None: on disk only (from before a restart), read when asked for


class ResponseStore:
    def __init__(self, size: int = STORED_RESPONSES, max_bytes: int = STORED_BYTES, directory=None):
        if size < 1 or max_bytes < 1:
            raise ValueError(f"the response store's bounds must be positive, got {size} responses, {max_bytes} bytes")
        self.size, self.max_bytes = size, max_bytes
        self.directory = None if directory is None else Path(directory)
        self.entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.running: dict[str, Running] = {}
        self._lock = threading.RLock()
        self._writer = None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="monolith-response-store")

    def __repr__(self) -> str:
        where = f", kept in {self.directory}" if self.directory is not None else ""
        return f"ResponseStore({len(self.entries)} of {self.size} responses, {self.nbytes} of {self.max_bytes} " \
               f"bytes{where})"

    # ---------------------------------------------------------------- the stored responses

    def put(self, body: dict, messages: list[dict], input_items: list[dict]) -> None:
        stored = Stored(body, messages, input_items)
        data = encode(stored)
        response_id = body["id"]
        if len(data) > self.max_bytes:
            log.warning("response %s (%d bytes) is not stored: larger than the store's bound of %d bytes "
                        "(--response-store-bytes)", response_id, len(data), self.max_bytes)
            return
        with self._lock:
            self._remove(response_id)
            self.entries[response_id] = _Entry(len(data), stored)
            self.nbytes += len(data)
            self._disk(self._write, response_id, data)
            while len(self.entries) > self.size or self.nbytes > self.max_bytes:
                self._remove(next(iter(self.entries)))

    def get(self, response_id: str, param: str) -> Stored:
        """The stored response (404 naming `param` when there is none), now the most
        recently used."""
        with self._lock:
            entry = self.entries.get(response_id)
            if entry is not None and entry.stored is None:
                entry.stored = self._read(response_id)
                if entry.stored is None:
                    self._remove(response_id)
                    entry = None
            if entry is None:
                raise self.not_found(response_id, param)
            self.entries.move_to_end(response_id)
            self._disk(_touch, self._path(response_id))
            return entry.stored

    def delete(self, response_id: str) -> bool:
        """Remove a stored response (its file too); False when there was none."""
        with self._lock:
            return self._remove(response_id)

    def not_found(self, response_id: str, param: str) -> APIError:
        kept = "in memory and in --prompt-cache-dir" if self.directory is not None else \
            "in memory (not across a restart: --prompt-cache-dir keeps them)"
        return APIError(404, f"no response with id {response_id!r}: this server keeps the last {self.size} stored "
                        f"responses {kept}, not those sent with store: false", param, "response_not_found")

    def _remove(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        self._disk(_unlink, self._path(response_id))
        return True

    # ---------------------------------------------------------------- in flight

    def begin(self, response_id: str, job, body: Callable[[str], dict]) -> None:
        with self._lock:
            for done in [k for k, r in self.running.items() if r.job.done.is_set()]:
                del self.running[done]  # its handler never ended it (e.g. a stream never sent)
            self.running[response_id] = Running(job, body, Future())

    def end(self, response_id: str, body: dict | None = None) -> None:
        """The response's handler is done with it: `body` is the finished response
        object, None when it ended without one (cancelled before it began, failed)."""
        with self._lock:
            running = self.running.pop(response_id, None)
        if running is not None and not running.outcome.done():
            status = "cancelled" if running.job.cancelled else "failed"
            running.outcome.set_result(body if body is not None else running.body(status))

    # ---------------------------------------------------------------- the directory

    def _path(self, response_id: str) -> Path | None:
        return None if self.directory is None else self.directory / (response_id + SUFFIX)

    def _disk(self, work, *args) -> None:
        """`work(*args)` on the writer thread (in order), with a directory."""
        if self._writer is not None:
            self._writer.submit(work, *args)

    def _write(self, response_id: str, data: bytes) -> None:
        if not _NAME.fullmatch(response_id):
            log.warning("response %r is kept in memory only: its id is not a file name", response_id)
            return
        try:
            write_atomically(self._path(response_id), lambda tmp: Path(tmp).write_bytes(data))
        except OSError as e:
            log.warning("cannot write the stored response %s: %s", self._path(response_id), e)

    def _scan(self) -> None:
        for path in self.directory.glob(".tmp-*" + SUFFIX):  # a write that died before its rename
            path.unlink(missing_ok=True)
        found = []
        for path in self.directory.glob("*" + SUFFIX):
            if _NAME.fullmatch(path.stem):  # not a response file's name: not ours to count or delete
                stat = path.stat()
                found.append((stat.st_mtime, path.stem, stat.st_size))
        for _, response_id, nbytes in sorted(found):
            self.entries[response_id] = _Entry(nbytes, None)
            self.nbytes += nbytes
        while len(self.entries) > self.size or self.nbytes > self.max_bytes:  # the bounds may have shrunk
            entry_id, entry = self.entries.popitem(last=False)
            self.nbytes -= entry.nbytes
            _unlink(self._path(entry_id))

    def _read(self, response_id: str) -> Stored | None:
        """The checked contents of a response's file; None (the file removed, a warning)
        when it fails a check."""
        path = self._path(response_id)
        try:
            return decode(path.read_bytes(), response_id)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring and removing the stored response %s: %s", path, e)
            return None

    def close(self) -> None:
        """Wait until every queued write is done; responses stored later stay in memory."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)


def input_items(value) -> list[dict]:
    """A request's `input` (checked) as the items GET /v1/responses/{id}/input_items
    lists: a string is one user message, a message's string content one text part; every
    item gets an id and a status unless it has them."""
    items = []
    for item in [{"role": "user", "content": value}] if isinstance(value, str) else value:
        item = json.loads(json.dumps(item))
        kind = item.setdefault("type", "message")
        if kind == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": part, "text": item["content"]}]
            for content in item["content"]:
                if content.get("type") == "output_text":
                    content.setdefault("annotations", [])
        if kind == "reasoning":
            item.setdefault("summary", [])
        item["id"] = item.get("id") or ITEM_IDS.get(kind, "item_") + uuid.uuid4().hex
        item["status"] = item.get("status") or "completed"
        items.append(item)
    return items


def encode(stored: Stored) -> bytes:
    """A stored response as its file's bytes: the header line, then the payload."""
    text = json.dumps(stored._asdict(), ensure_ascii=False, separators=(",", ":"))
    payload = text.encode("utf-8", "surrogatepass")  # a lone surrogate in a request's JSON comes back as sent
    header = {"format": FORMAT, "version": VERSION, "id": stored.body["id"], "bytes": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest()}
    return json.dumps(header).encode() + b"\n" + payload


def decode(data: bytes, response_id: str) -> Stored:
    """The checked contents of a response file's bytes (ValueError saying what is wrong)."""
    line, _, payload = data.partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        raise ValueError("its header is not JSON") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ValueError("not a monolith stored response")
    if header.get("id") != response_id:
        raise ValueError(f"it holds response {header.get('id')!r}, not {response_id!r}")
    if header.get("bytes") != len(payload):
        raise ValueError(f"truncated: {len(payload)} of its {header.get('bytes')} bytes")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("its payload does not match its SHA-256 (the file is corrupt)")
    stored = json.loads(payload)
    return Stored(stored["body"], stored["messages"], stored["input"])


def _touch(path: Path) -> None:
    """Mark a file used (the order the bounds drop files in after a restart)."""
    try:
        os.utime(path)
    except OSError:
        pass  # evicted meanwhile


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
