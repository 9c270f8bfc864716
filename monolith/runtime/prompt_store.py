"""Prompt-cache saved states on disk (`--prompt-cache-dir`): state files
(state_file.py) named by the SHA-256 of the identity and of the token prefix, so a
lookup hashes the prompt's prefixes and opens only files that can match.

A file that fails its checks (corrupt, truncated, foreign) is ignored with a warning and
never loaded. Writes happen on a writer thread (the engine thread only copies the arrays
to the host), each atomically. The directory keeps at most `max_bytes` of state
files: the least recently used go first (a load touches a file), with the files that
build on them.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..formats.nvfp4 import FormatError
from ..formats.stfile import SafetensorsFile
from ..models.cache import Snapshot
from .state_file import (
    FORMAT,
    SUFFIX,
    StateFileError,
    Stored,
    device_rows,
    device_snapshot,
    file_key,
    host_arrays,
    prefix_hashes,
    read_state_file,
    write_state_file,
)

log = logging.getLogger("monolith.prompt_cache")

DEFAULT_DIR_BYTES = 16 << 30
_WRITES_WAITING = 8  # saved states queued for the writer thread; more are not persisted
_NAME = re.compile(r"[0-9a-f]{64}")  # file_key(): what a state file is called


# ------------------------------------------------------------------ the directory


@dataclass
class _Entry:
    path: Path
    start: int
    end: int
    base: str  # the prefix hash of the file holding the rows before start ("" at 0)
    size: int
    used: float  # mtime: the last write or load
    pending: bool = False  # queued for the writer, not on disk yet


@dataclass(frozen=True)
class Found:
    """A saved state read from the store, as prompt_cache.PromptCache adopts it."""

    tokens: list[int]
    state: Snapshot
    rows: Callable[[int, int], list[tuple[mx.array, mx.array]]]


class PromptStore:
    def __init__(self, directory, max_bytes: int, ident: dict[str, str]):
        if max_bytes < 1:
            raise ValueError(f"the prompt-cache directory's size bound must be positive, got {max_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.ident = ident
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}  # prefix hash -> a file of this identity
        self._sizes: dict[Path, tuple[int, float]] = {}  # every state file: (size, mtime)
        self._scan()
        self._queue: queue.Queue = queue.Queue(_WRITES_WAITING)
        self._writer = threading.Thread(target=self._write_loop, name="monolith-prompt-store", daemon=True)
        self._writer.start()

    def __repr__(self) -> str:
        return f"PromptStore({self.directory}, {self.files} files, {self.nbytes} of {self.max_bytes} bytes)"

    @property
    def files(self) -> int:
        with self._lock:
            return len(self._sizes)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(size for size, _ in self._sizes.values())

    def _scan(self) -> None:
        for path in self.directory.glob(".tmp-*" + SUFFIX):  # a write that died before its rename
            path.unlink(missing_ok=True)
        for path in sorted(self.directory.glob("*" + SUFFIX)):
            if not _NAME.fullmatch(path.stem):  # not a state file's name: not ours to count or delete
                continue
            stat = path.stat()
            self._sizes[path] = (stat.st_size, stat.st_mtime)
            try:
                meta = SafetensorsFile(path).metadata
                ok = meta.get("format") == FORMAT and json.loads(meta.get("identity", "null")) == self.ident
                if ok and path.stem == file_key(self.ident, meta["prefix_sha256"]):
                    self._entries[meta["prefix_sha256"]] = _Entry(path, int(meta["start"]), int(meta["end"]),
                                                                  meta.get("base_sha256", ""), stat.st_size,
                                                                  stat.st_mtime)
            except (FormatError, OSError, ValueError, KeyError, TypeError) as e:
                log.warning("ignoring prompt-cache file %s: %s", path, e)

    # ---------------------------------------------------------------- lookup

    def find(self, tokens: Sequence[int], limit: int, deeper_than: int, layout) -> Found | None:
        """The deepest stored state of `tokens` past `deeper_than` and at most
        `limit` tokens, read and checked (with the files before it), or None."""
        with self._lock:
            ends = sorted({e.end for e in self._entries.values() if deeper_than < e.end <= limit and not e.pending})
        if not ends:
            return None
        hashes = prefix_hashes(tokens, ends)
        for end in reversed(ends):
            key = hashes[end]
            with self._lock:
                if key not in self._entries:
                    continue
            try:
                chain = self._read_chain(key, tokens, layout)
            except StateFileError as e:
                log.warning("ignoring prompt-cache file %s", e)
                continue
            return self._found(chain, layout)
        return None

    def _read_chain(self, key: str, tokens: Sequence[int], layout) -> list[Stored]:
        chain: list[Stored] = []
        after = None
        while True:
            with self._lock:
                entry = self._entries.get(key)
            if entry is None or entry.pending:
                raise StateFileError(f"{after}: the file holding the rows before it is gone")
            after = entry.path
            try:
                stored = read_state_file(entry.path, self.ident, layout, tokens)
            except StateFileError:
                self._forget(key)
                raise
            chain.append(stored)
            self._touch(entry)
            if stored.start == 0:
                return chain[::-1]
            key = stored.metadata["base_sha256"]

    def _found(self, chain: list[Stored], layout) -> Found:
        pieces = [(s.start, s.end, device_rows(s, layout)) for s in chain]
        deepest = chain[-1]

        def rows(start: int, end: int) -> list[tuple[mx.array, mx.array]]:
            out = []
            for i in range(len(layout.rows)):
                keys, values = [], []
                for s, e, piece in pieces:
                    if e > start and s < end:
                        a, b = max(s, start) - s, min(e, end) - s
                        keys.append(piece[i][0][:, :, a:b])
                        values.append(piece[i][1][:, :, a:b])
                out.append((mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)))
            return out

        tokens = [t for s in chain for t in s.tokens]
        return Found(tokens, device_snapshot(deepest), rows)

    # ---------------------------------------------------------------- save

    def save(self, node) -> None:
        """Persist a prompt_cache.Node (its saved state): the rows past the deepest
        saved state before it that is stored already; queued for the writer thread."""
        path_nodes = node.path()
        tokens = [t for n in path_nodes for t in n.tokens]
        ends = [n.end for n in path_nodes if n.state is not None]
        hashes = prefix_hashes(tokens, ends)
        key = hashes[node.end]
        with self._lock:
            if key in self._entries:
                return
            base = max((end for end in ends[:-1] if hashes[end] in self._entries), default=0)
        rows = []
        for layer in range(len(node.rows)):
            parts = [(n, n.rows[layer]) for n in path_nodes if n.end > base]
            rows.append(tuple(mx.concatenate([pair[kv][:, :, max(0, base - n.start):] for n, pair in parts], axis=2)
                              for kv in (0, 1)))
        mx.eval([a for pair in rows for a in pair])
        host_rows, host_states = host_arrays(rows, node.state.states)
        path = self.directory / (file_key(self.ident, key) + SUFFIX)
        entry = _Entry(path, base, node.end, hashes[base] if base else "", 0, 0.0, pending=True)
        try:
            self._queue.put_nowait((key, entry, tokens, host_rows, host_states, node.state.positions))
        except queue.Full:
            log.debug("prompt-cache writes are behind: the saved state of %d tokens is not persisted", node.end)
            return
        with self._lock:
            self._entries[key] = entry

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, entry, tokens, rows, states, positions = item
            try:
                size = write_state_file(entry.path, self.ident, tokens, entry.start, rows, states, positions=positions)
            except OSError as e:
                log.warning("cannot write prompt-cache file %s: %s", entry.path, e)
                self._forget(key)
            else:
                with self._lock:
                    entry.size, entry.used, entry.pending = size, entry.path.stat().st_mtime, False
                    self._sizes[entry.path] = (size, entry.used)
                self._bound()
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued saved state is written."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(30)

    # ---------------------------------------------------------------- the bound

    def _touch(self, entry: _Entry) -> None:
        """Mark a file used (its mtime), unless the bound deleted it meanwhile."""
        with self._lock:
            if entry.path not in self._sizes:
                return
            try:
                os.utime(entry.path)
                entry.used = entry.path.stat().st_mtime
            except OSError:
                return
            self._sizes[entry.path] = (entry.size, entry.used)

    def _bound(self) -> None:
        """Delete the least recently used files (and those built on them) while the
        directory holds more than max_bytes."""
        while True:
            with self._lock:
                if self.nbytes <= self.max_bytes or not self._sizes:
                    return
                oldest = min(self._sizes, key=lambda p: self._sizes[p][1])
                doomed = {oldest}
                keys = {k for k, e in self._entries.items() if e.path == oldest}
                grew = True
                while grew:  # files whose rows before them are going
                    more = {k for k, e in self._entries.items() if e.base in keys and k not in keys and not e.pending}
                    grew = bool(more)
                    keys |= more
                doomed |= {self._entries[k].path for k in keys}
                for k in keys:
                    del self._entries[k]
                for path in doomed:
                    self._sizes.pop(path, None)
            for path in doomed:
                path.unlink(missing_ok=True)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)
