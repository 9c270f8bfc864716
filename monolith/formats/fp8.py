"""FP8 (E4M3) weights with a per-tensor or per-output-channel F32 scale: w = fp8 * scale."""

from __future__ import annotations

import numpy as np

from .codecs import E4M3_MAX, ENCODE_CHUNK, e4m3_decode, e4m3_encode
from .nvfp4 import FormatError


def quantize_fp8(weight: np.ndarray, per_channel: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] -> (E4M3 codes uint8 [N, K], F32 scale: 0-d, or [N, 1] per channel)."""
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise FormatError(f"FP8 quantization needs a 2-D matrix, got {w.shape}")
    axis = 1 if per_channel else None
    amax = np.maximum(np.max(w, axis=axis, keepdims=per_channel), -np.min(w, axis=axis, keepdims=per_channel))
    scale = (np.asarray(amax, dtype=np.float32) / np.float32(E4M3_MAX)).astype(np.float32)
    scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
    return encode_fp8(w, scale), scale


def encode_fp8(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """E4M3 codes of weight [N, K] / scale (0-d, or [N, 1] per channel), a block of rows
    at a time (a [248320, 5120] lm_head needs no full-size float temporaries)."""
    w = np.asarray(weight, dtype=np.float32)
    s = np.asarray(scale, dtype=np.float32)
    codes = np.empty(w.shape, dtype=np.uint8)
    step = max(1, ENCODE_CHUNK // max(1, w.shape[1]))
    for start in range(0, w.shape[0], step):
        rows = s if s.ndim == 0 else s[start : start + step]
        codes[start : start + step] = e4m3_encode(w[start : start + step] / rows)
    return codes


def dequantize_fp8(codes: np.ndarray, scale, name: str = "tensor") -> np.ndarray:
    """E4M3 codes [N, K] times a scale that is 0-d, [1], [N] or [N, 1] -> float32."""
    codes = np.asarray(codes, dtype=np.uint8)
    s = np.asarray(scale, dtype=np.float32)
    if s.size == 1:
        s = s.reshape(())
    elif s.size == codes.shape[0]:
        s = s.reshape(-1, 1)
    else:
        raise FormatError(
            f"{name}: FP8 scale of shape {s.shape} fits neither one tensor nor "
            f"{codes.shape[0]} output channels"
        )
    return (e4m3_decode(codes) * s).astype(np.float32)
