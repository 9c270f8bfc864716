"""monolith.formats against independent references.

References used (none of them is our own code):
- `ml_dtypes` float4_e2m1fn / float8_e4m3fn casts for every code and rounding decision;
- NVIDIA's golden bytes (nvidia-modelopt 0.47.0 `NVFP4QTensor.quantize`) in
  tests/data/nvfp4_modelopt_golden.safetensors, and a reference quantizer written here
  from docs/formats.md section 3 with ml_dtypes rounding;
- the `compressed_tensors` package's own unpack / pack / dequantize / quantize;
- MLX's own `quantized_matmul`, `gather_qmm`, `dequantize`, `quantize`;
- `mx.load` and `safetensors.safe_open` for the files we write.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import mlx.core as mx
import numpy as np
import pytest
from safetensors import safe_open

from monolith.formats import (
    BLOCK,
    FormatError,
    SafetensorsFile,
    bf16_bits_to_f32,
    check_nvfp4_shapes,
    dequantize_fp8,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    f32_to_bf16_bits,
    fp8_to_words,
    from_compressed_nvfp4,
    mxfp8_unit_scales,
    nvfp4_to_words,
    pack_nibbles,
    quantize_compressed_nvfp4,
    quantize_fp8,
    quantize_nvfp4,
    tensor_scale_from_global,
    unpack_nibbles,
    words_to_bytes,
    write_safetensors,
)
from monolith.formats.stfile import STORAGE_DTYPES

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
    """formats.md section 3, written independently of monolith (ml_dtypes rounding).

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


# ---------------------------------------------------------------------------------
# 1. Codecs against ml_dtypes
# ---------------------------------------------------------------------------------


def test_e2m1_decode_all_16_codes_match_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    theirs = codes.view(F4).astype(np.float32)
    ours = e2m1_decode(codes)
    np.testing.assert_array_equal(f32_bits(ours), f32_bits(theirs))  # -0 for code 8 too
    assert f32_bits(ours[8]) == 0x80000000


def test_e4m3_decode_all_256_codes_match_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    theirs = codes.view(F8).astype(np.float32)
    ours = e4m3_decode(codes)
    nan = np.isnan(theirs)
    np.testing.assert_array_equal(np.isnan(ours), nan)
    assert set(np.flatnonzero(nan)) == {0x7F, 0xFF}
    np.testing.assert_array_equal(f32_bits(ours[~nan]), f32_bits(theirs[~nan]))
    # formats.md section 1 anchors
    assert ours[0x38] == 1.0 and ours[0x7E] == 448.0 and ours[0x01] == 2.0**-9


def _e4m3_probe_values(rng) -> np.ndarray:
    pos = np.arange(0x7F, dtype=np.uint8).view(F8).astype(np.float32)  # 0 .. 448
    mids = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)  # exact in f32
    assert np.all(mids.astype(np.float64) == (pos[:-1].astype(np.float64) + pos[1:]) / 2)
    near = np.concatenate(
        [np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))]
    )
    log_random = np.exp2(rng.uniform(-14, np.log2(463.9), 20000)).astype(np.float32)
    special = np.array(
        [
            0.0, 2.0**-10, 2.0**-11, 2.0**-9, 1.5 * 2.0**-10, 1e-40, 1e-45, 1e-30,
            440.0, 447.99, 448.0, np.nextafter(np.float32(448), np.float32(np.inf)),
            455.99, 456.0, 463.0, np.nextafter(np.float32(464), np.float32(0)), 464.0,
        ],
        dtype=np.float32,
    )
    mags = np.concatenate([pos, mids, near, log_random, special]).astype(np.float32)
    return np.concatenate([mags, -mags, np.array([-0.0], np.float32)])


def test_e4m3_encode_matches_ml_dtypes_up_to_464():
    rng = np.random.default_rng(1)
    x = _e4m3_probe_values(rng)
    assert np.all(np.abs(x) <= 464)
    ours = e4m3_encode(x)
    theirs = x.astype(F8).view(np.uint8)
    np.testing.assert_array_equal(ours, theirs)
    # Ties go to the even mantissa; the sign of zero is kept.
    assert e4m3_encode(np.float32(1.0625)) == 0x38  # between 1.0 (000) and 1.125 (001)
    assert e4m3_encode(np.float32(1.1875)) == 0x3A  # between 1.125 (001) and 1.25 (010)
    assert e4m3_encode(np.float32(2.0**-10)) == 0x00  # half the smallest subnormal
    assert e4m3_encode(np.float32(-0.0)) == 0x80
    assert e4m3_encode(np.float32(-1e-30)) == 0x80


def test_encoders_accept_scalars_and_keep_shape():
    """Regression: a 0-d input (np.float32 or np.array(x)) used to raise TypeError
    ('numpy.int64' object does not support item assignment) in _round_to_grid."""
    for x in (np.float32(1.0625), np.array(1.0625, np.float32), 1.0625):
        assert int(e4m3_encode(x)) == 0x38
        assert np.shape(e4m3_encode(x)) == ()
        assert int(e2m1_encode(x)) == 2
        assert np.shape(e2m1_encode(x)) == ()
    assert int(e4m3_encode(np.float32(np.nan))) == 0x7F
    assert int(e4m3_encode(np.float32(-0.0))) == 0x80
    assert int(e2m1_encode(np.float32(-1e-30))) == 8
    assert e4m3_encode(np.ones((2, 0, 3), np.float32)).shape == (2, 0, 3)
    assert e2m1_encode(np.ones((3, 1), np.float32)).shape == (3, 1)


def test_e4m3_encode_saturates_where_ml_dtypes_gives_nan():
    """Documented difference: ml_dtypes float8_e4m3fn rounds [448, 464] to 448 (464 is
    the tie between 448 and the NaN slot 0x7F, resolved to the even 448) but turns
    |x| > 464 and +-inf into NaN (the format has no infinity); our encoder saturates
    every overflow, infinities included, to +-448 (0x7E / 0xFE). NaN -> 0x7F in ours."""
    assert np.array([464.0], np.float32).astype(F8).view(np.uint8)[0] == 0x7E
    above = np.nextafter(np.float32(464), np.float32(np.inf))
    big = np.array([above, 465.0, 500.0, 1e6, 3e38, np.inf], dtype=np.float32)
    assert np.all(np.isnan(big.astype(F8).astype(np.float32)))
    assert np.all(np.isnan((-big).astype(F8).astype(np.float32)))
    np.testing.assert_array_equal(e4m3_encode(big), np.full(big.shape, 0x7E, np.uint8))
    np.testing.assert_array_equal(e4m3_encode(-big), np.full(big.shape, 0xFE, np.uint8))
    assert e4m3_encode(np.float32(np.nan)) == 0x7F


def test_e2m1_encode_matches_ml_dtypes_after_clipping():
    rng = np.random.default_rng(2)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
    mids = (grid[:-1] + grid[1:]) / 2  # 0.25 0.75 1.25 1.75 2.5 3.5 5: exact
    near = np.concatenate([np.nextafter(mids, np.float32(9)), np.nextafter(mids, np.float32(0))])
    special = np.array(
        [0.0, 1e-30, 1e-45, 5.99, 6.0, 6.01, 7.0, 100.0, 3e38, np.inf], dtype=np.float32
    )
    mags = np.concatenate([grid, mids, near, special, rng.uniform(0, 8, 20000).astype(np.float32)])
    x = np.concatenate([mags, -mags, np.array([-0.0], np.float32)]).astype(np.float32)
    ours = e2m1_encode(x)
    np.testing.assert_array_equal(ours, ref_e2m1_codes(x))
    # sign of zero: -0 and tiny negatives are code 8 ("-0")
    np.testing.assert_array_equal(
        e2m1_encode(np.array([-0.0, -1e-30, -0.25, 0.0, 1e-30, 0.25], np.float32)),
        [8, 8, 8, 0, 0, 0],
    )


def test_bf16_bits_round_trip_matches_ml_dtypes():
    rng = np.random.default_rng(3)
    x = np.concatenate(
        [
            rng.standard_normal(5000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 5000),
            np.array([0.0, -0.0, 1e-40, -1e-40, np.inf, -np.inf, 3.4e38], np.float32),
            # exact ties between two BF16 values
            (np.arange(1000, dtype=np.uint32) << 16 | 0x8000).view(np.float32),
        ]
    ).astype(np.float32)
    ours = f32_to_bf16_bits(x)
    theirs = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    back = bf16_bits_to_f32(ours)
    np.testing.assert_array_equal(f32_bits(back), f32_bits(theirs.view(ml_dtypes.bfloat16).astype(np.float32)))
    assert np.isnan(bf16_bits_to_f32(f32_to_bf16_bits(np.float32(np.nan))))


# ---------------------------------------------------------------------------------
# 2. ModelOpt NVFP4 quantizer
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden():
    with safe_open(str(GOLDEN), "np") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return meta, tensors


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_quantizer_reproduces_modelopt_golden_bytes(golden, case):
    meta, t = golden
    assert json.loads(meta["cases"])[case] == list(t[f"{case}.input_bf16_bits"].shape)
    w = bf16_bits_to_f32(t[f"{case}.input_bf16_bits"])
    gold_packed = t[f"{case}.weight"]
    gold_scales = t[f"{case}.weight_scale"]
    gold_ts = t[f"{case}.weight_scale_2"]
    assert gold_ts.shape == () and gold_ts.dtype == np.float32

    q = quantize_nvfp4(w, name=case)
    np.testing.assert_array_equal(q.packed, gold_packed)
    np.testing.assert_array_equal(q.scales, gold_scales)
    assert f32_bits(q.tensor_scale) == f32_bits(gold_ts)

    # The reference written from formats.md section 3 matches NVIDIA's bytes too.
    packed, scales, ts = ref_quantize_modelopt(w)
    np.testing.assert_array_equal(packed, gold_packed)
    np.testing.assert_array_equal(scales, gold_scales)
    assert f32_bits(ts) == f32_bits(gold_ts)


def test_golden_mixed_edges_covers_the_edge_cases(golden):
    """The README's claims about the golden file, checked on NVIDIA's own bytes."""
    _, t = golden
    scales = t["mixed_edges.weight_scale"]
    codes = unpack_nibbles(t["mixed_edges.weight"])
    assert scales[1, 1] == 0x38  # all-zero block (row 1, cols 16-31) -> scale 1.0
    np.testing.assert_array_equal(codes[1, 16:32] & 7, 0)
    assert np.any(codes[2] == 8)  # tiny negatives -> "-0"


def _edge_matrices() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    out = {}

    w = rng.standard_normal((8, 64)).astype(np.float32)
    w[3, 16:32] = 0.0
    w[5, 48:64] = -0.0
    out["zero_blocks"] = w

    out["all_zero"] = np.zeros((4, 32), np.float32)
    z = np.zeros((2, 32), np.float32)
    z[1, ::3] = -0.0
    out["all_zero_signed"] = z

    w = rng.standard_normal((4, 32)).astype(np.float32)
    w[1, :16] = -1e-30
    w[1, 16:20] = -0.0
    w[2, :] = rng.uniform(-1e-3, 1e-3, 32)  # tiny values in every block of the row
    w[2, 0] = 2.0  # so the row's blocks keep their own scale
    out["negzero_tiny"] = w

    # Tensor scale exactly 1 (amax 2688); block 0 has max 6 -> scale 1.0, x == w.
    ties = np.zeros((3, 32), np.float32)
    ties[0, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,
                    -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    ties[0, 16:32] = np.linspace(-6, 6, 16)
    ties[1, :16] = np.arange(16) * 0.375
    ties[1, 0] = 6.375  # scale 1.0625 -> E4M3 tie -> 1.0, x = 6.375 saturates to 6
    ties[2, 0] = 2688.0
    ties[2, 16:32] = 0.004  # scale 0.00025 is below 2^-9 -> clamped
    out["ties_and_saturation"] = ties

    w = rng.uniform(-1e-3, 1e-3, (4, 64)).astype(np.float32)
    w[2, 37] = 1.0e4  # dominates the tensor scale; other blocks get clamped scales
    out["outlier_row"] = bf16_round(w)

    out["normal_bf16"] = bf16_round(rng.standard_normal((32, 128)).astype(np.float32) * 0.02)
    out["heavy_tail_bf16"] = bf16_round(rng.standard_t(2, (32, 128)).astype(np.float32))
    out["small_magnitude"] = bf16_round(rng.standard_normal((8, 64)).astype(np.float32) * 1e-30)
    out["large_magnitude"] = bf16_round(rng.standard_normal((8, 64)).astype(np.float32) * 1e30)
    return out


EDGE = _edge_matrices()


@pytest.mark.parametrize("name", sorted(EDGE))
def test_quantizer_equals_reference_on_edge_cases(name):
    assert_same_quantization(EDGE[name])


def test_quantizer_equals_reference_on_many_random_matrices():
    rng = np.random.default_rng(5)
    for i in range(40):
        shape = (int(rng.integers(1, 9)), 16 * int(rng.integers(1, 9)))
        w = rng.standard_t(int(rng.integers(1, 5)), shape) * 10.0 ** rng.uniform(-8, 8)
        assert_same_quantization(bf16_round(w.astype(np.float32)))


def test_all_zero_block_gets_scale_0x38():
    q = quantize_nvfp4(EDGE["zero_blocks"])
    assert q.scales[3, 1] == 0x38 and q.scales[5, 3] == 0x38
    codes = unpack_nibbles(q.packed)
    np.testing.assert_array_equal(codes[3, 16:32], 0)
    np.testing.assert_array_equal(codes[5, 48:64], 8)  # -0 stays -0


def test_all_zero_matrix():
    q = quantize_nvfp4(EDGE["all_zero_signed"])
    assert q.tensor_scale == 0
    np.testing.assert_array_equal(q.scales, 0x38)
    codes = unpack_nibbles(q.packed)
    np.testing.assert_array_equal(codes, np.where(np.signbit(EDGE["all_zero_signed"]), 8, 0))
    np.testing.assert_array_equal(dequantize_nvfp4(q.packed, q.scales, q.tensor_scale), 0)


def test_negative_zero_and_tiny_negatives_give_code_8():
    w = EDGE["negzero_tiny"]
    codes = unpack_nibbles(quantize_nvfp4(w).packed)
    np.testing.assert_array_equal(codes[1, :20], 8)
    rounds_to_zero = (codes[2] & 7) == 0
    assert rounds_to_zero.sum() > 10
    np.testing.assert_array_equal(codes[2][rounds_to_zero] == 8, np.signbit(w[2][rounds_to_zero]))


def test_e2m1_ties_round_half_to_even_and_saturation():
    q = quantize_nvfp4(EDGE["ties_and_saturation"])
    assert q.tensor_scale == 1.0
    assert q.scales[0, 0] == 0x38
    codes = unpack_nibbles(q.packed)
    # formats.md 3.4: 0.75, 1.75, 3.5 go up; 0.25, 1.25, 2.5, 5 go down (even code)
    expected = [0, 2, 2, 4, 4, 6, 6, 7]  # 0, 1, 1, 2, 2, 4, 4, 6
    np.testing.assert_array_equal(codes[0, :8], expected)
    np.testing.assert_array_equal(codes[0, 8:16], np.array(expected) | 8)
    # block amax 6.375 -> s = 1.0625, an E4M3 tie that rounds to 1.0; x = 6.375 -> 6
    assert q.scales[1, 0] == 0x38 and codes[1, 0] == 7
    # tiny block relative to the tensor: scale clamped to 2^-9 (byte 0x01), x = 2.048 -> 2
    assert q.scales[2, 1] == 0x01
    np.testing.assert_array_equal(codes[2, 16:32], 4)


def test_quantizer_rejects_bad_input():
    with pytest.raises(FormatError, match="w_k24.*multiple of 16"):
        quantize_nvfp4(np.ones((2, 24), np.float32), name="w_k24")
    bad = np.ones((2, 32), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(FormatError, match="w_nan.*NaN"):
        quantize_nvfp4(bad, name="w_nan")
    bad[1, 3] = np.inf
    with pytest.raises(FormatError, match="w_inf"):
        quantize_nvfp4(bad, name="w_inf")
    with pytest.raises(FormatError, match="2-D"):
        quantize_nvfp4(np.ones(32, np.float32))


def _half_step(x_abs: np.ndarray) -> np.ndarray:
    """Half the E2M1 spacing around |x| (in units of the block's scale)."""
    return np.where(x_abs <= 2, 0.25, np.where(x_abs <= 4, 0.5, 1.0))


@pytest.mark.parametrize("name", ["zero_blocks", "negzero_tiny", "outlier_row", "normal_bf16",
                                  "heavy_tail_bf16", "small_magnitude", "large_magnitude",
                                  "ties_and_saturation"])
def test_dequantize_quantize_error_bound(name):
    w = EDGE[name]
    q = quantize_nvfp4(w)
    d = dequantize_nvfp4(q.packed, q.scales, q.tensor_scale)
    assert d.dtype == np.float32 and d.shape == w.shape
    n, k = w.shape
    unit = (e4m3_decode(q.scales).astype(np.float64) * np.float64(q.tensor_scale))  # [n, k/16]
    unit = np.repeat(unit, BLOCK, axis=1)
    x_abs = np.abs(w) / np.where(unit == 0, 1, unit)
    bound = _half_step(np.minimum(x_abs, 6.0)) * unit
    err = np.abs(d.astype(np.float64) - w)
    assert np.all(err <= bound * (1 + 1e-6) + 1e-45), name
    assert np.all(d[w == 0] == 0)


def test_dequantize_nvfp4_shape_checks_and_per_row_scale():
    q = quantize_nvfp4(EDGE["normal_bf16"])
    with pytest.raises(FormatError, match="layer.x"):
        dequantize_nvfp4(q.packed, q.scales[:, :-1], q.tensor_scale, name="layer.x")
    with pytest.raises(FormatError, match="multiple of 16"):
        check_nvfp4_shapes((4, 12), (4, 1), "t")
    with pytest.raises(FormatError):
        check_nvfp4_shapes((4, 8), (4, 1, 1), "t")
    check_nvfp4_shapes((3, 4, 8), (3, 4, 1), "t")  # stacked experts are fine
    rows = np.linspace(0.5, 2, q.packed.shape[0]).astype(np.float32)
    per_row = dequantize_nvfp4(q.packed, q.scales, rows)
    unit = dequantize_nvfp4(q.packed, q.scales, np.float32(1))
    np.testing.assert_array_equal(per_row, unit * rows[:, None])


# ---------------------------------------------------------------------------------
# 3. Nibble order
# ---------------------------------------------------------------------------------


def test_nibble_order_low_nibble_is_even_column():
    assert pack_nibbles(np.array([[0x1, 0x2]], np.uint8))[0, 0] == 0x21
    np.testing.assert_array_equal(unpack_nibbles(np.array([[0x9F]], np.uint8)), [[0xF, 0x9]])
    # byte 0x21 then zeros: the first (even) element decodes to 0.5, the second to 1.0
    packed = np.zeros((1, 8), np.uint8)
    packed[0, 0] = 0x21
    packed[0, 1] = 0x9F
    d = dequantize_nvfp4(packed, np.array([[0x38]], np.uint8), np.float32(1))
    np.testing.assert_array_equal(d[0, :4], [0.5, 1.0, -6.0, -0.5])
    rng = np.random.default_rng(6)
    codes = rng.integers(0, 16, (5, 3, 64), dtype=np.uint8)
    np.testing.assert_array_equal(unpack_nibbles(pack_nibbles(codes)), codes)
    every_byte = np.arange(256, dtype=np.uint8).reshape(4, 64)
    np.testing.assert_array_equal(pack_nibbles(unpack_nibbles(every_byte)), every_byte)


# ---------------------------------------------------------------------------------
# 4. compressed-tensors
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ct():
    import torch
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import (
        pack_fp4_to_uint8,
        quantize_and_pack_fp4,
        unpack_fp4_from_uint8,
    )
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    return {
        "torch": torch,
        "NVFP4PackedCompressor": NVFP4PackedCompressor,
        "FloatQuantizationCompressor": FloatQuantizationCompressor,
        "pack_fp4_to_uint8": pack_fp4_to_uint8,
        "quantize_and_pack_fp4": quantize_and_pack_fp4,
        "unpack_fp4_from_uint8": unpack_fp4_from_uint8,
        "scheme": preset_name_to_scheme,
        "dequantize": dequantize,
        "calculate_qparams": calculate_qparams,
        "generate_gparam": generate_gparam,
    }


def _ct_weights(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    ws = [
        bf16_round(rng.standard_normal((32, 128)).astype(np.float32) * 0.02),
        bf16_round(rng.standard_t(2, (16, 256)).astype(np.float32)),
        bf16_round(rng.uniform(-1, 1, (8, 64)).astype(np.float32) * 1e-4),
    ]
    z = rng.standard_normal((8, 64)).astype(np.float32)
    z[2, 16:32] = 0.0
    z[5, :16] = -0.0
    ws.append(z)
    return ws


def _ct_state(ct, packed, scales, global_scale):
    torch = ct["torch"]
    return {
        "weight_packed": torch.from_numpy(np.ascontiguousarray(packed)),
        "weight_scale": torch.from_numpy(np.ascontiguousarray(scales)).view(torch.float8_e4m3fn),
        "weight_global_scale": torch.from_numpy(np.asarray(global_scale, np.float32).reshape(1)),
    }


def test_compressed_nvfp4_names_match_package(ct):
    scheme = ct["scheme"]("NVFP4A16", ["Linear"])
    assert ct["NVFP4PackedCompressor"].compression_param_names(scheme) == (
        "weight_packed", "weight_scale", "weight_global_scale",
    )


@pytest.mark.parametrize("i", range(4))
def test_compressed_nvfp4_dequant_matches_package(ct, i):
    torch = ct["torch"]
    w = _ct_weights(7)[i]
    packed, scales, gscale = quantize_compressed_nvfp4(w)
    assert packed.dtype == np.uint8 and scales.dtype == np.uint8
    assert gscale.dtype == np.float32 and gscale.shape == (1,)
    nv = from_compressed_nvfp4(packed, scales, gscale, name="m")
    assert nv.tensor_scale == np.float32(1) / gscale[0]  # dequant divides by global scale
    ours = dequantize_nvfp4(nv.packed, nv.scales, nv.tensor_scale)

    # The package's own path (NVFP4PackedCompressor.decompress), kept in float32.
    state = _ct_state(ct, packed, scales, gscale)
    scheme = ct["scheme"]("NVFP4A16", ["Linear"])
    m, half = state["weight_packed"].shape
    x_q = ct["unpack_fp4_from_uint8"](state["weight_packed"], m, half * 2, dtype=torch.float32)
    theirs = ct["dequantize"](
        x_q=x_q,
        scale=state["weight_scale"].to(torch.float32),
        args=scheme.weights,
        global_scale=state["weight_global_scale"],
        dtype=torch.float32,
    ).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(ours == 0, theirs == 0)

    # decompress() itself returns BF16; ours rounded to BF16 agrees to 1 BF16 ulp.
    out = ct["NVFP4PackedCompressor"].decompress(state, scheme)["weight"]
    assert out.dtype == torch.bfloat16
    np.testing.assert_allclose(out.float().numpy(), bf16_round(ours), rtol=2.0**-8, atol=0)


def test_package_unpack_and_pack_use_our_nibble_order(ct):
    torch = ct["torch"]
    every_byte = np.arange(256, dtype=np.uint8).reshape(2, 128)
    ours_values = e2m1_decode(unpack_nibbles(every_byte))  # includes -0 (code 8)
    theirs_values = ct["unpack_fp4_from_uint8"](
        torch.from_numpy(every_byte), 2, 256, dtype=torch.float32
    ).numpy()
    np.testing.assert_array_equal(f32_bits(ours_values), f32_bits(theirs_values))
    repacked = ct["pack_fp4_to_uint8"](torch.from_numpy(ours_values)).numpy()
    np.testing.assert_array_equal(repacked, every_byte)
    packed, _, _ = quantize_compressed_nvfp4(_ct_weights(8)[0])
    values = torch.from_numpy(e2m1_decode(unpack_nibbles(packed)))
    np.testing.assert_array_equal(ct["pack_fp4_to_uint8"](values).numpy(), packed)


def test_compressed_codes_match_package_given_the_same_scales(ct):
    """Given our block scales and global scale, compressed-tensors' own quantizer
    (quantize_and_pack_fp4: x / (scale / global), clamp, E2M1 round, pack) produces our
    packed bytes exactly, so the E2M1 rounding and the packing agree."""
    torch = ct["torch"]
    rng = np.random.default_rng(9)
    ws = _ct_weights(9)[:3] + [
        bf16_round(rng.standard_t(2, (16, 64)).astype(np.float32) * 10.0 ** rng.uniform(-6, 2))
        for _ in range(20)
    ]
    for w in ws:
        packed, scales, gscale = quantize_compressed_nvfp4(w)
        assert np.all(scales != 0)  # (a zero scale would divide by zero in the package)
        their_packed = ct["quantize_and_pack_fp4"](
            torch.from_numpy(w), torch.from_numpy(e4m3_decode(scales)),
            global_scale=torch.from_numpy(gscale), group_size=16,
        ).numpy()
        np.testing.assert_array_equal(their_packed, packed)


def _llm_compressor_reference(ct, w):
    """compressed-tensors' min-max qparams path (what llm-compressor calls)."""
    torch = ct["torch"]
    scheme = ct["scheme"]("NVFP4A16", ["Linear"])
    wt = torch.from_numpy(w)
    n, k = w.shape
    g = ct["generate_gparam"](wt.min(), wt.max())
    blocks = wt.reshape(n, k // 16, 16)
    scale, _ = ct["calculate_qparams"](blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=g)
    packed = ct["quantize_and_pack_fp4"](wt, scale, global_scale=g, group_size=16).numpy()
    return packed, scale.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), g.numpy()


def test_compressed_quantizer_matches_package_bytes(ct):
    """`quantize_compressed_nvfp4` reproduces compressed-tensors' own min-max path
    (what llm-compressor calls) byte for byte: global scale, block scales and codes,
    including zero blocks (scale byte 0x20 there), -0 inputs and tiny negatives."""
    rng = np.random.default_rng(10)
    cases = [bf16_round(rng.standard_t(2, (16, 64)).astype(np.float32) * 10.0 ** rng.uniform(-6, 2))
             for _ in range(60)]
    w = _ct_weights(11)[3]  # zero block at [2, 16:32] and a -0 block at [5, :16]
    w[6, 32:48] = -1e-30  # nonzero, but its E4M3 scale underflows to 0
    cases.append(w)
    for w in cases:
        packed, scales, g = quantize_compressed_nvfp4(w)
        their_packed, their_scales, their_g = _llm_compressor_reference(ct, w)
        assert f32_bits(g[0]) == f32_bits(their_g[0])
        np.testing.assert_array_equal(scales, their_scales)
        np.testing.assert_array_equal(packed, their_packed)


def test_tensor_scale_from_global_rejects_bad_values():
    assert tensor_scale_from_global(np.array([4.0], np.float32)) == np.float32(0.25)
    assert tensor_scale_from_global(np.float32(2.0)) == np.float32(0.5)
    for bad in (np.array([0.0]), np.array([-1.0]), np.array([np.inf]), np.array([1.0, 2.0])):
        with pytest.raises(FormatError, match="layer.g"):
            tensor_scale_from_global(bad, name="layer.g")


@pytest.mark.parametrize("preset,per_channel", [("FP8", False), ("FP8_DYNAMIC", True)])
def test_fp8_float_quantized_matches_package(ct, preset, per_channel):
    torch = ct["torch"]
    scheme = ct["scheme"](preset, ["Linear"])
    comp = ct["FloatQuantizationCompressor"]
    assert comp.compression_param_names(scheme) == ("weight", "weight_scale")
    rng = np.random.default_rng(12)
    w = bf16_round(rng.standard_normal((16, 64)).astype(np.float32) * np.linspace(0.01, 3, 16)[:, None])
    codes, scale = quantize_fp8(w, per_channel=per_channel)
    s = np.asarray(scale, np.float32).reshape((16, 1) if per_channel else (1,))
    state = {
        "weight": torch.from_numpy(codes).view(torch.float8_e4m3fn),
        "weight_scale": torch.from_numpy(s.copy()),
    }
    theirs = comp.decompress(state, scheme)["weight"].numpy()
    np.testing.assert_array_equal(dequantize_fp8(codes, s), theirs)
    np.testing.assert_array_equal(dequantize_fp8(codes, scale), theirs)
    # and our quantization equals the package's (scale from its min-max qparams)
    wt = torch.from_numpy(w)
    if per_channel:
        their_scale, _ = ct["calculate_qparams"](wt.amin(1, keepdim=True), wt.amax(1, keepdim=True), scheme.weights)
    else:
        their_scale, _ = ct["calculate_qparams"](wt.min().reshape(1), wt.max().reshape(1), scheme.weights)
    np.testing.assert_array_equal(their_scale.numpy().reshape(-1), np.asarray(scale).reshape(-1))
    compressed = comp.compress({"weight": wt, "weight_scale": their_scale}, scheme)["weight"]
    np.testing.assert_array_equal(compressed.view(torch.uint8).numpy(), codes)


# ---------------------------------------------------------------------------------
# 5. MLX mapping
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
    """formats.md 4: mx.quantize(mode="nvfp4") is not ModelOpt's quantizer. It has no
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


# ---------------------------------------------------------------------------------
# 6. stfile
# ---------------------------------------------------------------------------------


def _all_dtype_tensors(rng) -> dict[str, tuple[str, np.ndarray]]:
    tensors = {}
    for dtype, storage in STORAGE_DTYPES.items():
        nbytes = np.dtype(storage).itemsize * 12
        raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
        if dtype == "BOOL":
            arr = (raw % 2).astype(np.bool_).reshape(3, 4)
        elif dtype in ("F16", "F32", "F64"):
            arr = rng.standard_normal(12).astype(storage).reshape(3, 4)
        elif dtype == "BF16":
            arr = f32_to_bf16_bits(rng.standard_normal(12).astype(np.float32)).reshape(3, 4)
        elif dtype == "F8_E4M3":
            arr = raw.reshape(3, 4).copy()
            arr[(arr & 0x7F) == 0x7F] = 0x3C  # keep it NaN-free for value comparisons
        else:
            arr = raw.view(storage).reshape(3, 4)
        tensors[f"t.{dtype.lower()}"] = (dtype, arr)
    tensors["scalar.f32"] = ("F32", np.array(0.125, np.float32))
    tensors["empty.u8"] = ("U8", np.zeros((0, 4), np.uint8))
    return tensors


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fb" and a.dtype.itemsize > 1 else a


def test_stfile_round_trip_every_dtype(tmp_path):
    import torch

    tensors = _all_dtype_tensors(np.random.default_rng(17))
    path = tmp_path / "all.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt", "b": 2})

    f = SafetensorsFile(path)
    assert sorted(f.names()) == sorted(tensors)
    assert f.metadata == {"b": "2", "format": "pt"}
    for name, (dtype, arr) in tensors.items():
        assert f.dtype(name) == dtype and f.shape(name) == arr.shape
        assert f.nbytes(name) == arr.nbytes
        got = f.read(name)
        assert got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(_bits(got), _bits(arr))

    # safetensors (torch) reads the same bits with the right dtypes
    torch_dtypes = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F16": torch.float16,
                    "F32": torch.float32, "F64": torch.float64, "BOOL": torch.bool}
    with safe_open(str(path), "pt") as sf:
        assert sorted(sf.keys()) == sorted(tensors)
        assert sf.metadata() == {"b": "2", "format": "pt"}
        for name, (dtype, arr) in tensors.items():
            t = sf.get_tensor(name)
            if dtype in torch_dtypes:
                assert t.dtype == torch_dtypes[dtype]
            if dtype == "BF16":
                t = t.view(torch.uint16)
            elif dtype == "F8_E4M3":
                t = t.view(torch.uint8)
                np.testing.assert_array_equal(
                    sf.get_tensor(name).float().numpy(), e4m3_decode(arr)
                )
            np.testing.assert_array_equal(_bits(t.numpy()), _bits(arr))

    # mx.load: F64 is not supported by MLX's safetensors reader, so check it apart
    no_f64 = {k: v for k, v in tensors.items() if v[0] != "F64"}
    path2 = tmp_path / "no_f64.safetensors"
    write_safetensors(path2, no_f64)
    with pytest.raises(Exception, match="F64"):
        mx.load(str(path))
    loaded = mx.load(str(path2))
    assert sorted(loaded) == sorted(no_f64)
    for name, (dtype, arr) in no_f64.items():
        a = loaded[name]
        if dtype == "BF16":
            assert a.dtype == mx.bfloat16
            np.testing.assert_array_equal(np.array(a.view(mx.uint16)), arr)
            np.testing.assert_array_equal(np.array(a.astype(mx.float32)), bf16_bits_to_f32(arr))
        elif dtype == "F8_E4M3":
            assert a.dtype == mx.uint8  # raw bytes, formats.md 2d
            np.testing.assert_array_equal(np.array(a), arr)
            np.testing.assert_array_equal(
                np.array(mx.from_fp8(a, dtype=mx.float32)), e4m3_decode(arr)
            )
        else:
            np.testing.assert_array_equal(_bits(np.array(a)), _bits(arr))


def test_stfile_writes_are_deterministic(tmp_path):
    tensors = _all_dtype_tensors(np.random.default_rng(18))
    reordered = dict(reversed(list(tensors.items())))
    write_safetensors(tmp_path / "a.safetensors", tensors, metadata={"x": 1, "a": "y"})
    write_safetensors(tmp_path / "b.safetensors", reordered, metadata={"a": "y", "x": 1})
    a = (tmp_path / "a.safetensors").read_bytes()
    assert a == (tmp_path / "b.safetensors").read_bytes()
    n = int.from_bytes(a[:8], "little")
    assert n % 8 == 0
    header = json.loads(a[8 : 8 + n])
    names = [k for k in header if k != "__metadata__"]
    assert names == sorted(names)


def test_stfile_rejects_unstorable_arrays(tmp_path):
    with pytest.raises(FormatError, match="bad"):
        write_safetensors(tmp_path / "x.safetensors", {"bad": ("BF16", np.zeros(2, np.float32))})
    with pytest.raises(FormatError, match="bad"):
        write_safetensors(tmp_path / "x.safetensors", {"bad": ("F4", np.zeros(2, np.uint8))})


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_stfile_errors_name_file_and_tensor(tmp_path):
    good = tmp_path / "good.safetensors"
    write_safetensors(good, {"a.weight": ("F32", np.arange(8, dtype=np.float32)),
                             "b.weight": ("U8", np.arange(16, dtype=np.uint8))})
    raw = good.read_bytes()

    # truncated in the data: names the file and the tensor that runs past the end
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[:-4])
    with pytest.raises(FormatError) as e:
        SafetensorsFile(cut)
    assert str(cut) in str(e.value) and "b.weight" in str(e.value)

    # truncated inside the 8-byte length
    stub = tmp_path / "stub.safetensors"
    stub.write_bytes(raw[:5])
    with pytest.raises(FormatError, match="truncated") as e:
        SafetensorsFile(stub)
    assert str(stub) in str(e.value)

    # header length past the end of the file
    long = tmp_path / "long.safetensors"
    long.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    with pytest.raises(FormatError) as e:
        SafetensorsFile(long)
    assert str(long) in str(e.value)

    # corrupt header JSON (and non-UTF-8 bytes; and JSON that is not an object)
    n = int.from_bytes(raw[:8], "little")
    for i, body in enumerate([b"{" + b"x" * (n - 1), b"\xff" * n, b"[1]" + b" " * (n - 3)]):
        bad = tmp_path / f"json{i}.safetensors"
        bad.write_bytes(raw[:8] + body + raw[8 + n :])
        with pytest.raises(FormatError, match="header") as e:
            SafetensorsFile(bad)
        assert str(bad) in str(e.value)

    # data_offsets inconsistent with dtype and shape
    off = _raw_file(tmp_path / "off.safetensors",
                    {"x.ok": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                     "x.bad": {"dtype": "F32", "shape": [2, 3], "data_offsets": [4, 24]}},
                    bytes(32))
    with pytest.raises(FormatError) as e:
        SafetensorsFile(off)
    assert str(off) in str(e.value) and "x.bad" in str(e.value)

    # offsets past the end of the data, an unknown dtype, a malformed entry
    for i, entry in enumerate([
        {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]},
        {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
        {"dtype": "F32", "shape": [4]},
    ]):
        p = _raw_file(tmp_path / f"entry{i}.safetensors", {"y.w": entry}, bytes(16))
        with pytest.raises(FormatError) as e:
            SafetensorsFile(p)
        assert str(p) in str(e.value) and "y.w" in str(e.value)

    # reading a name that is not there
    with pytest.raises(FormatError, match="nope"):
        SafetensorsFile(good).read("nope")


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [-1], "data_offsets": [4, 0]},  # accepted, reads as empty
    {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]},  # accepted, read -> TypeError
    {"dtype": "F32", "shape": [2], "data_offsets": ["0", 8]},  # TypeError, not FormatError
])
def test_stfile_rejects_malformed_shape_or_offsets(tmp_path, entry):
    p = _raw_file(tmp_path / "m.safetensors", {"z.w": entry}, bytes(8))
    try:
        SafetensorsFile(p).read("z.w")
    except FormatError as e:
        assert str(p) in str(e) and "z.w" in str(e)
        return
    raise AssertionError("malformed header entry was accepted")


# ---------------------------------------------------------------------------------
# 7. fp8
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_round_trip_within_e4m3_precision(per_channel):
    rng = np.random.default_rng(19)
    w = rng.standard_t(3, (32, 96)).astype(np.float32) * np.logspace(-3, 1, 32)[:, None].astype(np.float32)
    w[4] = 0.0
    w[5, :10] = -0.0
    codes, scale = quantize_fp8(w, per_channel=per_channel)
    scale = np.asarray(scale, np.float32)
    assert scale.shape == ((32, 1) if per_channel else ())
    assert codes.dtype == np.uint8 and not np.any((codes & 0x7F) == 0x7F)
    if per_channel:
        assert scale[4, 0] == 1.0  # an all-zero row gets scale 1
        np.testing.assert_array_equal(scale[:, 0][np.arange(32) != 4],
                                      (np.abs(w).max(1) / np.float32(448))[np.arange(32) != 4])
    else:
        assert scale == np.abs(w).max() / np.float32(448)
    d = dequantize_fp8(codes, scale)
    s = np.broadcast_to(scale, w.shape).astype(np.float64)
    # relative half-ulp (3 mantissa bits) for normals, half the smallest subnormal below
    bound = np.maximum(np.abs(w) * 2.0**-4, 2.0**-10 * s) * (1 + 1e-6)
    assert np.all(np.abs(d.astype(np.float64) - w) <= bound)
    assert np.abs(d).max() <= np.abs(w).max() * (1 + 1e-6)
    np.testing.assert_array_equal(np.signbit(d[5, :10]), True)


def test_dequantize_fp8_scale_shapes():
    codes = np.full((4, 8), 0x38, np.uint8)
    for s in (np.float32(2), np.array([2.0], np.float32), np.full((4,), 2.0, np.float32),
              np.full((4, 1), 2.0, np.float32)):
        np.testing.assert_array_equal(dequantize_fp8(codes, s), 2.0)
    for bad in (np.ones(3, np.float32), np.ones((4, 8), np.float32), np.ones((2, 1), np.float32)):
        with pytest.raises(FormatError, match="proj.w"):
            dequantize_fp8(codes, bad, name="proj.w")
    with pytest.raises(FormatError, match="2-D"):
        quantize_fp8(np.ones(8, np.float32))


def test_quantizer_row_chunking_does_not_change_bytes(monkeypatch):
    """Large matrices are quantized in row chunks (bounded memory); the tensor scale is
    still global, so the bytes equal a single-chunk run."""
    import monolith.formats.nvfp4 as nvfp4

    w = bf16_round(np.random.default_rng(3).standard_t(3, (37, 96)).astype(np.float32))
    whole = quantize_nvfp4(w)
    monkeypatch.setattr(nvfp4, "ROW_CHUNK_ELEMENTS", 96 * 5)  # 5 rows per chunk, ragged end
    chunked = quantize_nvfp4(w)
    np.testing.assert_array_equal(whole.packed, chunked.packed)
    np.testing.assert_array_equal(whole.scales, chunked.scales)
    assert whole.tensor_scale == chunked.tensor_scale
