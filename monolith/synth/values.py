"""Deterministic tensor values.

Every tensor is drawn from its own generator, seeded by (seed, SHA-256 of its canonical
name), so a value never depends on which other tensors exist, in which order they are
written, or in which format: the per-expert and the fused layout, a quantized and a
BF16 checkpoint, a DeepSpec draft and its speculators twin all start from the same
numbers. Values are rounded to BF16 (returned as float32 holding BF16 values).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from monolith.formats import bf16_bits_to_f32, f32_to_bf16_bits

# init kind -> how the values are drawn (std relative to fan_in = last dimension)
INITS = (
    "linear",  # normal, std gain / sqrt(fan_in)
    "embed",  # normal, std 1
    "norm0",  # zero-centred norm weight (applied as 1 + w): small around 0
    "norm1",  # plain norm weight: around 1
    "bias",  # small around 0
    "zero",  # exactly 0
    "a_log",  # log(uniform(1, 16))
    "dt_bias",  # small around 0
    "markov",  # Markov W1 embedding rows
)


@dataclass(frozen=True)
class Param:
    """One logical tensor: its canonical name, shape, and how its values are drawn.
    `module` is set for a linear weight (a 2-D matrix a checkpoint may quantize)."""

    name: str
    shape: tuple[int, ...]
    init: str
    module: str | None = None
    gain: float = 1.0

    def __post_init__(self):
        if self.init not in INITS:
            raise ValueError(f"{self.name}: unknown init {self.init!r}")


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def _rng(seed: int, name: str) -> np.random.Generator:
    check_seed(seed)
    words = np.frombuffer(hashlib.sha256(name.encode()).digest()[:16], dtype="<u4")
    return np.random.default_rng([int(seed), *(int(w) for w in words)])


CHUNK = 1 << 22  # elements converted at a time (bounds temporaries for large tensors)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 BF16 bit patterns (round to nearest even), in chunks."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(flat.shape, dtype=np.uint16)
    for start in range(0, flat.size, CHUNK):
        out[start : start + CHUNK] = f32_to_bf16_bits(flat[start : start + CHUNK])
    return out.reshape(np.shape(x))


def as_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest BF16 values (kept as float32)."""
    flat = np.array(x, dtype=np.float32).reshape(-1)
    for start in range(0, flat.size, CHUNK):
        flat[start : start + CHUNK] = bf16_bits_to_f32(f32_to_bf16_bits(flat[start : start + CHUNK]))
    return flat.reshape(np.shape(x))


def generate(seed: int, param: Param) -> np.ndarray:
    """float32 array holding exactly-BF16 values for `param`."""
    rng = _rng(seed, param.name)
    shape = param.shape
    fan_in = shape[-1] if shape else 1

    def normal():
        return rng.standard_normal(shape, dtype=np.float32)

    kind = param.init
    if kind == "linear":
        x = normal()
        x *= np.float32(param.gain / np.sqrt(fan_in))
    elif kind == "embed":
        x = normal()
    elif kind == "norm0":
        x = normal()
        x *= np.float32(0.1)
    elif kind == "norm1":
        x = np.float32(1.0) + normal() * np.float32(0.1)
    elif kind in ("bias", "dt_bias"):
        x = normal() * np.float32(0.1)
    elif kind == "zero":
        x = np.zeros(shape, dtype=np.float32)
    elif kind == "a_log":
        x = np.log(rng.uniform(1.0, 16.0, size=shape)).astype(np.float32)
    else:  # markov
        x = normal() * np.float32(0.1)
    return as_bf16(x) if x.size <= CHUNK else _round_inplace(x)


def _round_inplace(x: np.ndarray) -> np.ndarray:
    flat = x.reshape(-1)
    for start in range(0, flat.size, CHUNK):
        flat[start : start + CHUNK] = bf16_bits_to_f32(f32_to_bf16_bits(flat[start : start + CHUNK]))
    return x
