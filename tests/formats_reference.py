"""Shared by tests/test_formats_*.py: the ModelOpt golden file, bit views, and a
reference NVFP4 quantizer written from docs/formats.md section 3 with ml_dtypes rounding.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from monolith.formats import quantize_nvfp4

GOLDEN = Path(__file__).parent / "data" / "nvfp4_modelopt_golden.safetensors"
F4 = ml_dtypes.float4_e2m1fn
F8 = ml_dtypes.float8_e4m3fn
GOLDEN_CASES = ["mixed_edges", "small_uniform", "heavy_tail"]


def f32_bits(x) -> np.ndarray:
    return np.array(x, dtype=np.float32).view(np.uint32)  # keeps 0-d as 0-d


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to BF16 (what a checkpoint holds), as float32."""
    return np.asarray(x.astype(ml_dtypes.bfloat16), dtype=np.float32)


# ---------------------------------------------------------------------------------
# Independent reference: docs/formats.md section 3, rounding done by ml_dtypes casts.
# ---------------------------------------------------------------------------------


def ref_e2m1_codes(x: np.ndarray) -> np.ndarray:
    """E2M1 codes per ml_dtypes after clipping to +-6 (sign of zero kept)."""
    return np.clip(np.asarray(x, np.float32), -6.0, 6.0).astype(F4).view(np.uint8)


def ref_quantize_modelopt(w: np.ndarray):
    """docs/formats.md section 3, written independently of monolith (ml_dtypes rounding).

    An all-zero matrix has tensor scale 0, which the spec leaves open; like monolith we
    then encode the raw (zero) values, so +0 -> code 0, -0 -> code 8, scales 0x38."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    tensor_scale = np.float32(np.abs(w).max()) / np.float32(6 * 448)
    blocks = w.reshape(n, k // 16, 16)
    block_amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = block_amax / (np.float32(6) * tensor_scale)
    s = np.where(block_amax == 0, np.float32(1.0), s)
    s = np.clip(s, np.float32(2.0**-9), np.float32(448)).astype(np.float32)
    s_e4m3 = s.astype(F8)
    divisor = (s_e4m3.astype(np.float32) * tensor_scale)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        x = blocks / divisor
    x = np.where(divisor == 0, blocks, x)
    codes = ref_e2m1_codes(x).reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, s_e4m3.view(np.uint8), np.float32(tensor_scale)


def assert_same_quantization(w: np.ndarray) -> None:
    q = quantize_nvfp4(w)
    packed, scales, ts = ref_quantize_modelopt(w)
    np.testing.assert_array_equal(q.scales, scales)
    np.testing.assert_array_equal(q.packed, packed)
    assert f32_bits(q.tensor_scale) == f32_bits(ts)
