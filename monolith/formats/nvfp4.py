"""NVFP4: ModelOpt's weight quantizer reproduced bit-exactly, and the dequantizer.

A quantized matrix W [N, K] is (packed codes U8 [N, K/2], E4M3 block scales U8
[N, K/16], F32 tensor scale); w = E2M1[code] * E4M3[scale] * tensor_scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .codecs import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    pack_nibbles,
    unpack_nibbles,
)

BLOCK = 16
ROW_CHUNK_ELEMENTS = 1 << 21


class FormatError(ValueError):
    """A tensor does not have the shape, dtype or contents its format requires."""


@dataclass(frozen=True)
class NVFP4Weight:
    packed: np.ndarray  # uint8 [..., N, K/2], even column in the low nibble
    scales: np.ndarray  # uint8 E4M3 [..., N, K/16]
    tensor_scale: np.float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.packed.shape[:-1] + (self.packed.shape[-1] * 2,)


def check_nvfp4_shapes(packed_shape, scales_shape, name: str = "tensor") -> None:
    """Raise FormatError unless the codes and scales describe one [N, K] matrix."""
    if len(packed_shape) < 2 or len(scales_shape) != len(packed_shape):
        raise FormatError(
            f"{name}: NVFP4 codes {tuple(packed_shape)} and scales {tuple(scales_shape)} "
            "must both be 2-D (or stacked 3-D)"
        )
    k = packed_shape[-1] * 2
    if k % BLOCK:
        raise FormatError(f"{name}: input size K={k} is not a multiple of {BLOCK}")
    expected = tuple(packed_shape[:-1]) + (k // BLOCK,)
    if tuple(scales_shape) != expected:
        raise FormatError(
            f"{name}: scales shape {tuple(scales_shape)} does not match codes "
            f"{tuple(packed_shape)} (expected {expected})"
        )


def quantize_nvfp4(weight: np.ndarray, name: str = "tensor") -> NVFP4Weight:
    """Quantize [N, K] exactly as ModelOpt's NVFP4QTensor.quantize(w, 16) does.

    `weight` holds the source values (normally BF16 values, given as float32).
    """
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise FormatError(f"{name}: NVFP4 quantization needs a 2-D matrix, got {w.shape}")
    n, k = w.shape
    if k % BLOCK:
        raise FormatError(f"{name}: input size K={k} is not a multiple of {BLOCK}")
    rows = max(1, ROW_CHUNK_ELEMENTS // k)  # bounds the temporaries on large matrices
    amax = np.float32(0.0)
    for start in range(0, n, rows):  # no full-size |w| or isfinite temporaries
        part = w[start:start + rows]
        if not np.isfinite(part).all():
            raise FormatError(f"{name}: contains NaN or infinity; cannot quantize")
        amax = max(amax, np.float32(part.max(initial=0.0)), np.float32(-part.min(initial=0.0)))
    tensor_scale = np.float32(amax) / np.float32(E2M1_MAX * E4M3_MAX)
    packed = np.empty((n, k // 2), dtype=np.uint8)
    scales = np.empty((n, k // BLOCK), dtype=np.uint8)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        packed[start:stop], scales[start:stop] = _quantize_rows(w[start:stop], tensor_scale)
    return NVFP4Weight(packed, scales, np.float32(tensor_scale))


def _quantize_rows(w: np.ndarray, tensor_scale: np.float32) -> tuple[np.ndarray, np.ndarray]:
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    block_amax = np.max(np.abs(blocks), axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = block_amax / (np.float32(E2M1_MAX) * tensor_scale)
    scale = np.where(block_amax == 0, np.float32(1.0), scale)
    scale = np.clip(scale, np.float32(E4M3_MIN_SUBNORMAL), np.float32(E4M3_MAX))
    scale_codes = e4m3_encode(scale)

    divisor = e4m3_decode(scale_codes) * tensor_scale
    with np.errstate(divide="ignore", invalid="ignore"):
        x = blocks / divisor[..., None]
    x = np.where(divisor[..., None] == 0, blocks, x)  # an all-zero matrix stays zero
    x = np.clip(x, -E2M1_MAX, E2M1_MAX)
    return pack_nibbles(e2m1_encode(x).reshape(n, k)), scale_codes


def dequantize_nvfp4(
    packed: np.ndarray, scales: np.ndarray, tensor_scale, name: str = "tensor"
) -> np.ndarray:
    """Codes [..., N, K/2], scales [..., N, K/16], tensor scale (scalar or broadcastable
    over rows) -> float32 [..., N, K]."""
    check_nvfp4_shapes(packed.shape, scales.shape, name)
    values = e2m1_decode(unpack_nibbles(packed))
    lead = values.shape[:-1]
    k = values.shape[-1]
    blocks = values.reshape(lead + (k // BLOCK, BLOCK)) * e4m3_decode(scales)[..., None]
    ts = np.asarray(tensor_scale, dtype=np.float32)
    if ts.ndim:  # per-row scales [..., N]
        ts = ts[..., None, None]
    return (blocks * ts).reshape(lead + (k,)).astype(np.float32)
