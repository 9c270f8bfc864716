"""monolith.formats codecs (E2M1, E4M3, BF16, nibble order, FP8) against `ml_dtypes`.

References (none of them is our own code): `ml_dtypes` float4_e2m1fn / float8_e4m3fn /
bfloat16 casts for every code and rounding decision.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from formats_reference import F4, F8, f32_bits, ref_e2m1_codes

from monolith.formats import (
    FormatError,
    bf16_bits_to_f32,
    dequantize_fp8,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    f32_to_bf16_bits,
    pack_nibbles,
    quantize_fp8,
    unpack_nibbles,
)

# ---------------------------------------------------------------------------------
# Codecs against ml_dtypes
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
    # docs/formats.md section 1 anchors
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
# Nibble order
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
# fp8
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
