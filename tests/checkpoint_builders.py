"""Shared by tests/test_checkpoint_*.py: tiny checkpoints in every format, written in
tmp_path with monolith.formats, and the checks the tests make on them.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from monolith.checkpoint import Checkpoint, CheckpointError, open_checkpoint
from monolith.formats import (
    FormatError,
    bf16_bits_to_f32,
    dequantize_fp8,
    dequantize_nvfp4,
    f32_to_bf16_bits,
    quantize_compressed_nvfp4,
    quantize_fp8,
    quantize_nvfp4,
    write_safetensors,
)
from monolith.formats.compressed import tensor_scale_from_global

# ---- building test checkpoints ---------------------------------------------------

H, I, V, E = 32, 16, 64, 4
P = "model.language_model"
L0, L1 = f"{P}.layers.0", f"{P}.layers.1"


def moe_shapes() -> dict[str, tuple[int, ...]]:
    """Module name -> weight shape of a tiny Qwen3.5-MoE-like text model (layer 0
    GDN + MoE, layer 1 attention)."""
    shapes = {
        f"{P}.embed_tokens": (V, H),
        f"{P}.norm": (H,),
        "lm_head": (V, H),
        f"{L0}.input_layernorm": (H,),
        f"{L0}.post_attention_layernorm": (H,),
        f"{L0}.linear_attn.in_proj_qkv": (64, H),
        f"{L0}.linear_attn.in_proj_z": (32, H),
        f"{L0}.linear_attn.in_proj_a": (4, H),
        f"{L0}.linear_attn.in_proj_b": (4, H),
        f"{L0}.linear_attn.conv1d": (64, 1, 4),
        f"{L0}.linear_attn.norm": (8,),
        f"{L0}.linear_attn.out_proj": (H, 32),
        f"{L0}.mlp.gate": (E, H),
        f"{L0}.mlp.shared_expert_gate": (1, H),
        f"{L1}.input_layernorm": (H,),
        f"{L1}.self_attn.q_proj": (64, H),
        f"{L1}.self_attn.k_proj": (16, H),
        f"{L1}.self_attn.v_proj": (16, H),
        f"{L1}.self_attn.o_proj": (H, 32),
        f"{L1}.self_attn.q_norm": (8,),
        f"{L1}.self_attn.k_norm": (8,),
    }
    for prefix in [f"{L0}.mlp.shared_expert"] + [f"{L0}.mlp.experts.{e}" for e in range(E)]:
        shapes[f"{prefix}.gate_proj"] = (I, H)
        shapes[f"{prefix}.up_proj"] = (I, H)
        shapes[f"{prefix}.down_proj"] = (H, I)
    return shapes


def weight(name: str, shape) -> np.ndarray:
    """Deterministic BF16-representable values, with an outlier to exercise scales."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    w = rng.standard_normal(shape).astype(np.float32) * 0.05
    w.reshape(-1)[0] = 0.4
    return bf16_bits_to_f32(f32_to_bf16_bits(w))


def store(tensors: dict, name: str, w: np.ndarray, fmt: str) -> np.ndarray:
    """Put module `name` into `tensors` in format `fmt`; return what dequantizing it
    must give exactly."""
    if fmt == "bf16":
        tensors[f"{name}.weight"] = ("BF16", f32_to_bf16_bits(w))
        return w
    if fmt == "f32":
        tensors[f"{name}.weight"] = ("F32", w)
        return w
    if fmt == "nvfp4":  # ModelOpt
        q = quantize_nvfp4(w)
        tensors[f"{name}.weight"] = ("U8", q.packed)
        tensors[f"{name}.weight_scale"] = ("F8_E4M3", q.scales)
        tensors[f"{name}.weight_scale_2"] = ("F32", np.array(q.tensor_scale, dtype=np.float32))
        tensors[f"{name}.input_scale"] = ("F32", np.array(0.5, dtype=np.float32))
        return dequantize_nvfp4(q.packed, q.scales, q.tensor_scale)
    if fmt == "ct-nvfp4":  # compressed-tensors
        packed, scales, global_scale = quantize_compressed_nvfp4(w)
        tensors[f"{name}.weight_packed"] = ("U8", packed)
        tensors[f"{name}.weight_scale"] = ("F8_E4M3", scales)
        tensors[f"{name}.weight_global_scale"] = ("F32", global_scale)
        tensors[f"{name}.input_global_scale"] = ("F32", np.array([3.0], dtype=np.float32))
        return dequantize_nvfp4(packed, scales, tensor_scale_from_global(global_scale))
    if fmt in ("fp8", "fp8-channel"):
        codes, scale = quantize_fp8(w, per_channel=fmt == "fp8-channel")
        tensors[f"{name}.weight"] = ("F8_E4M3", codes)
        tensors[f"{name}.weight_scale"] = ("F32", scale)
        tensors[f"{name}.input_scale"] = ("F32", np.array(0.5, dtype=np.float32))
        return dequantize_fp8(codes, scale)
    raise ValueError(fmt)


MOE_CONFIG = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "auto_map": {"AutoModel": "modeling_evil.EvilModel"},  # must be ignored
    "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": H, "num_experts": E, "vocab_size": V},
    "vision_config": {"depth": 1},
}


def write_checkpoint(path: Path, fmt_of, config=MOE_CONFIG, shapes=None, hf_quant=None, shards=1):
    """Write a checkpoint; `fmt_of(name, shape)` picks each module's storage format.
    Returns {module: exact dequantized weight} and {module: original weight}."""
    path.mkdir(parents=True, exist_ok=True)
    shapes = moe_shapes() if shapes is None else shapes
    groups, expected, original = [], {}, {}
    for name, shape in shapes.items():
        tensors: dict = {}
        original[name] = weight(name, shape)
        expected[name] = store(tensors, name, original[name], fmt_of(name, shape))
        groups.append(tensors)
    extras = {f"{L0}.linear_attn.A_log": ("F32", np.linspace(-1, 1, 4, dtype=np.float32)),
              f"{L0}.linear_attn.dt_bias": ("BF16", f32_to_bf16_bits(np.ones(4, np.float32)))}
    groups.append(extras)
    if shards == 1:
        write_safetensors(path / "model.safetensors", {k: v for g in groups for k, v in g.items()})
    else:  # whole modules round-robin over the shards
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: v for g in groups[s::shards] for k, v in g.items()}
            write_safetensors(path / fname, part)
            weight_map.update({k: fname for k in part})
        index = {"metadata": {"total_size": 0}, "weight_map": dict(sorted(weight_map.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = dict(config)
    if hf_quant is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
        config["quantization_config"] = {"quant_method": "modelopt", **hf_quant["quantization"]}
    (path / "config.json").write_text(json.dumps(config))
    return expected, original


def precisions(ck: Checkpoint) -> dict[str, str]:
    return {name: spec.precision for name, spec in ck.modules().items()}


def assert_dequantized(ck: Checkpoint, expected: dict, original: dict, rel: float) -> None:
    for name, exact in expected.items():
        got = ck.dequantize(name)
        assert got.dtype == np.float32 and got.shape == exact.shape, name
        np.testing.assert_array_equal(got, exact, err_msg=name)
        err = np.linalg.norm(got - original[name]) / np.linalg.norm(original[name])
        assert err <= rel, (name, err)


NVFP4_REL, FP8_REL = 0.12, 0.05  # relative Frobenius error bounds of the formats


MODELOPT_EXCLUDES = ["lm_head", "*.mlp.gate", "*shared_expert_gate*", "*linear_attn.in_proj_a",
                     "*linear_attn.in_proj_b", "model.visual*", "mtp*"]


def modelopt_nvfp4_fmt(name, shape):
    excluded = name == "lm_head" or name.endswith((".mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b"))
    if len(shape) != 2 or excluded or "embed_tokens" in name:
        return "bf16"
    return "nvfp4"


CT_NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                    "strategy": "tensor_group", "dynamic": False}


def ct_config(fmt, groups, ignore):
    return {**MOE_CONFIG, "quantization_config": {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None}}


Q = f"{L1}.self_attn.q_proj"


def assert_error(path, *needles):
    """Opening (files, headers, configs) or checking every module (done when a recipe
    asks for each one) raises a CheckpointError naming all of `needles`."""
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path).modules()
    assert isinstance(info.value, FormatError)
    for needle in needles:
        assert str(needle) in str(info.value), (needle, str(info.value))
    return str(info.value)
