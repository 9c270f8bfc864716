"""monolith.checkpoint: broken checkpoints are refused with errors naming the file,
tensor, module or config field at fault.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from checkpoint_builders import (
    CT_NVFP4_WEIGHTS,
    H,
    L1,
    MOE_CONFIG,
    P,
    Q,
    V,
    assert_error,
    ct_config,
    store,
    weight,
    write_checkpoint,
)

from monolith.checkpoint import (
    SUPPORTED_ARCHITECTURES,
    Checkpoint,
    CheckpointError,
    open_checkpoint,
)
from monolith.formats import f32_to_bf16_bits, write_safetensors


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


def test_a_tensor_in_two_files_is_read_where_the_index_puts_it(tmp_path):
    write_checkpoint(tmp_path, lambda n, s: "bf16", shards=2)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = min(index["weight_map"])
    stored = Checkpoint(tmp_path).read(name)
    other = (stored ^ 0x7F).astype(np.uint16)
    write_safetensors(tmp_path / "model_extra.safetensors", {name: ("BF16", other)})
    assert np.array_equal(Checkpoint(tmp_path).read(name), stored)  # the index names the first copy
    index["weight_map"][name] = "model_extra.safetensors"
    index_path.write_text(json.dumps(index))
    ckpt = Checkpoint(tmp_path)
    assert np.array_equal(ckpt.read(name), other) and ckpt.file_of(name).name == "model_extra.safetensors"


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
