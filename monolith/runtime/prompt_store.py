"""Prompt-cache checkpoints on disk (`--prompt-cache-dir`), and the file format a chat's
/save writes.

A checkpoint file is a safetensors file holding one stretch of a sequence, tokens
[start, end): `tokens` (I32), the KV rows of that stretch per row layer
(`rows.{i}.keys` / `rows.{i}.values`, the target's layers then the draft's) and the GDN
states after `end` rows (`state.{j}.conv` / `state.{j}.recurrent`, F32). Its metadata
holds the identity it was computed with (the target's pack_sha256, the draft pack's, the
compute dtype, the device and the MLX version), the SHA-256 of the token prefix
[0, end) and of [0, start) (the file that holds the rows before it; "" when start is
0), and the SHA-256 of every tensor's bytes. The file is named by the SHA-256 of the
identity and the prefix hash, so a lookup hashes the prompt's prefixes and opens only
files that can match.

Reading checks all of it (the header, the identity, the tokens against the prompt, every
tensor's hash, names, shapes and dtypes against the live caches): a corrupt, truncated or
foreign file raises CheckpointFileError naming the file and what is wrong, and the store
ignores it with a warning. Writes go to a temporary file in the directory, are fsynced
and renamed into place, on a writer thread (the engine thread only copies the arrays to
the host). The directory keeps at most `max_bytes` of checkpoint files: the least recently
used go first (a load touches a file), with the files that build on them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.nvfp4 import FormatError
from ..formats.stfile import SafetensorsFile, write_safetensors
from ..models.cache import Snapshot

log = logging.getLogger("monolith.prompt_cache")

FORMAT = "monolith-prompt-checkpoint"
VERSION = "1"
SUFFIX = ".safetensors"
DEFAULT_DIR_BYTES = 16 << 30
_STORED = {mx.float32: ("F32", np.float32), mx.float16: ("F16", np.float16), mx.bfloat16: ("BF16", np.uint16)}
_WRITES_WAITING = 8  # checkpoints queued for the writer thread; more are not persisted


class CheckpointFileError(ValueError):
    """A checkpoint file that must not be loaded; the message names the file and why."""


def identity(model, drafter=None) -> dict[str, str]:
    """What a checkpoint's values depend on besides its tokens."""
    draft = getattr(getattr(drafter, "draft", None), "pack_sha256", None) if drafter is not None else None
    return {"pack_sha256": str(getattr(model, "pack_sha256", None)), "draft_sha256": str(draft or ""),
            "dtype": str(model.dtype).replace("mlx.core.", ""), "device": str(mx.default_device()),
            "mlx": mx.__version__}


def prefix_hash(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def prefix_hashes(tokens: Sequence[int], ends: Sequence[int]) -> dict[int, str]:
    """{end: prefix_hash(tokens[:end])} for sorted `ends`, in one pass."""
    h, done, out = hashlib.sha256(), 0, {}
    data = np.asarray(tokens, dtype="<i4")
    for end in ends:
        h.update(data[done:end].tobytes())
        done = end
        out[end] = h.copy().hexdigest()
    return out


def file_key(ident: dict[str, str], prefix: str) -> str:
    material = json.dumps(ident, sort_keys=True) + "\n" + prefix
    return hashlib.sha256(material.encode()).hexdigest()


@dataclass(frozen=True)
class Stored:
    """A checkpoint file's contents, checked: tokens [start, end), rows per layer (numpy,
    [1, heads, end - start, dim]) and the GDN states after end (numpy)."""

    start: int
    tokens: list[int]
    rows: list[tuple[np.ndarray, np.ndarray]]
    states: list[tuple[np.ndarray, np.ndarray]]
    metadata: dict[str, str]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


# ------------------------------------------------------------------ one file


def host_arrays(rows: list[tuple[mx.array, mx.array]], states) -> tuple[list, list]:
    """The rows and states on the host as (safetensors dtype, stored bits) pairs."""
    def host(a: mx.array):
        dtype, storage = _STORED[a.dtype]
        if a.dtype == mx.bfloat16:
            a = a.view(mx.uint16)
        return dtype, np.array(a, dtype=storage)

    return ([(host(k), host(v)) for k, v in rows], [(host(c), host(r)) for c, r in states])


def write_checkpoint(path: Path, ident: dict[str, str], tokens: Sequence[int], start: int, rows, states,
                     extra: dict[str, str] | None = None) -> int:
    """Write the checkpoint of tokens[start:] (host_arrays) at `path`, atomically; its size."""
    tensors = {"tokens": ("I32", np.asarray(tokens[start:], dtype=np.int32))}
    for i, (keys, values) in enumerate(rows):
        tensors[f"rows.{i}.keys"], tensors[f"rows.{i}.values"] = keys, values
    for j, (conv, recurrent) in enumerate(states):
        tensors[f"state.{j}.conv"], tensors[f"state.{j}.recurrent"] = conv, recurrent
    hashes = {name: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for name, (_, a) in tensors.items()}
    metadata = {"format": FORMAT, "version": VERSION, "identity": json.dumps(ident, sort_keys=True),
                "start": str(start), "end": str(len(tokens)), "prefix_sha256": prefix_hash(tokens),
                "base_sha256": prefix_hash(tokens[:start]) if start else "",
                "tensors_sha256": json.dumps(hashes, sort_keys=True), **(extra or {})}
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        write_safetensors(tmp, tensors, metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_checkpoint(path: Path, ident: dict[str, str], layout, tokens: Sequence[int] | None = None) -> Stored:
    """The checked contents of one checkpoint file (CheckpointFileError otherwise):
    `layout` (prompt_cache.Layout) is what the live caches hold; `tokens`, when given,
    must start with the file's token prefix."""
    path = Path(path)

    def bad(reason: str) -> CheckpointFileError:
        return CheckpointFileError(f"{path}: {reason}")

    try:
        f = SafetensorsFile(path)
    except (FormatError, OSError) as e:
        raise bad(f"not a readable safetensors file ({e})") from None
    meta = f.metadata
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise bad(f"not a monolith prompt checkpoint (format {meta.get('format')!r} version {meta.get('version')!r})")
    try:
        theirs = json.loads(meta["identity"])
        start, end = int(meta["start"]), int(meta["end"])
        hashes = json.loads(meta["tensors_sha256"])
    except (KeyError, ValueError, TypeError) as e:
        raise bad(f"malformed metadata ({e})") from None
    if theirs != ident:
        diff = sorted(k for k in set(theirs) | set(ident) if theirs.get(k) != ident.get(k))
        raise bad(f"computed with another {', '.join(diff)} ({', '.join(f'{k}={theirs.get(k)}' for k in diff)}; "
                  f"this server has {', '.join(f'{k}={ident.get(k)}' for k in diff)})")
    n_rows, n_states = len(layout.rows), len(layout.states)
    expected = {"tokens"} | {f"rows.{i}.{kv}" for i in range(n_rows) for kv in ("keys", "values")} \
        | {f"state.{j}.{s}" for j in range(n_states) for s in ("conv", "recurrent")}
    if set(f.names()) != expected or set(hashes) != expected:
        raise bad(f"holds tensors {sorted(set(f.names()) ^ expected)[:4]} that do not match the caches' "
                  f"{n_rows} row layers and {n_states} GDN layers")
    arrays = {}
    for name in sorted(expected):
        data = f.read(name, copy=True)
        if hashlib.sha256(data.tobytes()).hexdigest() != hashes[name]:
            raise bad(f"tensor {name} does not match its SHA-256 (the file is corrupt)")
        arrays[name] = data
    f.close()
    ids = arrays["tokens"].tolist()
    if f.dtype("tokens") != "I32" or len(ids) != end - start or start < 0:
        raise bad(f"tokens hold {len(ids)} ids for [{start}, {end})")
    if tokens is not None and (len(tokens) < end or list(tokens[start:end]) != ids
                               or meta.get("prefix_sha256") != prefix_hash(tokens[:end])):
        raise bad("its tokens are not the prompt's")
    rows = []
    for i, (heads, dim, dtype) in enumerate(layout.rows):
        pair = tuple(arrays[f"rows.{i}.{kv}"] for kv in ("keys", "values"))
        want = _STORED[dtype][0]
        for kv, a in zip(("keys", "values"), pair):
            if a.shape != (1, heads, end - start, dim) or f.dtype(f"rows.{i}.{kv}") != want:
                raise bad(f"rows.{i}.{kv} is {f.dtype(f'rows.{i}.{kv}')}{list(a.shape)}, the cache holds "
                          f"{want}[1, {heads}, {end - start}, {dim}]")
        rows.append(pair)
    states = []
    for j, (conv, recurrent) in enumerate(layout.states):
        pair = (arrays[f"state.{j}.conv"], arrays[f"state.{j}.recurrent"])
        if (pair[0].shape, pair[1].shape) != (conv, recurrent) or pair[0].dtype != np.float32 \
                or pair[1].dtype != np.float32:
            raise bad(f"state.{j} has shapes {pair[0].shape}, {pair[1].shape}; the cache holds {conv}, {recurrent}")
        states.append(pair)
    return Stored(start, ids, rows, states, meta)


def device_rows(stored: Stored, layout) -> list[tuple[mx.array, mx.array]]:
    def device(a: np.ndarray, dtype) -> mx.array:
        return mx.array(a).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(a)

    return [(device(k, dtype), device(v, dtype)) for (k, v), (_, _, dtype) in zip(stored.rows, layout.rows)]


def device_snapshot(stored: Stored) -> Snapshot:
    return Snapshot(stored.end, tuple((mx.array(c), mx.array(r)) for c, r in stored.states))


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
    """A stored checkpoint as prompt_cache.PromptCache adopts it."""

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
        self._sizes: dict[Path, tuple[int, float]] = {}  # every checkpoint file: (size, mtime)
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
        """The deepest stored checkpoint of `tokens` past `deeper_than` and at most
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
            except CheckpointFileError as e:
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
                raise CheckpointFileError(f"{after}: the file holding the rows before it is gone")
            after = entry.path
            try:
                stored = read_checkpoint(entry.path, self.ident, layout, tokens)
            except CheckpointFileError:
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
        """Persist a prompt_cache.Node (its checkpoint): the rows past the deepest
        checkpoint before it that is stored already; queued for the writer thread."""
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
            self._queue.put_nowait((key, entry, tokens, host_rows, host_states))
        except queue.Full:
            log.debug("prompt-cache writes are behind: checkpoint of %d tokens not persisted", node.end)
            return
        with self._lock:
            self._entries[key] = entry

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, entry, tokens, rows, states = item
            try:
                size = write_checkpoint(entry.path, self.ident, tokens, entry.start, rows, states)
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
        """Wait until every queued checkpoint is written."""
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
