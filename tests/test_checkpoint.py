"""monolith.checkpoint: finding, reading and checking checkpoints in every format.

Every checkpoint here is built in tmp_path with monolith.formats; nothing touches
the network (the hub tests use a fake local cache and a socket guard).
"""

from __future__ import annotations

import hashlib
import json
import socket
import zlib
from pathlib import Path

import numpy as np
import pytest

from monolith.checkpoint import (
    SUPPORTED_ARCHITECTURES,
    Checkpoint,
    CheckpointError,
    ModuleSpec,
    open_checkpoint,
    resolve_checkpoint,
)
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

# ---- formats ---------------------------------------------------------------------

MODELOPT_EXCLUDES = ["lm_head", "*.mlp.gate", "*shared_expert_gate*", "*linear_attn.in_proj_a",
                     "*linear_attn.in_proj_b", "model.visual*", "mtp*"]


def modelopt_nvfp4_fmt(name, shape):
    excluded = name == "lm_head" or name.endswith((".mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b"))
    if len(shape) != 2 or excluded or "embed_tokens" in name:
        return "bf16"
    return "nvfp4"


def test_modelopt_nvfp4_with_exclude_globs(tmp_path):
    hf_quant = {"producer": {"name": "modelopt", "version": "0.47.0"},
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                                 "exclude_modules": MODELOPT_EXCLUDES}}
    expected, original = write_checkpoint(tmp_path, modelopt_nvfp4_fmt, hf_quant=hf_quant)
    ck = open_checkpoint(str(tmp_path))
    assert (ck.architecture, ck.role, ck.quant_format) == ("qwen3_5_moe", "target", "modelopt-nvfp4")
    assert ck.quant_config == hf_quant["quantization"]
    assert ck.text_config == MOE_CONFIG["text_config"] and ck.files == [tmp_path / "model.safetensors"]
    want = {n: "nvfp4" if modelopt_nvfp4_fmt(n, s) == "nvfp4" else "bf16" for n, s in moe_shapes().items()}
    assert precisions(ck) == want
    spec = ck.module(f"{L0}.mlp.experts.2.down_proj")
    m = spec.name
    assert spec == ModuleSpec(m, "nvfp4", {"weight": f"{m}.weight", "weight_scale": f"{m}.weight_scale",
                                           "weight_scale_2": f"{m}.weight_scale_2"}, (H, I))
    assert ck.module(f"{L0}.linear_attn.conv1d").shape == (64, 1, 4)
    assert f"{L0}.linear_attn.A_log" in ck.tensor_names() and f"{L0}.linear_attn.A_log" not in ck.modules()
    w = ck.read_nvfp4(m)
    q = quantize_nvfp4(original[m])
    np.testing.assert_array_equal(w.packed, q.packed)
    np.testing.assert_array_equal(w.scales, q.scales)
    assert w.tensor_scale == q.tensor_scale and isinstance(w.tensor_scale, np.float32)
    assert isinstance(w.packed, np.memmap)  # lazy: data stays on disk
    assert_dequantized(ck, expected, original, NVFP4_REL)


MIXED_NVFP4 = [f"{L0}.mlp.experts", f"{L0}.mlp.shared_expert.gate_proj", f"{L0}.mlp.shared_expert.up_proj",
               f"{L0}.mlp.shared_expert.down_proj", "lm_head"]
MIXED_FP8 = [f"{L0}.linear_attn.in_proj_qkv", f"{L0}.linear_attn.in_proj_z", f"{L0}.linear_attn.out_proj"] + [
    f"{L1}.self_attn.{p}_proj" for p in "qkvo"]


def mixed_fmt(name, shape):
    if name in MIXED_FP8:
        return "fp8"
    if name == "lm_head" or ".experts." in name or ".shared_expert." in name:
        return "nvfp4"
    return "bf16"


def test_modelopt_mixed_precision_containers_fp8_sharded(tmp_path):
    layers = {m: {"quant_algo": "W4A16_NVFP4", "group_size": 16} for m in MIXED_NVFP4}
    layers.update({m: {"quant_algo": "FP8"} for m in MIXED_FP8})
    hf_quant = {"producer": {"name": "modelopt"},
                "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8",
                                 "quantized_layers": layers}}
    expected, original = write_checkpoint(tmp_path, mixed_fmt, hf_quant=hf_quant, shards=3)
    ck = open_checkpoint(tmp_path)
    assert ck.quant_format == "modelopt-mixed"
    assert [f.name for f in ck.files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    want = {n: {"fp8": "fp8", "nvfp4": "nvfp4"}.get(mixed_fmt(n, s), "bf16") for n, s in moe_shapes().items()}
    assert precisions(ck) == want
    q = f"{L1}.self_attn.q_proj"
    assert ck.module(q).tensors == {"weight": f"{q}.weight", "weight_scale": f"{q}.weight_scale"}
    codes, scale = ck.read_fp8(q)
    assert codes.dtype == np.uint8 and codes.shape == (64, H) and scale.shape == () and scale.dtype == np.float32
    assert_dequantized(ck, expected, original, NVFP4_REL)
    names = ck.tensor_names()
    assert names == sorted(names) and len({ck.file_of(n) for n in names}) == 3


def modelopt_mirror(hf_quant: dict) -> dict:
    """config.json quantization_config as recent ModelOpt exports write it (from the rules
    of modelopt/torch/export/convert_hf_config.py, convert_hf_quant_config_format): a
    compressed-tensors-shaped block; MIXED_PRECISION keeps quantized_layers and adds one
    config group per distinct layer config; exclude_modules becomes ignore;
    kv_cache_quant_algo becomes kv_cache_scheme (so the FP8 KV setting is only in
    hf_quant_config.json)."""
    q = hf_quant["quantization"]
    mirror: dict = {}
    if q["quant_algo"] == "NVFP4":
        g = q.get("group_size", 16)
        weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": g}
        mirror["config_groups"] = {"group_0": {"input_activations": dict(weights), "weights": weights,
                                               "targets": ["Linear"]}}
    elif q["quant_algo"] == "MIXED_PRECISION":
        by_config: dict = {}
        for layer, cfg in q["quantized_layers"].items():
            by_config.setdefault(tuple(sorted(cfg.items())), []).append(layer)
        groups = {}
        for i, (key, layers) in enumerate(by_config.items()):
            cfg = dict(key)
            bits = 8 if cfg["quant_algo"] == "FP8" else 4
            weights = {"dynamic": False, "num_bits": bits, "type": "float"}
            if bits == 4:
                weights["group_size"] = cfg.get("group_size", 16)
            groups[f"group_{i}"] = {"weights": weights, "targets": sorted(layers)}
        mirror["config_groups"] = groups
        mirror["quantized_layers"] = q["quantized_layers"]
    mirror["ignore"] = q.get("exclude_modules") or []
    mirror["quant_algo"] = q["quant_algo"]
    if q.get("kv_cache_quant_algo") == "FP8":
        mirror["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    mirror["producer"] = hf_quant["producer"]
    mirror["quant_method"] = "modelopt"
    return mirror


def write_modelopt(path: Path, fmt_of, hf_quant: dict, keep_hf_quant: bool, mirror: dict | None = None):
    expected, original = write_checkpoint(path, fmt_of, hf_quant=hf_quant)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = mirror or modelopt_mirror(hf_quant)
    (path / "config.json").write_text(json.dumps(config))
    if not keep_hf_quant:
        (path / "hf_quant_config.json").unlink()
    return expected, original


MIXED_HF_QUANT = {
    "producer": {"name": "modelopt", "version": "0.44.0"},
    "quantization": {
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8",
        "exclude_modules": ["*.mlp.gate", "*shared_expert_gate*", "model.visual*", "mtp*"],
        "quantized_layers": {**{m: {"quant_algo": "W4A16_NVFP4", "group_size": 16} for m in MIXED_NVFP4},
                             **{m: {"quant_algo": "FP8"} for m in MIXED_FP8}},
    },
}


@pytest.mark.parametrize("keep_hf_quant", [True, False], ids=["with-hf_quant_config", "mirror-only"])
def test_modelopt_config_json_mirror_as_recent_exports_write_it(tmp_path, keep_hf_quant):
    expected, original = write_modelopt(tmp_path, mixed_fmt, MIXED_HF_QUANT, keep_hf_quant)
    ck = open_checkpoint(tmp_path)
    assert ck.quant_format == "modelopt-mixed"
    assert ("kv_cache_quant_algo" in ck.quant_config) == keep_hf_quant  # the FP8 KV setting: hf_quant only
    want = {n: {"fp8": "fp8", "nvfp4": "nvfp4"}.get(mixed_fmt(n, s), "bf16") for n, s in moe_shapes().items()}
    assert precisions(ck) == want
    assert_dequantized(ck, expected, original, NVFP4_REL)


def test_modelopt_nvfp4_mirror_ignore_globs_and_group_size(tmp_path):
    hf_quant = {"producer": {"name": "modelopt", "version": "0.44.0"},
                "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": "FP8",
                                 "exclude_modules": MODELOPT_EXCLUDES}}
    expected, original = write_modelopt(tmp_path / "a", modelopt_nvfp4_fmt, hf_quant, keep_hf_quant=False)
    ck = open_checkpoint(tmp_path / "a")
    assert ck.quant_format == "modelopt-nvfp4" and "exclude_modules" not in ck.quant_config
    assert precisions(ck) == {n: "nvfp4" if modelopt_nvfp4_fmt(n, s) == "nvfp4" else "bf16" for n, s in moe_shapes().items()}
    assert_dequantized(ck, expected, original, NVFP4_REL)
    # the mirror's only group size is in its config group: it is checked there
    mirror = modelopt_mirror({**hf_quant, "quantization": {**hf_quant["quantization"], "group_size": 32}})
    write_modelopt(tmp_path / "b", modelopt_nvfp4_fmt, hf_quant, keep_hf_quant=False, mirror=mirror)
    assert_error(tmp_path / "b", "config.json", "config_groups['group_0'].weights.group_size", "32")


def test_modelopt_mirror_that_disagrees_with_hf_quant_config_is_refused(tmp_path):
    mirror = modelopt_mirror(MIXED_HF_QUANT)
    mirror["quant_algo"] = "NVFP4"
    write_modelopt(tmp_path, mixed_fmt, MIXED_HF_QUANT, keep_hf_quant=True, mirror=mirror)
    assert_error(tmp_path, "hf_quant_config.json", "config.json", "MIXED_PRECISION", "NVFP4")


def test_old_modelopt_mirror_without_quantized_layers_needs_hf_quant_config(tmp_path):
    """ModelOpt before MIXED_PRECISION mirrors wrote `quant_library` and no per-layer
    detail: without hf_quant_config.json the per-layer schemes are unknown."""
    mirror = {"ignore": [], "quant_algo": "MIXED_PRECISION", "producer": {"name": "modelopt"},
              "quant_library": "modelopt"}
    write_modelopt(tmp_path, mixed_fmt, MIXED_HF_QUANT, keep_hf_quant=True, mirror=mirror)
    assert open_checkpoint(tmp_path).quant_format == "modelopt-mixed"
    (tmp_path / "hf_quant_config.json").unlink()
    assert_error(tmp_path, "config.json", "quantized_layers", "hf_quant_config.json")


CT_NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                    "strategy": "tensor_group", "dynamic": False}


def ct_config(fmt, groups, ignore):
    return {**MOE_CONFIG, "quantization_config": {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None}}


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


# ---- errors ----------------------------------------------------------------------


def nvfp4_checkpoint(tmp_path, edit=None, exclude=("lm_head",)):
    """A small ModelOpt NVFP4 checkpoint; `edit(tensors)` may break it first."""
    shapes = {"lm_head": (V, H), f"{L1}.self_attn.q_proj": (64, H), f"{P}.norm": (H,)}
    tensors: dict = {}
    for name, shape in shapes.items():
        fmt = "bf16" if len(shape) == 1 or name in exclude else "nvfp4"
        store(tensors, name, weight(name, shape), fmt)
    if edit:
        edit(tensors)
    write_safetensors(tmp_path / "model.safetensors", tensors)
    hf_quant = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": list(exclude)}}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    (tmp_path / "config.json").write_text(json.dumps(MOE_CONFIG))
    return tmp_path


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


def test_error_truncated_file(tmp_path):
    path = nvfp4_checkpoint(tmp_path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-10])
    assert_error(path, f, "truncated", "tensor ")


def test_error_corrupt_header(tmp_path):
    path = nvfp4_checkpoint(tmp_path)
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"\xff" * 12
    f.write_bytes(bytes(data))
    assert_error(path, f, "header")
    f.write_bytes(b"\x01\x02")
    assert_error(path, f, "truncated")


def test_error_missing_scale_tensor(tmp_path):
    path = nvfp4_checkpoint(tmp_path, lambda t: t.pop(f"{Q}.weight_scale"))
    assert_error(path, path / "model.safetensors", f"module {Q}", f"{Q}.weight_scale", "missing")


def test_error_missing_tensor_scale(tmp_path):
    path = nvfp4_checkpoint(tmp_path, lambda t: t.pop(f"{Q}.weight_scale_2"))
    assert_error(path, path / "model.safetensors", f"{Q}.weight_scale_2")


def test_error_wrong_scale_dtype(tmp_path):
    def edit(t):
        t[f"{Q}.weight_scale"] = ("F32", t[f"{Q}.weight_scale"][1].astype(np.float32))
    path = nvfp4_checkpoint(tmp_path, edit)
    assert_error(path, path / "model.safetensors", f"{Q}.weight_scale", "F32", "F8_E4M3")


def test_error_wrong_scale_shape(tmp_path):
    def edit(t):
        t[f"{Q}.weight_scale"] = ("F8_E4M3", np.full((64, H // 8), 0x38, np.uint8))
    path = nvfp4_checkpoint(tmp_path, edit)
    assert_error(path, path / "model.safetensors", f"{Q}.weight_scale", "[64, 4]", "[64, 2]")


def test_error_k_not_multiple_of_16(tmp_path):
    def edit(t):
        t[f"{Q}.weight"] = ("U8", np.zeros((64, 4), np.uint8))  # K = 8
        t[f"{Q}.weight_scale"] = ("F8_E4M3", np.full((64, 1), 0x38, np.uint8))
    path = nvfp4_checkpoint(tmp_path, edit)
    assert_error(path, path / "model.safetensors", f"{Q}.weight", "K=8", "multiple of 16")


def test_error_wrong_weight_dtype_with_scales(tmp_path):
    def edit(t):
        t[f"{Q}.weight"] = ("BF16", f32_to_bf16_bits(weight(Q, (64, H))))
    path = nvfp4_checkpoint(tmp_path, edit)
    assert_error(path, path / "model.safetensors", f"{Q}.weight", "BF16", "U8")


def test_error_excluded_module_is_quantized(tmp_path):
    path = nvfp4_checkpoint(tmp_path, exclude=())
    hf = path / "hf_quant_config.json"
    hf.write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["*self_attn*"]}}))
    assert_error(path, path / "model.safetensors", f"module {Q}", "exclude_modules", "*self_attn*", hf)


def test_error_mixed_listed_module_stored_bf16(tmp_path):
    layers = {"lm_head": {"quant_algo": "NVFP4"}}
    hf_quant = {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}
    write_checkpoint(tmp_path, lambda n, s: "bf16", hf_quant=hf_quant, shapes={"lm_head": (V, H)})
    assert_error(tmp_path, tmp_path / "model.safetensors", "module lm_head", "lm_head.weight_scale", "missing",
                 "quantized_layers")
    # and the opposite: unlisted, yet quantized
    write_checkpoint(tmp_path, lambda n, s: "nvfp4", hf_quant=hf_quant, shapes={"lm_head": (V, H), Q: (64, H)})
    assert_error(tmp_path, f"module {Q}", "does not list it")


def test_error_ct_class_target_with_other_scheme(tmp_path):
    groups = {"group_0": {"targets": ["Linear"], "weights": CT_NVFP4_WEIGHTS, "format": "nvfp4-pack-quantized"}}
    config = ct_config("nvfp4-pack-quantized", groups, [])
    write_checkpoint(tmp_path, lambda n, s: "fp8", config=config, shapes={Q: (64, H)})
    assert_error(tmp_path, f"module {Q}", "fp8", "group_0")


@pytest.mark.parametrize("block, needles", [
    ({"quant_algo": "INT4_AWQ"}, ["hf_quant_config.json", "quant_algo", "INT4_AWQ", "NVFP4", "MIXED_PRECISION"]),
    ({"quant_algo": "NVFP4", "group_size": 32}, ["hf_quant_config.json", "group_size", "32"]),
    ({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"lm_head": {"quant_algo": "INT8"}}},
     ["quantized_layers['lm_head'].quant_algo", "INT8", "W4A16_NVFP4"]),
])
def test_error_unknown_modelopt_algo(tmp_path, block, needles):
    write_checkpoint(tmp_path, lambda n, s: "bf16", shapes={"lm_head": (V, H)}, hf_quant={"quantization": block})
    assert_error(tmp_path, *needles)


@pytest.mark.parametrize("qc, needles", [
    ({"quant_method": "gptq", "bits": 4}, ["config.json", "quant_method", "gptq", "modelopt", "compressed-tensors"]),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     ["config.json", "format", "pack-quantized", "nvfp4-pack-quantized", "float-quantized"]),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}},
     ["config_groups['g']", "4-bit int", "nvfp4-pack-quantized"]),
])
def test_error_unknown_quant_method_or_format(tmp_path, qc, needles):
    write_checkpoint(tmp_path, lambda n, s: "bf16", shapes={"lm_head": (V, H)},
                     config={**MOE_CONFIG, "quantization_config": qc})
    assert_error(tmp_path, *needles)


def test_error_unknown_architecture(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    write_checkpoint(tmp_path, lambda n, s: "bf16", config=config, shapes={"lm_head": (V, H)})
    assert_error(tmp_path, tmp_path / "config.json", "LlamaForCausalLM", "architecture", *SUPPORTED_ARCHITECTURES)


def test_error_config_missing_or_not_json(tmp_path):
    write_checkpoint(tmp_path, lambda n, s: "bf16", shapes={"lm_head": (V, H)})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="config.json"):  # resolve: a directory without it
        open_checkpoint(str(tmp_path))


def test_error_index_lists_missing_shard(tmp_path):
    write_checkpoint(tmp_path, lambda n, s: "bf16", shards=2)
    missing = tmp_path / "model-00002-of-00002.safetensors"
    missing.unlink()
    assert_error(tmp_path, "model.safetensors.index.json", missing.name)


def test_error_index_names_tensor_not_in_shard(tmp_path):
    write_checkpoint(tmp_path, lambda n, s: "bf16", shards=2)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    assert_error(tmp_path, "model.safetensors.index.json", "model-0000", ".weight")


def test_error_tensor_in_two_files(tmp_path):
    write_checkpoint(tmp_path, lambda n, s: "bf16", shapes={"lm_head": (V, H)})
    write_safetensors(tmp_path / "extra.safetensors", {"lm_head.weight": ("BF16", np.zeros((V, H), np.uint16))})
    assert_error(tmp_path, "lm_head.weight", "extra.safetensors", "model.safetensors")


def test_error_quantized_without_config(tmp_path):
    write_checkpoint(tmp_path, lambda n, s: "nvfp4", shapes={Q: (64, H)})
    assert_error(tmp_path, f"module {Q}", "nvfp4", "quantization config")


def test_reading_errors_name_the_tensor(tmp_path):
    ck = open_checkpoint(nvfp4_checkpoint(tmp_path))
    for call in (lambda: ck.read("nope"), lambda: ck.module("nope"), lambda: ck.read_fp8(Q),
                 lambda: ck.read_float(f"{Q}.weight")):
        with pytest.raises(CheckpointError) as info:
            call()
        assert "nope" in str(info.value) or Q in str(info.value)


# ---- finding checkpoints -----------------------------------------------------------

REPO, COMMIT = "tiny-org/tiny-model", "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a test tried to open a network connection")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def make_hub_cache(source: Path, cache: Path, monkeypatch) -> Path:
    """A Hugging Face cache (models--org--name/{blobs,refs,snapshots}) holding the files
    of `source` as REPO at COMMIT, snapshot files linking into blobs/ as in a real cache."""
    import huggingface_hub.constants

    repo_dir = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for f in sorted(source.iterdir()):
        blob = repo_dir / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # read at import time
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, no_network):
    """A hub cache holding a small ModelOpt NVFP4 checkpoint as REPO at COMMIT."""
    source = tmp_path / "source"
    write_checkpoint(source, modelopt_nvfp4_fmt,
                     hf_quant={"quantization": {"quant_algo": "NVFP4", "exclude_modules": MODELOPT_EXCLUDES}})
    return make_hub_cache(source, tmp_path / "hub", monkeypatch)


def test_resolve_from_offline_cache(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_checkpoint(REPO) == hub_cache
    assert resolve_checkpoint(REPO, revision=COMMIT) == hub_cache
    ck = open_checkpoint(REPO)
    assert ck.path == hub_cache and ck.quant_format == "modelopt-nvfp4"
    assert (hub_cache / "model.safetensors").is_symlink()
    for f in ck.source_files():
        data = (hub_cache / f["name"]).read_bytes()
        assert f["bytes"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert resolve_checkpoint(REPO, local_files_only=True) == hub_cache


def test_resolve_not_cached_offline_says_how_to_fix(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint("tiny-org/absent")
    message = str(info.value)
    for needle in ("tiny-org/absent", "not in the local Hugging Face cache", "HF_HUB_OFFLINE",
                   "--local-files-only", "Download it first"):
        assert needle in message
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        resolve_checkpoint(REPO, revision="other-branch", local_files_only=True)


def test_resolve_download_call(monkeypatch, tmp_path, no_network):
    """Online: snapshot_download gets only safe patterns, progress bars are on."""
    import huggingface_hub
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    snapshot = tmp_path / "snap"
    write_checkpoint(snapshot, lambda n, s: "bf16", shapes={"lm_head": (V, H)})
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs, are_progress_bars_disabled()))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    disable_progress_bars()
    try:
        assert resolve_checkpoint(REPO, revision="v1") == snapshot
    finally:
        enable_progress_bars()
    (repo_id, kwargs, bars_disabled) = calls[0]
    assert repo_id == REPO and kwargs["revision"] == "v1" and kwargs["local_files_only"] is False
    assert not bars_disabled
    patterns = kwargs["allow_patterns"]
    for wanted in ("*.json", "*.safetensors", "*.jinja", "*.txt"):
        assert wanted in patterns
    import fnmatch
    for unsafe in ("modeling_evil.py", "pytorch_model.bin", "weights.pt"):
        assert not any(fnmatch.fnmatch(unsafe, p) for p in patterns)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolve_checkpoint(REPO)
    assert calls[-1][1]["local_files_only"] is True


@pytest.mark.parametrize("source", ["/no/such/dir", "./missing", "a/b/c", "not a repo!", "~nobody/x"])
def test_resolve_rejects_non_dir_non_repo(source, no_network):
    with pytest.raises(CheckpointError, match="neither an existing checkpoint directory nor"):
        resolve_checkpoint(source)


def test_resolve_local_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_checkpoint(str(tmp_path)) == tmp_path
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_checkpoint(str(tmp_path / "file"))


def test_pack_builds_from_a_hub_id_offline(synth_dir, tmp_path, monkeypatch, no_network):
    """The pack path for hub ids: resolved from the local cache, nothing downloaded,
    and the source identity (repo, revision) recorded."""
    from monolith.pack import build_pack, read_manifest, resolve_pack

    make_hub_cache(synth_dir("target", "modelopt-nvfp4"), tmp_path / "hub", monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pack = build_pack(REPO, tmp_path / "pack", revision=COMMIT)
    conversion = json.loads((pack / "conversion.json").read_text())
    assert conversion["source"] == {"repo": REPO, "revision": COMMIT}
    cached = resolve_pack(REPO, cache_dir=tmp_path / "cache", local_files_only=True)
    assert read_manifest(cached)["pack_sha256"] == read_manifest(pack)["pack_sha256"]


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
