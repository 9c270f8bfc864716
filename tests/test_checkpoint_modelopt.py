"""monolith.checkpoint: reading ModelOpt checkpoints (NVFP4, MIXED_PRECISION, and the
config.json mirror recent exports write). Every checkpoint is built in tmp_path.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from checkpoint_builders import (
    H,
    I,
    L0,
    L1,
    MODELOPT_EXCLUDES,
    MOE_CONFIG,
    NVFP4_REL,
    assert_dequantized,
    assert_error,
    modelopt_nvfp4_fmt,
    moe_shapes,
    precisions,
    write_checkpoint,
)

from monolith.checkpoint import ModuleSpec, open_checkpoint
from monolith.formats import quantize_nvfp4


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
