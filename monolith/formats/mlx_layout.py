"""Zero-copy mapping between checkpoint bytes and MLX's quantized-matmul operands.

MLX `mode="nvfp4"` weights are uint32 [N, K/8] holding eight E2M1 codes, the first in
the lowest nibble: exactly the ModelOpt U8 [N, K/2] bytes read as little-endian
uint32. Its uint8 scales [N, K/16] are the E4M3 bytes unchanged. Per-tensor FP8 stays
8-bit as `mode="mxfp8"` words (four E4M3 bytes per uint32) with every E8M0 group
scale 127 (= 1.0); the F32 tensor scale is applied after the matmul.
"""

from __future__ import annotations

import numpy as np

from .nvfp4 import FormatError

MXFP8_GROUP = 32
E8M0_ONE = 127


def _as_words(data: np.ndarray, per_word: int, name: str) -> np.ndarray:
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.shape[-1] % per_word:
        raise FormatError(f"{name}: last dimension {data.shape[-1]} is not a multiple of {per_word}")
    return data.view("<u4")


def nvfp4_to_words(packed: np.ndarray, name: str = "tensor") -> np.ndarray:
    """U8 [..., N, K/2] -> uint32 [..., N, K/8] (a view, no copy when contiguous)."""
    return _as_words(packed, 4, name)


def words_to_bytes(words: np.ndarray) -> np.ndarray:
    """uint32 [..., N, W] -> U8 [..., N, 4W]: the inverse of the word view."""
    return np.ascontiguousarray(words, dtype="<u4").view(np.uint8)


def fp8_to_words(codes: np.ndarray, name: str = "tensor") -> np.ndarray:
    """E4M3 U8 [N, K] -> uint32 [N, K/4] for mode="mxfp8" (needs K % 32 == 0)."""
    if codes.shape[-1] % MXFP8_GROUP:
        raise FormatError(f"{name}: K={codes.shape[-1]} is not a multiple of {MXFP8_GROUP} for mxfp8")
    return _as_words(codes, 4, name)


def mxfp8_unit_scales(n: int, k: int) -> np.ndarray:
    """E8M0 scales of 1.0 for an [n, k] mxfp8 matrix."""
    return np.full((n, k // MXFP8_GROUP), E8M0_ONE, dtype=np.uint8)
