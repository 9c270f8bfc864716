"""A pack directory's arrays (PackWeights), handed out entry by entry; the compute dtype.

The pack is the only thing a model loads (docs/formats.md 5): shards are `mx.load`ed as
stored and every entry is read in the layout its kernels consume.

Dense weights on the CPU: MLX's CPU quantized matmuls are scalar loops (an NVFP4
256x768 product costs ~90 us per row, so an 8-row verify pays 8x a decode step) and
BF16 matmuls have no BLAS (~7x F32), while F32 matmuls run on BLAS. So on the CPU some
matrices are dequantized (and their tensor scale applied) into F32 once at load: the
same values, computed with F32 accumulation as the CPU quantized kernels already do.
Which ones (`dense_entries`): only where a copy pays, in matmuls (an embedding is a row
gather, never copied), linears before stacked experts (a linear runs on every row of a
verify or draft block, an expert on the few rows routed to it), smaller before larger;
and only while it fits: the copies may add at most DENSE_PACK_SHARE of the pack's bytes
(at least DENSE_FLOOR, so a small pack is dense whole) and DENSE_MEMORY_SHARE of
physical memory. `dense=True/False` forces every matrix or none. On a GPU weights stay
in pack precision.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.stfile import STORAGE_DTYPES
from ..pack import PackError, ensure_verified, is_pack, read_manifest
from ..pack.target_recipe import VISION_PREFIX
from .layers import QUANT_MODES, Experts, FusedLinear, Linear

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
DENSE_MEMORY_SHARE = 0.25  # dense CPU copies may take at most this share of physical memory
DENSE_PACK_SHARE = 0.25  # ... and add at most this share of the pack's bytes
DENSE_FLOOR = 256 << 20  # ... or this many bytes, whichever is larger
MATRIX_TENSORS = ("weight", "scales", "tensor_scale")
# entries a target pack may carry that the text runtime does not read
UNUSED_PREFIXES = ("mtp.",)


class PackWeights:
    """The arrays of one pack (verified first, see open_pack), handed out entry by entry
    with shape checks; remembers which tensors were used so a pack that does not match
    the model is caught."""

    def __init__(self, pack_dir, dtype=mx.bfloat16, dense: bool | None = None, verify: str = "first"):
        self.path = open_pack(pack_dir, verify)
        self.manifest = read_manifest(self.path)
        self.entries: dict = self.manifest["entries"]
        self.dtype = dtype
        matrices = [n for n, e in self.entries.items() if e["kind"] in ("linear", "experts")]
        if dense is None:
            self.dense_names = dense_entries(self.manifest)
        else:
            self.dense_names = set(matrices) if dense else set()
        self.matrices = matrices
        self.config = _read_json(self.path / "config.json", required=True)
        self.generation_config = _read_json(self.path / "generation_config.json", required=False)
        self.arrays: dict[str, mx.array] = {}
        for shard in sorted(self.manifest["shards"]):
            try:
                # lazily loaded: the vision tower (read by models/vision.py vision_of on the
                # first image) is left unread here
                self.arrays.update((n, a) for n, a in mx.load(str(self.path / shard)).items()
                                   if not n.startswith(VISION_PREFIX))
            except RuntimeError as e:  # MLX's word for a truncated or corrupt file
                raise PackError(f"{self.path / shard}: cannot be read ({e}); the pack is damaged: "
                                "`python -m monolith.pack verify` it, or delete it to have it rebuilt") from None
        self.used: set[str] = set()

    def _array(self, name: str) -> mx.array:
        if name not in self.arrays:
            raise PackError(f"{self.path}: pack has no tensor {name}")
        self.used.add(name)
        return self.arrays[name]

    def _entry(self, name: str, kind: str, shape: tuple) -> dict:
        entry = self.entries.get(name)
        if entry is None:
            raise PackError(f"{self.path}: pack has no entry {name}")
        if entry["kind"] != kind:
            raise PackError(f"{self.path}: entry {name} is a {entry['kind']}, expected a {kind}")
        if shape is not None and tuple(entry["shape"]) != tuple(shape):
            raise PackError(f"{self.path}: entry {name} has shape {entry['shape']}, the config implies {list(shape)}")
        return entry

    def _matrix(self, name: str, precision: str) -> tuple[mx.array, str, dict]:
        """(weight, precision, keyword arguments) of a linear or experts entry: as stored,
        or dense F32 (precision "f32") when it is one of self.dense_names."""
        weight = self._array(name + ".weight")
        mode = QUANT_MODES.get(precision)
        dense = name in self.dense_names
        if mode is None:
            return (weight.astype(mx.float32), "f32", {}) if dense else (weight, precision, {"dtype": self.dtype})
        scales, tensor_scale = self._array(name + ".scales"), self._array(name + ".tensor_scale")
        if not dense:
            return weight, precision, {"scales": scales, "tensor_scale": tensor_scale, "dtype": self.dtype}
        mode, group_size, bits = mode
        rows = mx.dequantize(weight, scales, group_size=group_size, bits=bits, mode=mode, dtype=mx.float32)
        return rows * mx.expand_dims(tensor_scale.astype(mx.float32), -1), "f32", {}

    def has_linear(self, name: str) -> bool:
        return name in self.entries or f"{name}.0" in self.entries

    def linear(self, name: str, shape: tuple | None = None) -> Linear | FusedLinear:
        """A linear entry, or the split group NAME.0, NAME.1, ... when precisions differ."""
        if name not in self.entries and f"{name}.0" in self.entries:
            parts, i = [], 0
            while f"{name}.{i}" in self.entries:
                parts.append(self.linear(f"{name}.{i}"))
                i += 1
            group = FusedLinear(parts)
            if shape is not None and (group.shape != tuple(shape) or any(p.shape[1] != shape[1] for p in parts)):
                raise PackError(f"{self.path}: {name}.0..{i - 1} together have shape {list(group.shape)}, "
                                f"the config implies {list(shape)}")
            return group
        entry = self._entry(name, "linear", shape)
        weight, precision, arrays = self._matrix(name, entry["precision"])
        return Linear(weight, precision, shape=entry["shape"], **arrays)

    def experts(self, name: str, shape: tuple | None = None) -> Experts:
        entry = self._entry(name, "experts", shape)
        weight, precision, arrays = self._matrix(name, entry["precision"])
        return Experts(weight, precision, shape=entry["shape"], **arrays)

    def tensor(self, name: str, shape: tuple | None = None, dtype=None) -> mx.array:
        entry = self._entry(name, "tensor", shape)
        array = self._array(name)
        if tuple(array.shape) != tuple(entry["shape"]):
            raise PackError(f"{self.path}: tensor {name} has shape {list(array.shape)}, "
                            f"its entry says {entry['shape']}")
        return array if dtype is None or array.dtype == dtype else array.astype(dtype)

    def dense_summary(self) -> str:
        if not self.dense_names:
            return "pack-precision"
        if len(self.dense_names) == len(self.matrices):
            return "dense F32"
        return f"dense F32 for {len(self.dense_names)} of {len(self.matrices)} matrices, the rest pack-precision"

    def unused(self) -> list[str]:
        return sorted(n for n in self.arrays if n not in self.used and not n.startswith(UNUSED_PREFIXES))


def dense_entries(manifest: dict) -> set[str]:
    """The matrix entries to hold as dense F32 copies (see the module docstring): none
    on a GPU; on the CPU, linears then experts, smaller first, while the added bytes fit."""
    if mx.default_device() != mx.cpu:
        return set()
    tensors = manifest["tensors"]

    def nbytes(names) -> int:
        return sum(math.prod(tensors[n]["shape"]) * np.dtype(STORAGE_DTYPES[tensors[n]["dtype"]]).itemsize
                   for n in names)

    candidates = []
    for name, e in manifest["entries"].items():
        if e["kind"] not in ("linear", "experts") or name.rsplit(".", 1)[-1] == "embed_tokens":
            continue
        added = 4 * math.prod(e["shape"]) - nbytes(f"{name}.{t}" for t in MATRIX_TENSORS if f"{name}.{t}" in tensors)
        candidates.append((e["kind"] != "linear", added, name))
    text = [n for n in tensors if not n.startswith(VISION_PREFIX)]  # the text model's tensors
    budget = min(max(DENSE_PACK_SHARE * nbytes(text), DENSE_FLOOR), DENSE_MEMORY_SHARE * physical_memory())
    chosen, used = set(), 0
    for _, added, name in sorted(candidates):
        if used + added > budget:
            continue
        chosen.add(name)
        used += added
    return chosen


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _read_json(path: Path, required: bool) -> dict | None:
    if not path.is_file():
        if required:
            raise PackError(f"{path}: missing (a pack carries a copy of the source's config)")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackError(f"{path}: not valid JSON ({e})") from None


def compute_dtype(dtype):
    """The compute dtype: a name or mx.Dtype, or None for the device's default (float32
    on the CPU, whose BF16 matmuls have no BLAS; bfloat16 on a GPU)."""
    if dtype is None:
        return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    if isinstance(dtype, mx.Dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def open_pack(pack_dir, verify: str = "first") -> Path:
    """`pack_dir` as a Path, verified before use as `verify` (--verify-pack: always,
    first, never; monolith.pack.verify) says; PackError when it holds no pack or fails."""
    path = Path(pack_dir)
    if not is_pack(path):
        raise PackError(f"{path}: not a pack directory (build one with `python -m monolith.pack build`; "
                        "the command-line tools also take checkpoints and hub ids)")
    ensure_verified(path, verify)
    return path


def model_arrays(obj, seen=None) -> list[mx.array]:
    """Every mx.array a model holds (its attributes, recursively)."""
    seen = set() if seen is None else seen
    if isinstance(obj, mx.array):
        return [obj]
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        children = obj
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("monolith."):
        children = vars(obj).values()
    else:
        return []
    return [a for child in children for a in model_arrays(child, seen)]
