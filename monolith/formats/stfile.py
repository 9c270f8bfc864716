"""Raw safetensors reading and writing in numpy, with checks that name the culprit.

Tensors come back in their stored bits: BF16 as uint16 patterns, F8_E4M3 as uint8
(`safetensors.numpy` cannot read F8). Reading is lazy (memory-mapped).
Writing is deterministic: sorted names, no timestamps, header padded to 8 bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .nvfp4 import FormatError

# safetensors dtype -> numpy dtype holding the stored bits
STORAGE_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": np.uint16,
    "F32": np.float32,
    "F64": np.float64,
    "F8_E4M3": np.uint8,
}
ITEMSIZE = {dtype: np.dtype(storage).itemsize for dtype, storage in STORAGE_DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One safetensors file: its header checked up front, tensors read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise FormatError(f"{self.path}: truncated (no safetensors header)")
                n = int.from_bytes(head, "little")
                if n > MAX_HEADER or 8 + n > size:
                    raise FormatError(f"{self.path}: corrupt or truncated safetensors header (length {n})")
                header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise FormatError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            self._entries[name] = self._check_entry(name, entry, size - self._data_start)
        self._mmap = None

    def _check_entry(self, name, entry, data_size):
        """(dtype, shape, begin, end) of one header entry, checked; plain loops, as a
        35B-A3B checkpoint's headers hold 10^5 entries."""
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{self.path}: tensor {name}: malformed header entry") from None
        if dtype not in ITEMSIZE:
            raise FormatError(f"{self.path}: tensor {name}: unsupported dtype {dtype}")
        nbytes = ITEMSIZE[dtype]
        for d in shape:
            if type(d) is not int or d < 0:
                nbytes = None
                break
            nbytes *= d
        if nbytes is None or type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
            raise FormatError(f"{self.path}: tensor {name}: malformed shape {list(shape)} or data_offsets {[begin, end]}")
        if end - begin != nbytes:
            raise FormatError(
                f"{self.path}: tensor {name}: {dtype}{list(shape)} needs {nbytes} bytes, "
                f"header gives {end - begin}"
            )
        if end > data_size:
            raise FormatError(f"{self.path}: tensor {name}: data runs past the end of the file (truncated)")
        return dtype, shape, begin, end

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype(self, name: str) -> str:
        return self._entries[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def nbytes(self, name: str) -> int:
        _, _, begin, end = self._entries[name]
        return end - begin

    @property
    def header_size(self) -> int:
        """Bytes before the tensor data: the 8-byte length and the JSON header."""
        return self._data_start

    def offsets(self, name: str) -> tuple[int, int]:
        """(begin, end) of a tensor's bytes, counted from the start of the data."""
        return self._entries[name][2:]

    def read(self, name: str, copy: bool = False) -> np.ndarray:
        """The stored bits of one tensor: a read-only memory map, or with `copy` a
        private array read with plain file I/O (leaves no mapped pages behind)."""
        if name not in self._entries:
            raise FormatError(f"{self.path}: no tensor named {name}")
        dtype, shape, begin, end = self._entries[name]
        if end == begin:
            return np.zeros(shape, dtype=STORAGE_DTYPES[dtype])
        if copy:
            buffer = bytearray(end - begin)
            with open(self.path, "rb") as f:
                f.seek(self._data_start + begin)
                if f.readinto(buffer) != len(buffer):
                    raise FormatError(f"{self.path}: tensor {name}: file is truncated")
            return np.frombuffer(buffer, dtype=STORAGE_DTYPES[dtype]).reshape(shape)
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mmap[self._data_start + begin : self._data_start + end]
        return raw.view(STORAGE_DTYPES[dtype]).reshape(shape)

    def close(self) -> None:
        self._mmap = None


def header_bytes(specs: list[tuple[str, str, tuple[int, ...]]], metadata: dict | None = None) -> bytes:
    """Header for tensors `(name, safetensors dtype, shape)` whose data follow in the
    order given; header keys are sorted so the bytes do not depend on dict order."""
    entries: dict = {}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in STORAGE_DTYPES:
            raise FormatError(f"tensor {name}: unsupported dtype {dtype}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(STORAGE_DTYPES[dtype]).itemsize
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header: dict = {}
    if metadata:
        header["__metadata__"] = {k: str(metadata[k]) for k in sorted(metadata)}
    for name in sorted(entries):
        header[name] = entries[name]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_safetensors(path, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict | None = None) -> None:
    """Write `{name: (safetensors dtype, stored-bits array)}` deterministically."""
    names = sorted(tensors)
    for name in names:
        dtype, array = tensors[name]
        if dtype not in STORAGE_DTYPES or np.dtype(STORAGE_DTYPES[dtype]) != array.dtype:
            raise FormatError(f"tensor {name}: cannot store numpy {array.dtype} as {dtype}")
    with open(path, "wb") as f:
        f.write(header_bytes([(n, tensors[n][0], tensors[n][1].shape) for n in names], metadata))
        for name in names:
            f.write(np.ascontiguousarray(tensors[name][1]).tobytes())
