"""monolith.formats compressed-tensors NVFP4 and FP8 against the `compressed_tensors`
package's own unpack / pack / dequantize / quantize.
"""

from __future__ import annotations

import numpy as np
import pytest
from formats_reference import bf16_round, f32_bits

from monolith.formats import (
    FormatError,
    dequantize_fp8,
    dequantize_nvfp4,
    e2m1_decode,
    e4m3_decode,
    from_compressed_nvfp4,
    quantize_compressed_nvfp4,
    quantize_fp8,
    tensor_scale_from_global,
    unpack_nibbles,
)

# ---------------------------------------------------------------------------------
# compressed-tensors
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
