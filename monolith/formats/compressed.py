"""compressed-tensors NVFP4 (`nvfp4-pack-quantized`): same codes and block scales as
ModelOpt, but a *global* scale that dequantization divides by."""

from __future__ import annotations

import numpy as np

from .codecs import E2M1_MAX, E4M3_MAX, e2m1_encode, e4m3_decode, e4m3_encode, pack_nibbles
from .nvfp4 import BLOCK, FormatError, NVFP4Weight, check_nvfp4_shapes

ZERO_SCALE_REPLACEMENT = 0x20  # compressed-tensors replaces a zero E4M3 scale by 0.125


def tensor_scale_from_global(global_scale, name: str = "tensor") -> np.float32:
    """weight_global_scale ([1] or 0-d) -> our multiplicative tensor scale."""
    g = np.asarray(global_scale, dtype=np.float32).reshape(-1)
    if g.size != 1:
        raise FormatError(f"{name}: weight_global_scale must hold one value, got shape {g.shape}")
    if not np.isfinite(g[0]) or g[0] <= 0:
        raise FormatError(f"{name}: weight_global_scale must be positive and finite, got {g[0]}")
    return np.float32(1.0) / g[0]


def from_compressed_nvfp4(packed, scales, global_scale, name: str = "tensor") -> NVFP4Weight:
    """weight_packed, weight_scale, weight_global_scale -> NVFP4Weight (no arithmetic on
    codes or block scales)."""
    check_nvfp4_shapes(packed.shape, scales.shape, name)
    return NVFP4Weight(packed, scales, tensor_scale_from_global(global_scale, name))


def quantize_compressed_nvfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize byte-exactly as compressed-tensors' min-max path (what llm-compressor
    calls) does: global_scale = (1 / amax) * 2688, block scale = E4M3(global_scale *
    (block_amax / 6)) with a zero scale replaced by E4M3's smallest normal step
    (byte 0x20), codes from w / (scale / global_scale), sign only for w < 0.
    Returns (weight_packed, weight_scale, weight_global_scale [1])."""
    w = np.asarray(weight, dtype=np.float32)
    n, k = w.shape
    if k % BLOCK:
        raise FormatError(f"input size K={k} is not a multiple of {BLOCK}")
    amax = np.float32(np.max(np.abs(w), initial=0.0))
    global_scale = (np.float32(1.0) / amax) * np.float32(E4M3_MAX * E2M1_MAX) if amax > 0 else np.float32(1.0)
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    block_amax = np.max(np.abs(blocks), axis=-1)
    scale_codes = e4m3_encode(global_scale * (block_amax / np.float32(E2M1_MAX)))
    scale_codes[scale_codes == 0] = ZERO_SCALE_REPLACEMENT
    x = blocks / (e4m3_decode(scale_codes) / global_scale)[..., None]
    x = np.clip(x, -E2M1_MAX, E2M1_MAX)
    codes = e2m1_encode(np.abs(x)) | ((x < 0).astype(np.uint8) << 3)
    return pack_nibbles(codes.reshape(n, k)), scale_codes, np.array([global_scale], dtype=np.float32)
