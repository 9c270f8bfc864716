"""The state file: one stretch of a sequence's cached state, as the prompt cache's
directory (prompt_store.py) and the chat's /save write it. (Source weights are the other
kind of file on disk: monolith/checkpoint/ reads those.)

A state file is a safetensors file holding tokens [start, end): `tokens` (I32), the
KV rows of that stretch per row layer (`rows.{i}.keys` / `rows.{i}.values`, the target's
layers then the draft's) and the GDN states after `end` rows (`state.{j}.conv` /
`state.{j}.recurrent`, F32). Its metadata holds the identity it was computed with (the
target's pack_sha256, the draft pack's, the compute dtype, the device and the MLX
version; with --kv-bits, the bits of the quantized KV rows, which the file then holds as
U32: QuantizedKVCache.rows), the SHA-256 of the token prefix [0, end) and of [0, start) (the file that
holds the rows before it; "" when start is 0), and the SHA-256 of every tensor's bytes.
After an image it also holds `positions`, the cache's multimodal positions at `end`
(JSON [position_delta, plain_until, delta_from], docs/target.md "Images in the forward");
a text-only file has no such key (its bytes are as before), which reads as text only.

Reading checks all of it (the header, the identity, the tokens against the prompt, every
tensor's hash, names, shapes and dtypes against the live caches): a corrupt, truncated or
foreign file raises StateFileError naming the file and what is wrong. Writing goes
to a temporary file in the same directory, fsynced and renamed into place
(`write_atomically`, which the Responses API's store on disk uses too).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.nvfp4 import FormatError
from ..formats.stfile import SafetensorsFile, write_safetensors
from ..models.cache import PLAIN, Snapshot

FORMAT = "monolith-prompt-checkpoint"  # the on-disk format name, kept: files written before the rename still load
VERSION = "1"
SUFFIX = ".safetensors"
_STORED = {mx.float32: ("F32", np.float32), mx.float16: ("F16", np.float16), mx.bfloat16: ("BF16", np.uint16),
           mx.uint32: ("U32", np.uint32)}  # U32: quantized KV rows (QuantizedKVCache.rows)


class StateFileError(ValueError):
    """A state file that must not be loaded; the message names the file and why."""


def identity(model, drafter=None) -> dict[str, str]:
    """What a state file's values depend on besides its tokens."""
    draft = None if drafter is None or drafter.draft is None else drafter.draft.pack_sha256
    ident = {"pack_sha256": str(model.pack_sha256), "draft_sha256": str(draft or ""),
             "dtype": str(model.dtype).replace("mlx.core.", ""), "device": str(mx.default_device()),
             "mlx": mx.__version__}
    if model.kv_bits:  # absent without --kv-bits: the files written before it still load
        ident["kv_bits"] = str(model.kv_bits)
    return ident


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
    """A state file's contents, checked: tokens [start, end), rows per layer (numpy,
    [1, heads, end - start, dim]) and the GDN states after end (numpy)."""

    start: int
    tokens: list[int]
    rows: list[tuple[np.ndarray, np.ndarray]]
    states: list[tuple[np.ndarray, np.ndarray]]
    metadata: dict[str, str]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def positions(self) -> tuple[int, int | None, int]:
        """The multimodal positions after `end` (PLAIN when the file has none)."""
        return _positions(self.metadata)


def host_arrays(rows: list[tuple[mx.array, mx.array]], states) -> tuple[list, list]:
    """The rows and states on the host as (safetensors dtype, stored bits) pairs."""
    def host(a: mx.array):
        dtype, storage = _STORED[a.dtype]
        if a.dtype == mx.bfloat16:
            a = a.view(mx.uint16)
        return dtype, np.array(a, dtype=storage)

    return ([(host(k), host(v)) for k, v in rows], [(host(c), host(r)) for c, r in states])


def write_state_file(path: Path, ident: dict[str, str], tokens: Sequence[int], start: int, rows, states,
                     extra: dict[str, str] | None = None, positions=PLAIN) -> int:
    """Write the state file of tokens[start:] (host_arrays) at `path`, atomically; its size.
    `positions`: the Snapshot's multimodal positions after the tokens."""
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
    if tuple(positions) != PLAIN:
        metadata["positions"] = json.dumps(list(positions))
    return write_atomically(path, lambda tmp: write_safetensors(tmp, tensors, metadata))


def write_atomically(path, write: Callable[[str], object]) -> int:
    """`write(tmp)` fills a temporary file (".tmp-*" + the path's suffix) in `path`'s
    directory, which is then fsynced and renamed onto `path`: a reader sees the old file
    or the whole new one, never a part. The new file's size."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_state_file(path: Path, ident: dict[str, str], layout, tokens: Sequence[int] | None = None) -> Stored:
    """The checked contents of one state file (StateFileError otherwise):
    `layout` (prompt_cache.Layout) is what the live caches hold; `tokens`, when given,
    must start with the file's token prefix."""
    path = Path(path)
    try:
        f = SafetensorsFile(path)
    except (FormatError, OSError) as e:
        raise StateFileError(f"{path}: not a readable safetensors file ({e})") from None
    start, end, hashes = _check_header(f, ident, layout)
    arrays = {}
    for name in sorted(hashes):
        data = f.read(name, copy=True)
        if hashlib.sha256(data.tobytes()).hexdigest() != hashes[name]:
            raise StateFileError(f"{path}: tensor {name} does not match its SHA-256 (the file is corrupt)")
        arrays[name] = data
    f.close()
    ids = arrays["tokens"].tolist()
    if f.dtype("tokens") != "I32" or len(ids) != end - start or start < 0:
        raise StateFileError(f"{path}: tokens hold {len(ids)} ids for [{start}, {end})")
    if tokens is not None and (len(tokens) < end or list(tokens[start:end]) != ids
                               or f.metadata.get("prefix_sha256") != prefix_hash(tokens[:end])):
        raise StateFileError(f"{path}: its tokens are not the prompt's")
    rows = []
    for i, (heads, dim, dtype) in enumerate(layout.rows):
        want = _STORED[dtype][0]
        for kv in ("keys", "values"):
            a, stored = arrays[f"rows.{i}.{kv}"], f.dtype(f"rows.{i}.{kv}")
            if a.shape != (1, heads, end - start, dim) or stored != want:
                raise StateFileError(f"{path}: rows.{i}.{kv} is {stored}{list(a.shape)}, the cache holds "
                                          f"{want}[1, {heads}, {end - start}, {dim}]")
        rows.append((arrays[f"rows.{i}.keys"], arrays[f"rows.{i}.values"]))
    states = []
    for j, shapes in enumerate(layout.states):
        pair = (arrays[f"state.{j}.conv"], arrays[f"state.{j}.recurrent"])
        if (pair[0].shape, pair[1].shape) != shapes or {f.dtype(f"state.{j}.{s}") for s in ("conv", "recurrent")} \
                != {"F32"}:
            raise StateFileError(f"{path}: state.{j} has shapes {pair[0].shape}, {pair[1].shape}; the cache "
                                      f"holds F32 {shapes[0]}, {shapes[1]}")
        states.append(pair)
    return Stored(start, ids, rows, states, f.metadata)


def _check_header(f: SafetensorsFile, ident: dict[str, str], layout) -> tuple[int, int, dict[str, str]]:
    """(start, end, {tensor: sha256}) from a state file's metadata, checked against
    this identity and the tensors the layout implies."""
    meta = f.metadata

    def bad(reason: str) -> StateFileError:
        return StateFileError(f"{f.path}: {reason}")

    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise bad(f"not a monolith state file (format {meta.get('format')!r} version {meta.get('version')!r})")
    try:
        theirs = json.loads(meta["identity"])
        start, end = int(meta["start"]), int(meta["end"])
        hashes = json.loads(meta["tensors_sha256"])
        _positions(meta)
    except (KeyError, ValueError, TypeError) as e:
        raise bad(f"malformed metadata ({e})") from None
    if theirs != ident:
        diff = sorted(k for k in set(theirs) | set(ident) if theirs.get(k) != ident.get(k))
        raise bad(f"computed with another {', '.join(diff)} ({', '.join(f'{k}={theirs.get(k)}' for k in diff)}; "
                  f"this server has {', '.join(f'{k}={ident.get(k)}' for k in diff)})")
    expected = {"tokens"} | {f"rows.{i}.{kv}" for i in range(len(layout.rows)) for kv in ("keys", "values")} \
        | {f"state.{j}.{s}" for j in range(len(layout.states)) for s in ("conv", "recurrent")}
    if set(f.names()) != expected or not isinstance(hashes, dict) or set(hashes) != expected:
        raise bad(f"holds tensors {sorted(set(f.names()) ^ expected)[:4]} that do not match the caches' "
                  f"{len(layout.rows)} row layers and {len(layout.states)} GDN layers")
    return start, end, hashes


def _positions(meta: dict[str, str]) -> tuple[int, int | None, int]:
    if "positions" not in meta:
        return PLAIN
    delta, plain_until, delta_from = json.loads(meta["positions"])
    if not (isinstance(delta, int) and isinstance(delta_from, int) and isinstance(plain_until, int)):
        raise ValueError(f"positions {meta['positions']} are not three ints")
    return delta, plain_until, delta_from


def device_rows(stored: Stored, layout) -> list[tuple[mx.array, mx.array]]:
    def device(a: np.ndarray, dtype) -> mx.array:
        return mx.array(a).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(a)

    return [(device(k, dtype), device(v, dtype)) for (k, v), (_, _, dtype) in zip(stored.rows, layout.rows)]


def device_snapshot(stored: Stored) -> Snapshot:
    return Snapshot(stored.end, tuple((mx.array(c), mx.array(r)) for c, r in stored.states), stored.positions)
