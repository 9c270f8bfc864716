"""The quantized KV cache (--kv-bits, docs/operations.md "Memory"): a KVCache whose
attention rows are stored group-wise quantized, about half (8-bit) or a quarter (4-bit)
of their bytes in the compute dtype plus a scale and a bias per group. Only the
target's attention layers use it; the drafts' contexts keep their rows as computed."""

from __future__ import annotations

import mlx.core as mx

from .cache import KVCache, padded
from .layers import Quantized

KV_BITS = (8, 4)  # --kv-bits: the quantized KV caches
KV_GROUP = 64  # values per scale and bias (32 where head_dim is not a multiple of it)


class QuantizedKVCache(KVCache):
    """A KVCache whose keys and values are stored group-wise quantized (mx.quantize,
    affine, `bits` 8 or 4, groups of KV_GROUP along head_dim, 32 where head_dim is not a
    multiple of it): per K and V the packed words [1, kv_heads, rows, head_dim * bits / 32]
    (uint32) and a scale and bias per group [1, kv_heads, rows, head_dim / group] in the
    compute dtype. Each row is quantized alone, so rows written by a verify block equal
    the same rows written one at a time, and a rewind is still only the offset. `update`
    returns `Quantized` rows for layers.attention. `rows` gives each row as one uint32
    array [1, kv_heads, T, words + 2 * groups]: the words, then the scales and the biases
    as F32 bits (lossless from any compute dtype), which `write` takes back."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int, dtype, bits: int):
        if bits not in KV_BITS:
            raise ValueError(f"KV bits must be one of {KV_BITS}, got {bits}")
        group = KV_GROUP if head_dim % KV_GROUP == 0 else 32
        if head_dim % group:
            raise ValueError(f"a quantized KV cache needs head_dim a multiple of 32, got {head_dim}")
        self.capacity, self.bits, self.group_size, self.dtype = capacity, bits, group, dtype
        self.words, self.groups = head_dim * bits // 32, head_dim // group

        def empty() -> tuple:
            return (mx.zeros((1, kv_heads, 0, self.words), mx.uint32), mx.zeros((1, kv_heads, 0, self.groups), dtype),
                    mx.zeros((1, kv_heads, 0, self.groups), dtype))

        self.keys, self.values = empty(), empty()

    @property
    def allocated(self) -> int:
        return self.keys[0].shape[2]

    @property
    def layout(self) -> tuple:
        return self.keys[0].shape[1], self.words + 2 * self.groups, mx.uint32

    def _grow(self, rows: int) -> None:
        self.keys = tuple(padded(a, rows) for a in self.keys)
        self.values = tuple(padded(a, rows) for a in self.values)

    def update(self, keys: mx.array, values: mx.array, offset: int) -> tuple[Quantized, Quantized]:
        end = offset + keys.shape[2]
        self._reserve(end)
        for stored, new in ((self.keys, keys), (self.values, values)):
            for part, rows in zip(stored, mx.quantize(new, group_size=self.group_size, bits=self.bits)):
                part[:, :, offset:end] = rows
        return self._quantized(self.keys, end), self._quantized(self.values, end)

    def _quantized(self, stored: tuple, end: int) -> Quantized:
        return Quantized(*(a[:, :, :end] for a in stored), self.group_size, self.bits)

    def rows(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        def joined(stored: tuple) -> mx.array:
            packed, scales, biases = (a[:, :, start:end] for a in stored)
            return mx.concatenate([packed, scales.astype(mx.float32).view(mx.uint32),
                                   biases.astype(mx.float32).view(mx.uint32)], axis=-1)

        return joined(self.keys), joined(self.values)

    def write(self, start: int, keys: mx.array, values: mx.array) -> None:
        end = self._check_rows(start, keys)
        w, g = self.words, self.groups
        for stored, rows in ((self.keys, keys), (self.values, values)):
            parts = (rows[..., :w], rows[..., w:w + g].view(mx.float32), rows[..., w + g:].view(mx.float32))
            for part, new in zip(stored, parts):
                part[:, :, start:end] = new.astype(part.dtype)

    def dequantized(self, end: int) -> tuple[mx.array, mx.array]:
        """Keys and values of rows [0, end) as the compute dtype (for comparing)."""
        return self._quantized(self.keys, end).dequantize(), self._quantized(self.values, end).dequantize()


def kv_cache(kv_heads: int, head_dim: int, capacity: int, dtype, bits: int | None = None) -> KVCache:
    """A KVCache, quantized to `bits` when given (--kv-bits)."""
    if bits is None:
        return KVCache(kv_heads, head_dim, capacity, dtype)
    return QuantizedKVCache(kv_heads, head_dim, capacity, dtype, bits)
