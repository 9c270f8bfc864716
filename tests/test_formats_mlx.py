"""monolith.formats' MLX mapping against MLX's own `quantized_matmul`, `gather_qmm`,
`dequantize`, `quantize` and `from_fp8`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from formats_reference import bf16_round

from monolith.formats import (
    FormatError,
    dequantize_fp8,
    dequantize_nvfp4,
    e2m1_decode,
    e4m3_decode,
    fp8_to_words,
    mxfp8_unit_scales,
    nvfp4_to_words,
    quantize_fp8,
    quantize_nvfp4,
    unpack_nibbles,
    words_to_bytes,
)

# ---------------------------------------------------------------------------------
# MLX mapping
# ---------------------------------------------------------------------------------


def _matmul_tolerance(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Float32 accumulation bound, relative to sum |x_i d_i| (a wrong layout is O(1))."""
    return 4e-6 * (np.abs(x).astype(np.float64) @ np.abs(d).astype(np.float64).T) + 1e-30


@pytest.mark.parametrize("m,n,k", [(1, 32, 64), (7, 48, 128), (16, 64, 512), (3, 8, 192)])
def test_mlx_quantized_matmul_equals_dequantized_matmul(m, n, k):
    rng = np.random.default_rng(m * 1000 + k)
    w = bf16_round(rng.standard_t(3, (n, k)).astype(np.float32) * 0.05)
    w[0, :16] = 0.0
    q = quantize_nvfp4(w)
    d = dequantize_nvfp4(q.packed, q.scales, q.tensor_scale)
    x = rng.standard_normal((m, k)).astype(np.float32)
    words = nvfp4_to_words(q.packed)
    assert words.dtype == np.uint32 and words.shape == (n, k // 8)
    y = mx.quantized_matmul(
        mx.array(x), mx.array(words), mx.array(q.scales),
        transpose=True, group_size=16, bits=4, mode="nvfp4",
    ) * mx.array(q.tensor_scale)
    y = np.array(y)
    ref = x.astype(np.float64) @ d.astype(np.float64).T
    assert np.all(np.abs(y - ref) <= _matmul_tolerance(x, d))

    # mx.dequantize gives our values before the tensor scale, exactly.
    dq = mx.dequantize(mx.array(words), mx.array(q.scales), group_size=16, bits=4,
                       mode="nvfp4", dtype=mx.float32)
    np.testing.assert_array_equal(np.array(dq), dequantize_nvfp4(q.packed, q.scales, np.float32(1)))
    np.testing.assert_array_equal(words_to_bytes(words), q.packed)


def test_mlx_fused_rows_with_per_row_tensor_scale():
    """Rows of several source matrices fused into one operand (e.g. gate|up): the
    quantized matmul times a per-output-row tensor scale equals the float matmul."""
    rng = np.random.default_rng(20)
    k = 128
    parts = [quantize_nvfp4(bf16_round(rng.standard_normal((n, k)).astype(np.float32) * s))
             for n, s in [(16, 0.01), (24, 3.0), (8, 1e-4)]]
    packed = np.concatenate([p.packed for p in parts])
    scales = np.concatenate([p.scales for p in parts])
    row_scale = np.concatenate([np.full(p.packed.shape[0], p.tensor_scale, np.float32) for p in parts])
    d = np.concatenate([dequantize_nvfp4(p.packed, p.scales, p.tensor_scale) for p in parts])
    np.testing.assert_array_equal(dequantize_nvfp4(packed, scales, row_scale), d)
    x = rng.standard_normal((4, k)).astype(np.float32)
    y = mx.quantized_matmul(mx.array(x), mx.array(nvfp4_to_words(packed)), mx.array(scales),
                            transpose=True, group_size=16, bits=4, mode="nvfp4")
    y = np.array(y * mx.array(row_scale))
    ref = x.astype(np.float64) @ d.astype(np.float64).T
    assert np.all(np.abs(y - ref) <= _matmul_tolerance(x, d))


def test_nvfp4_words_are_a_view_and_round_trip():
    rng = np.random.default_rng(13)
    packed = rng.integers(0, 256, (3, 5, 32), dtype=np.uint8)
    words = nvfp4_to_words(packed)
    assert words.shape == (3, 5, 8) and np.shares_memory(words, packed)
    np.testing.assert_array_equal(words_to_bytes(words), packed)
    # little-endian: first byte in the lowest 8 bits, so code 0 in the lowest nibble
    assert words[0, 0, 0] == int.from_bytes(packed[0, 0, :4].tobytes(), "little")
    with pytest.raises(FormatError, match="odd"):
        nvfp4_to_words(np.zeros((2, 6), np.uint8), name="odd")


def test_mlx_gather_qmm_stacked_experts():
    rng = np.random.default_rng(14)
    e, n, k = 4, 32, 64
    qs = [quantize_nvfp4(bf16_round(rng.standard_normal((n, k)).astype(np.float32) * (i + 1)))
          for i in range(e)]
    words = np.stack([nvfp4_to_words(q.packed) for q in qs])
    scales = np.stack([q.scales for q in qs])
    ts = np.array([q.tensor_scale for q in qs], np.float32)
    deq = [dequantize_nvfp4(q.packed, q.scales, q.tensor_scale) for q in qs]
    # the stacked dequantizer with a per-expert scale agrees with the per-matrix one
    stacked = dequantize_nvfp4(np.stack([q.packed for q in qs]), scales, ts[:, None])
    np.testing.assert_array_equal(stacked, np.stack(deq))

    idx = np.array([0, 0, 1, 2, 3, 3, 3], np.uint32)
    x = rng.standard_normal((len(idx), 1, k)).astype(np.float32)
    y = mx.gather_qmm(
        mx.array(x), mx.array(words), mx.array(scales), rhs_indices=mx.array(idx),
        transpose=True, group_size=16, bits=4, mode="nvfp4", sorted_indices=True,
    )
    y = np.array(y) * ts[idx][:, None, None]
    assert y.shape == (len(idx), 1, n)
    for t, ex in enumerate(idx):
        ref = x[t].astype(np.float64) @ deq[ex].astype(np.float64).T
        assert np.all(np.abs(y[t] - ref) <= _matmul_tolerance(x[t], deq[ex]))


@pytest.mark.parametrize("per_channel", [False, True])
def test_mlx_mxfp8_unit_scales_equal_dequantized_fp8(per_channel):
    rng = np.random.default_rng(15)
    n, k = 24, 96
    w = bf16_round(rng.standard_normal((n, k)).astype(np.float32))
    codes, scale = quantize_fp8(w, per_channel=per_channel)
    d = dequantize_fp8(codes, scale)
    words = fp8_to_words(codes)
    unit = mxfp8_unit_scales(n, k)
    assert words.shape == (n, k // 4) and unit.shape == (n, k // 32) and np.all(unit == 127)
    x = rng.standard_normal((5, k)).astype(np.float32)
    y = mx.quantized_matmul(mx.array(x), mx.array(words), mx.array(unit), transpose=True,
                            group_size=32, bits=8, mode="mxfp8")
    y = np.array(y) * np.asarray(scale, np.float32).reshape(1, -1)
    ref = x.astype(np.float64) @ d.astype(np.float64).T
    assert np.all(np.abs(y - ref) <= _matmul_tolerance(x, d))
    dq = mx.dequantize(mx.array(words), mx.array(unit), group_size=32, bits=8, mode="mxfp8",
                       dtype=mx.float32)
    np.testing.assert_array_equal(np.array(dq), e4m3_decode(codes))
    with pytest.raises(FormatError, match="mxfp8"):
        fp8_to_words(np.zeros((2, 48), np.uint8))


def test_mlx_from_fp8_matches_our_e4m3_table():
    codes = np.arange(256, dtype=np.uint8)
    theirs = np.array(mx.from_fp8(mx.array(codes), dtype=mx.float32))
    np.testing.assert_array_equal(theirs, e4m3_decode(codes))  # NaN == NaN here


def test_mlx_quantize_differs_from_modelopt_only_in_zero_encodings():
    """docs/formats.md 4: mx.quantize(mode="nvfp4") is not ModelOpt's quantizer. It has no
    tensor scale (we feed it w / tensor_scale so the block scales are comparable), and
    then every decoded value is the same; the bytes differ only in zero encodings:
    - an all-zero block: scale byte 0x00 there, 0x38 here;
    - a block too small for the smallest scale: 0x00 there (no clamp), 0x01 here
      (clamped to 2^-9); its values are zero either way;
    - values that round to zero: +0 (code 0) there; -0 (code 8) here when negative."""
    rng = np.random.default_rng(16)
    w = rng.standard_normal((16, 128)).astype(np.float32)
    w[1, 16:32] = 0.0
    w[2, :16] = -1e-30
    w[2, 16:32] = -0.0
    q = quantize_nvfp4(w)
    wq, sq = mx.quantize(mx.array(w / q.tensor_scale), group_size=16, bits=4, mode="nvfp4")[:2]
    their_scales = np.array(sq)
    their_codes = unpack_nibbles(words_to_bytes(np.array(wq)))
    our_codes = unpack_nibbles(q.packed)

    np.testing.assert_array_equal(e2m1_decode(their_codes), e2m1_decode(our_codes))  # -0 == 0
    scale_differs = their_scales != q.scales
    assert scale_differs[1, 1] and scale_differs[2, 0] and scale_differs[2, 1]
    assert their_scales[1, 1] == 0 and q.scales[1, 1] == 0x38  # all-zero block
    assert their_scales[2, 0] == 0 and q.scales[2, 0] == 0x01  # tiny block, clamped here
    assert np.all(their_scales[scale_differs] == 0)
    dead = np.all((our_codes.reshape(16, 8, 16) & 7) == 0, axis=-1)
    assert np.all(dead[scale_differs])  # only blocks whose values are all zero

    code_differs = their_codes != our_codes
    assert code_differs.sum() > 16
    assert np.all(our_codes[code_differs] == 8) and np.all(their_codes[code_differs] == 0)
