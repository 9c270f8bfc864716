"""monolith.formats ModelOpt NVFP4 quantizer against independent references.

References (none of them is our own code): NVIDIA's golden bytes (nvidia-modelopt 0.47.0
`NVFP4QTensor.quantize`) in tests/data/nvfp4_modelopt_golden.safetensors, and a reference
quantizer written from docs/formats.md section 3 with ml_dtypes rounding
(tests/formats_reference.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from formats_reference import (
    GOLDEN,
    GOLDEN_CASES,
    assert_same_quantization,
    bf16_round,
    f32_bits,
    ref_quantize_modelopt,
)
from safetensors import safe_open

from monolith.formats import (
    BLOCK,
    FormatError,
    bf16_bits_to_f32,
    check_nvfp4_shapes,
    dequantize_nvfp4,
    e4m3_decode,
    quantize_nvfp4,
    unpack_nibbles,
)

# ---------------------------------------------------------------------------------
# ModelOpt NVFP4 quantizer
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

    # The reference written from docs/formats.md section 3 matches NVIDIA's bytes too.
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
    # docs/formats.md 3, step 4: 0.75, 1.75, 3.5 go up; 0.25, 1.25, 2.5, 5 go down (even code)
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
