"""Packs: bad input is refused with an error naming the culprit, and leaves nothing behind."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pack_helpers import assert_cli_error, copy_checkpoint, leftovers, run_cli

from monolith.formats import SafetensorsFile, write_safetensors
from monolith.pack import PackError, build_pack


def test_truncated_shard_is_refused_and_leaves_no_pack(synth_dir, tmp_path):
    src = copy_checkpoint(synth_dir("target", "modelopt-nvfp4"), tmp_path / "src")
    shard = sorted(src.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    result = run_cli("build", src, "--out", tmp_path / "out")
    assert_cli_error(result, shard.name, "truncated")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_missing_scale_tensor_is_named(synth_dir, tmp_path):
    src = copy_checkpoint(synth_dir("target", "modelopt-nvfp4", shards=1), tmp_path / "src")
    path = src / "model.safetensors"
    st = SafetensorsFile(path)
    victim = "model.language_model.layers.0.linear_attn.out_proj.weight_scale"
    tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names() if n != victim}
    write_safetensors(path, tensors)
    assert_cli_error(run_cli("build", src, "--out", tmp_path / "out"), "out_proj", "weight_scale")
    assert not (tmp_path / "out").exists()


def test_wrong_scale_dtype_and_shape_are_named(synth_dir, tmp_path):
    for case in ("dtype", "shape"):
        src = copy_checkpoint(synth_dir("target", "modelopt-nvfp4", shards=1), tmp_path / f"src-{case}")
        path = src / "model.safetensors"
        st = SafetensorsFile(path)
        victim = "model.language_model.layers.0.linear_attn.out_proj.weight_scale"
        tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
        data = tensors[victim][1]
        tensors[victim] = ("U8", data) if case == "dtype" else ("F8_E4M3", data[:, :-1].copy())
        write_safetensors(path, tensors)
        assert_cli_error(run_cli("build", src, "--out", tmp_path / f"out-{case}"), victim)


def test_unknown_quant_algo_and_architecture_are_refused(synth_dir, tmp_path):
    src = copy_checkpoint(synth_dir("target", "modelopt-nvfp4"), tmp_path / "algo")
    for name in ("config.json", "hf_quant_config.json"):
        cfg = json.loads((src / name).read_text())
        block = cfg.get("quantization_config") or cfg.get("quantization")
        block["quant_algo"] = "INT3_MAGIC"
        (src / name).write_text(json.dumps(cfg))
    assert_cli_error(run_cli("build", src, "--out", tmp_path / "o1"), "INT3_MAGIC")
    src = copy_checkpoint(synth_dir("target", "bf16"), tmp_path / "arch")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    cfg.pop("text_config")
    (src / "config.json").write_text(json.dumps(cfg))
    assert_cli_error(run_cli("build", src, "--out", tmp_path / "o2"), "config.json", "qwen3_5_moe")


def test_k_not_multiple_of_16_is_refused(synth_dir, tmp_path):
    src = copy_checkpoint(synth_dir("target", "modelopt-nvfp4", shards=1), tmp_path / "src")
    path = src / "model.safetensors"
    st = SafetensorsFile(path)
    tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
    victim = "model.language_model.layers.0.linear_attn.out_proj"
    n = tensors[victim + ".weight"][1].shape[0]
    tensors[victim + ".weight"] = ("U8", np.zeros((n, 12), np.uint8))  # K = 24
    tensors[victim + ".weight_scale"] = ("F8_E4M3", np.zeros((n, 1), np.uint8))
    write_safetensors(path, tensors)
    assert_cli_error(run_cli("build", src, "--out", tmp_path / "out"), victim, "K=24", "16")


def test_unexpected_tensor_is_refused(synth_dir, tmp_path):
    src = copy_checkpoint(synth_dir("target", "bf16", shards=1), tmp_path / "src")
    path = src / "model.safetensors"
    st = SafetensorsFile(path)
    tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
    tensors["model.language_model.layers.0.mlp.mystery_bias"] = ("F32", np.zeros(4, np.float32))
    write_safetensors(path, tensors)
    with pytest.raises(PackError, match="mystery_bias"):
        build_pack(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_a_crash_mid_build_leaves_nothing_behind(synth_dir, tmp_path, monkeypatch):
    import monolith.pack.build as build

    calls = {"n": 0}
    real = build.convert_entry

    def crash_on_fifth(ckpt, entry):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(ckpt, entry)

    monkeypatch.setattr(build, "convert_entry", crash_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        build_pack(synth_dir("target", "bf16"), tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
