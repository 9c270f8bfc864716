"""monolith.checkpoint: compressed-tensors, BF16 and sharded checkpoints, architectures,
the quantization rules a loader cannot read, and identity. Every checkpoint is built in
tmp_path with monolith.formats.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from checkpoint_builders import (
    CT_NVFP4_WEIGHTS,
    H,
    I,
    L0,
    L1,
    MODELOPT_EXCLUDES,
    NVFP4_REL,
    Q,
    V,
    assert_dequantized,
    ct_config,
    modelopt_nvfp4_fmt,
    moe_shapes,
    precisions,
    weight,
    write_checkpoint,
)

from monolith.checkpoint import SUPPORTED_ARCHITECTURES, CheckpointError, open_checkpoint
from monolith.formats import (
    bf16_bits_to_f32,
    dequantize_fp8,
    f32_to_bf16_bits,
    quantize_fp8,
    write_safetensors,
)

CT_IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*linear_attn\\.in_proj_[ab]$",
             "re:.*visual.*", "re:mtp.*"]


def ct_nvfp4_fmt(name, shape):
    ignored = name == "lm_head" or name.endswith((".mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b"))
    if len(shape) != 2 or ignored or "embed_tokens" in name:
        return "bf16"
    return "ct-nvfp4"


def test_compressed_tensors_nvfp4_with_re_ignore(tmp_path):
    groups = {"group_0": {"targets": ["Linear"], "weights": CT_NVFP4_WEIGHTS,
                          "input_activations": {**CT_NVFP4_WEIGHTS, "dynamic": "local"},
                          "format": "nvfp4-pack-quantized"}}
    config = ct_config("nvfp4-pack-quantized", groups, CT_IGNORE)
    expected, original = write_checkpoint(tmp_path, ct_nvfp4_fmt, config=config)
    ck = open_checkpoint(tmp_path)
    assert ck.quant_format == "compressed-tensors" and ck.quant_config == config["quantization_config"]
    want = {n: "nvfp4" if ct_nvfp4_fmt(n, s) == "ct-nvfp4" else "bf16" for n, s in moe_shapes().items()}
    assert precisions(ck) == want
    m = f"{L0}.mlp.experts.0.gate_proj"
    assert ck.module(m).tensors == {"weight_packed": f"{m}.weight_packed", "weight_scale": f"{m}.weight_scale",
                                    "weight_global_scale": f"{m}.weight_global_scale"}
    assert ck.module(m).shape == (I, H)
    w = ck.read_nvfp4(m)
    assert w.tensor_scale == np.float32(1.0) / ck.read_float(f"{m}.weight_global_scale")[0]
    assert_dequantized(ck, expected, original, NVFP4_REL)


def test_compressed_tensors_mixed_nvfp4_fp8_bf16(tmp_path):
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    groups = {
        "group_0": {"targets": ["re:.*mlp\\.(experts|shared_expert)\\..*_proj$"], "weights": CT_NVFP4_WEIGHTS,
                    "format": "nvfp4-pack-quantized"},
        "group_1": {"targets": ["re:.*self_attn\\.[qkvo]_proj$"], "weights": {**fp8, "strategy": "tensor"},
                    "format": "float-quantized"},
        # no group format: inferred from the weights under a "mixed-precision" top level
        "group_2": {"targets": [f"{L0}.linear_attn.in_proj_qkv", f"{L0}.linear_attn.in_proj_z",
                                f"{L0}.linear_attn.out_proj"], "weights": {**fp8, "strategy": "channel"}},
    }
    config = ct_config("mixed-precision", groups, ["lm_head"])

    def fmt(name, shape):
        if ".experts." in name or ".shared_expert." in name:
            return "ct-nvfp4"
        if ".self_attn." in name and name.endswith("_proj"):
            return "fp8"
        if name.endswith(("in_proj_qkv", "in_proj_z", "out_proj")):
            return "fp8-channel"
        return "bf16"

    expected, original = write_checkpoint(tmp_path, fmt, config=config)
    ck = open_checkpoint(tmp_path)
    want = {n: {"ct-nvfp4": "nvfp4", "fp8": "fp8", "fp8-channel": "fp8"}.get(fmt(n, s), "bf16")
            for n, s in moe_shapes().items()}
    assert precisions(ck) == want
    assert ck.read_fp8(f"{L1}.self_attn.k_proj")[1].shape == ()
    codes, scale = ck.read_fp8(f"{L0}.linear_attn.out_proj")
    assert codes.shape == (H, 32) and scale.shape == (H, 1) and scale.dtype == np.float32
    assert_dequantized(ck, expected, original, NVFP4_REL)
    # an untargeted matrix is plain, a targeted one must be quantized
    assert ck.module(f"{L0}.linear_attn.in_proj_a").precision == "bf16"


def test_fp8_scales_in_bf16_and_per_row_vector(tmp_path):
    """compressed-tensors FP8 exports may store scales in BF16; [N] and [N, 1] both
    mean one scale per output row."""
    fp8 = {"num_bits": 8, "type": "float", "strategy": "channel"}
    groups = {"g": {"targets": ["Linear"], "weights": fp8, "format": "float-quantized"}}
    w = weight(Q, (64, H))
    codes, scale = quantize_fp8(w, per_channel=True)
    scale_bits = f32_to_bf16_bits(scale)
    tensors = {f"{Q}.weight": ("F8_E4M3", codes), f"{Q}.weight_scale": ("BF16", scale_bits),
               "lm_head.weight": ("F8_E4M3", codes), "lm_head.weight_scale": ("F32", scale.reshape(-1))}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps(ct_config("float-quantized", groups, [])))
    ck = open_checkpoint(tmp_path)
    got_codes, got_scale = ck.read_fp8(Q)
    np.testing.assert_array_equal(got_scale, bf16_bits_to_f32(scale_bits))
    assert got_scale.shape == (64, 1) and ck.read_fp8("lm_head")[1].shape == (64, 1)
    np.testing.assert_array_equal(ck.dequantize(Q), dequantize_fp8(codes, bf16_bits_to_f32(scale_bits)))
    np.testing.assert_array_equal(ck.dequantize("lm_head"), dequantize_fp8(codes, scale))


def test_ct_name_matching_agrees_with_compressed_tensors():
    from compressed_tensors.utils.match import match_name

    from monolith.checkpoint.precision import _ct_name_match

    names = ["lm_head", f"{L0}.mlp.gate", f"{L0}.mlp.gate_proj", f"{L0}.mlp.experts.3.up_proj",
             "mtp.fc", "model.visual.blocks.0.attn.qkv", f"{L1}.self_attn.q_proj"]
    entries = ["lm_head", "re:.*mlp\\.gate$", "re:.*mlp.gate", "re:mlp", "re:.*experts", "re:mtp.*",
               "re:.*visual.*", "re:model\\.language_model\\.layers\\.1\\..*", f"{L1}.self_attn.q_proj", "Linear"]
    for name in names:
        for entry in entries:
            assert _ct_name_match(name, entry) == match_name(name, entry), (name, entry)


def _ct_decompress(ck, m):
    """The compressed_tensors package's own NVFP4 decompression of module m (BF16
    output, as the package produces it) and a float32 run of the same dequantize."""
    import torch
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    t = ck.module(m).tensors
    packed = torch.from_numpy(np.array(ck.read(t["weight_packed"])))
    scale = torch.from_numpy(np.array(ck.read(t["weight_scale"]))).view(torch.float8_e4m3fn)
    global_scale = torch.from_numpy(np.array(ck.read_float(t["weight_global_scale"])))
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    state = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}
    bf16 = NVFP4PackedCompressor.decompress(state, scheme)["weight"].float().numpy()
    n, half = packed.shape
    f32 = dequantize(unpack_fp4_from_uint8(packed, n, half * 2, dtype=torch.float32), scale.to(torch.float32),
                     args=scheme.weights, global_scale=global_scale, dtype=torch.float32).numpy()
    return bf16, f32


def test_read_nvfp4_compressed_matches_compressed_tensors_package(tmp_path):
    groups = {"group_0": {"targets": ["Linear"], "weights": CT_NVFP4_WEIGHTS, "format": "nvfp4-pack-quantized"}}
    write_checkpoint(tmp_path, ct_nvfp4_fmt, config=ct_config("nvfp4-pack-quantized", groups, CT_IGNORE))
    ck = open_checkpoint(tmp_path)
    for m, spec in ck.modules().items():
        if spec.precision == "nvfp4":
            bf16, f32 = _ct_decompress(ck, m)
            ours = ck.dequantize(m)
            np.testing.assert_allclose(ours, f32, rtol=1e-6, atol=0, err_msg=m)
            np.testing.assert_allclose(ours, bf16, rtol=2**-8, atol=0, err_msg=m)


def test_compressed_nvfp4_nibble_order_and_global_division(tmp_path):
    """Byte 0x21 holds code 1 (0.5) in the low nibble and code 2 (1.0) in the high one;
    block scale 0x38 = 1.0; global scale 4 -> the package gives 0.125, 0.25, ... and so must we."""
    m = "lm_head"
    tensors = {f"{m}.weight_packed": ("U8", np.full((2, 8), 0x21, np.uint8)),
               f"{m}.weight_scale": ("F8_E4M3", np.full((2, 1), 0x38, np.uint8)),
               f"{m}.weight_global_scale": ("F32", np.array([4.0], np.float32))}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    groups = {"group_0": {"targets": ["lm_head"], "weights": CT_NVFP4_WEIGHTS}}
    (tmp_path / "config.json").write_text(json.dumps(ct_config("nvfp4-pack-quantized", groups, [])))
    ck = open_checkpoint(tmp_path)
    want = np.tile(np.array([0.125, 0.25], np.float32), (2, 8))
    np.testing.assert_array_equal(ck.dequantize(m), want)
    assert ck.read_nvfp4(m).tensor_scale == np.float32(0.25)
    bf16, f32 = _ct_decompress(ck, m)
    np.testing.assert_array_equal(bf16, want)
    np.testing.assert_array_equal(f32, want)


def test_bf16_sharded_with_index_and_single_file(tmp_path):
    config = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": H}
    shapes = {n: s for n, s in moe_shapes().items() if ".mlp." not in n}
    fmt = lambda n, s: "f32" if n.endswith("norm") else "bf16"  # noqa: E731
    for shards in (1, 2):
        path = tmp_path / f"s{shards}"
        expected, original = write_checkpoint(path, fmt, config=config, shapes=shapes, shards=shards)
        ck = open_checkpoint(path)
        assert (ck.architecture, ck.role) == ("qwen3_5", "target")
        assert (ck.quant_format, ck.quant_config) == ("unquantized", None)
        assert ck.text_config is ck.config  # no nesting: the config is the text config
        assert len(ck.files) == shards
        assert precisions(ck) == {n: "f32" if n.endswith("norm") else "bf16" for n in shapes}
        assert_dequantized(ck, expected, original, 0.0)
        assert ck.dtype(f"{L0}.linear_attn.dt_bias") == "BF16"
        np.testing.assert_array_equal(ck.read_float(f"{L0}.linear_attn.dt_bias"), np.ones(4, np.float32))
        np.testing.assert_array_equal(ck.read(f"{L0}.linear_attn.dt_bias"), f32_to_bf16_bits(np.ones(4, np.float32)))
        assert ck.shape(f"{L0}.linear_attn.A_log") == (4,)


def draft_shapes():
    return {"fc": (H, 2 * H), "hidden_norm": (H,), "norm": (H,), "layers.0.self_attn.q_proj": (64, H),
            "layers.0.self_attn.q_norm": (16,), "layers.0.mlp.down_proj": (H, I)}


@pytest.mark.parametrize("config, arch", [
    ({"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "markov_rank": 8}, "dspark"),
    ({"architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark",
      "transformer_layer_config": {"model_type": "qwen3"}}, "dspark-speculators"),
    ({"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "dflash_config": {"mask_token_id": 5}}, "dflash"),
    ({"model_type": "qwen3", "dflash_config": {"target_layer_ids": [1, 2]}}, "dflash"),
])
def test_draft_architectures(tmp_path, config, arch):
    write_checkpoint(tmp_path, lambda n, s: "bf16", config=config, shapes=draft_shapes())
    ck = open_checkpoint(tmp_path)
    assert (ck.architecture, ck.role) == (arch, "draft")
    assert set(ck.modules()) == set(draft_shapes())


def test_target_architecture_from_model_type(tmp_path):
    config = {"text_config": {"model_type": "qwen3_5_moe_text"}}
    write_checkpoint(tmp_path, lambda n, s: "bf16", config=config, shapes=draft_shapes())
    ck = open_checkpoint(tmp_path)
    assert (ck.architecture, ck.role, ck.text_config) == ("qwen3_5_moe", "target", config["text_config"])
    assert set(SUPPORTED_ARCHITECTURES) == {"qwen3_5_moe", "qwen3_5", "dspark", "dspark-speculators", "dflash"}


def test_lithos_quantization_block_reads_as_modelopt_nvfp4(tmp_path):
    config = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
              "lithos_quantization": {"format": "nvfp4", "keep": ["markov_w1"]}}
    fmt = lambda n, s: "nvfp4" if n in ("fc", "layers.0.self_attn.q_proj") else "bf16"  # noqa: E731
    expected, original = write_checkpoint(tmp_path, fmt, config=config, shapes=draft_shapes())
    ck = open_checkpoint(tmp_path)
    assert ck.quant_format == "modelopt-nvfp4" and ck.module("fc").precision == "nvfp4"
    assert_dequantized(ck, expected, original, NVFP4_REL)


def test_unreadable_rules_refuse_only_the_modules_they_cover(tmp_path):
    """A compressed-tensors group or a ModelOpt quantized_layers entry this loader cannot
    read does not refuse the checkpoint: only the modules it covers, when asked for."""
    shapes = {"lm_head": (V, H), "mtp.fc": (H, 2 * H), Q: (64, H)}
    groups = {"g0": {"targets": ["re:mtp.*"], "weights": {"num_bits": 4, "type": "int", "group_size": 128}},
              "g1": {"targets": [Q], "weights": CT_NVFP4_WEIGHTS, "format": "nvfp4-pack-quantized"}}
    config = ct_config("mixed-precision", groups, [])
    write_checkpoint(tmp_path / "ct", lambda n, s: "ct-nvfp4" if n == Q else "bf16", config=config, shapes=shapes)
    ck = open_checkpoint(tmp_path / "ct")
    assert ck.module(Q).precision == "nvfp4" and ck.module("lm_head").precision == "bf16"
    with pytest.raises(CheckpointError, match=r"config_groups\['g0'\].*4-bit int.*module mtp.fc"):
        ck.module("mtp.fc")
    layers = {"mtp": {"quant_algo": "NVFP4_AWQ", "group_size": 128}, Q: {"quant_algo": "NVFP4", "group_size": 16},
              "lm_head": {"quant_algo": "NVFP4", "group_size": 32}}
    hf_quant = {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}
    write_checkpoint(tmp_path / "mo", lambda n, s: "nvfp4" if n == Q else "bf16", hf_quant=hf_quant, shapes=shapes)
    ck = open_checkpoint(tmp_path / "mo")
    assert ck.module(Q).precision == "nvfp4"
    with pytest.raises(CheckpointError, match=r"quantized_layers\['mtp'\].quant_algo 'NVFP4_AWQ'.*module mtp.fc"):
        ck.module("mtp.fc")
    with pytest.raises(CheckpointError, match=r"quantized_layers\['lm_head'\].group_size is 32"):
        ck.module("lm_head")


# ---- identity --------------------------------------------------------------------


def test_source_files_and_config_hash(tmp_path):
    hf_quant = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": MODELOPT_EXCLUDES}}
    write_checkpoint(tmp_path, modelopt_nvfp4_fmt, hf_quant=hf_quant, shards=2)
    ck = open_checkpoint(tmp_path)
    files = ck.source_files()
    names = [f["name"] for f in files]
    assert names[:3] == ["config.json", "hf_quant_config.json", "model.safetensors.index.json"]
    assert names[3:] == [p.name for p in ck.files]
    for f in files:
        data = (tmp_path / f["name"]).read_bytes()
        assert f["bytes"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest()
    assert ck.config_sha256() == hashlib.sha256((tmp_path / "config.json").read_bytes()).hexdigest()
    assert ck.source_files() == files  # cached, same answer
