"""Packs: layout and precision of every target and draft format (the keep policies)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from pack_helpers import TARGET_FORMATS, assert_cli_error, copy_checkpoint, pack_tensor, run_cli

from monolith import formats
from monolith.checkpoint import CheckpointError, open_checkpoint
from monolith.formats import SafetensorsFile, write_safetensors
from monolith.pack import PackError, build_pack, read_manifest, verify_pack

# ------------------------------------------------------------------ layout and precision
MIXED_EXPECTED = {  # docs/formats.md 2a: the nvidia Qwen3.6-35B-A3B MIXED_PRECISION table
    "model.layers.0.mlp.experts.gate_up": "nvfp4",
    "model.layers.0.mlp.experts.down": "nvfp4",
    "model.layers.0.mlp.shared_expert.gate_up": "nvfp4",
    "lm_head": "nvfp4",
    "model.layers.3.self_attn.qkv": "fp8",
    "model.layers.3.self_attn.o_proj": "fp8",
    "model.layers.0.linear_attn.in_proj.0": "fp8",  # in_proj_qkv | in_proj_z
    "model.layers.0.linear_attn.in_proj.1": "bf16",  # in_proj_b | in_proj_a
    "model.layers.0.linear_attn.out_proj": "fp8",
    "model.layers.0.mlp.gate": "bf16",
    "model.layers.0.mlp.shared_expert_gate": "bf16",
    "model.embed_tokens": "bf16",
    "model.layers.0.linear_attn.conv1d": "bf16",
    "model.layers.0.linear_attn.A_log": "f32",
    "model.layers.0.input_layernorm": "f32",
}


def test_mixed_checkpoint_entries_keep_each_linears_precision(synth_dir, tmp_path):
    pack = build_pack(synth_dir("target", "modelopt-mixed"), tmp_path / "p")
    entries = read_manifest(pack)["entries"]
    for name, precision in MIXED_EXPECTED.items():
        assert entries[name]["precision"] == precision, name
    parts = entries["model.layers.0.linear_attn.in_proj.0"]["parts"]
    assert [p["source"].rsplit(".", 1)[-1] for p in parts] == ["in_proj_qkv", "in_proj_z"]


@pytest.mark.parametrize("fmt", TARGET_FORMATS)
def test_every_target_format_packs_with_source_precision(synth_dir, tmp_path, fmt):
    src = synth_dir("target", fmt)
    ckpt = open_checkpoint(str(src))
    pack = build_pack(src, tmp_path / "p")
    manifest = read_manifest(pack)
    for name, entry in manifest["entries"].items():
        if entry["kind"] == "tensor":
            continue
        for part in entry["parts"]:
            if entry.get("stacked_source"):
                continue
            source = ckpt.module(part["source"]).precision
            expected = source if source in ("nvfp4", "fp8") else entry["source_precision"]
            assert entry["precision"] == expected, (name, part["source"])
    validation = json.loads((pack / "validation.json").read_text())
    quantized_parts = sum(len(e["parts"]) for e in manifest["entries"].values() if e["precision"] in ("nvfp4", "fp8"))
    assert validation["round_trip"]["quantized_parts_byte_identical"] == quantized_parts
    assert validation["pack_sha256"] == manifest["pack_sha256"]


def test_pack_tensors_feed_mlx_quantized_matmul(synth_dir, tmp_path):
    """The stored words/scales/per-row tensor scales are exactly what MLX consumes."""
    src = synth_dir("target", "modelopt-mixed")
    ckpt = open_checkpoint(str(src))
    pack = build_pack(src, tmp_path / "p")
    entries = read_manifest(pack)["entries"]
    rng = np.random.default_rng(1)
    for name in ("model.layers.3.self_attn.qkv", "model.layers.0.linear_attn.in_proj.0", "lm_head"):
        entry = entries[name]
        reference = np.concatenate([ckpt.dequantize(p["source"]) for p in entry["parts"]])
        x = rng.standard_normal((3, reference.shape[1])).astype(np.float32)
        mode, group, bits = ("nvfp4", 16, 4) if entry["precision"] == "nvfp4" else ("mxfp8", 32, 8)
        y = mx.quantized_matmul(mx.array(x), mx.array(pack_tensor(pack, name + ".weight")),
                                mx.array(pack_tensor(pack, name + ".scales")), transpose=True,
                                group_size=group, bits=bits, mode=mode) * mx.array(pack_tensor(pack, name + ".tensor_scale"))
        np.testing.assert_allclose(np.array(y), x @ reference.T, rtol=1e-5, atol=1e-5 * np.abs(x @ reference.T).max())
    # stacked experts through gather_qmm, per-expert scale after
    name = "model.layers.0.mlp.experts.down"
    w, s, ts = (pack_tensor(pack, name + suffix) for suffix in (".weight", ".scales", ".tensor_scale"))
    experts = np.array([1, 5])
    x = rng.standard_normal((2, 1, w.shape[-1] * 8)).astype(np.float32)
    y = mx.gather_qmm(mx.array(x), mx.array(w), mx.array(s), rhs_indices=mx.array(experts), transpose=True,
                      group_size=16, bits=4, mode="nvfp4")
    y = np.array(y)[:, 0] * ts[experts]
    prefix = entries[name]["parts"][0]["source"].split(".experts.")[0]
    for i, e in enumerate(experts):
        ref = x[i, 0] @ ckpt.dequantize(f"{prefix}.experts.{e}.down_proj").T
        np.testing.assert_allclose(y[i], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_zero_centred_norms_are_stored_as_one_plus_w(synth_dir, tmp_path):
    src = synth_dir("target", "bf16")
    ckpt = open_checkpoint(str(src))
    pack = build_pack(src, tmp_path / "p")
    stored = pack_tensor(pack, "model.layers.0.input_layernorm")
    source = ckpt.read_float("model.language_model.layers.0.input_layernorm.weight")
    assert stored.dtype == np.float32
    np.testing.assert_array_equal(stored, np.float32(1) + source)
    plain = pack_tensor(pack, "model.layers.0.linear_attn.norm")  # gated norm: plain weight
    np.testing.assert_array_equal(plain, ckpt.read_float("model.language_model.layers.0.linear_attn.norm.weight"))


def test_nvfp4_quantization_of_a_bf16_target_follows_the_keep_policy(synth_dir, tmp_path):
    src = synth_dir("target", "bf16")
    pack = build_pack(src, tmp_path / "p", quantization="nvfp4")
    entries = read_manifest(pack)["entries"]
    for name in ("model.layers.0.linear_attn.in_proj.0", "model.layers.0.linear_attn.out_proj",
                 "model.layers.3.self_attn.qkv", "model.layers.0.mlp.experts.gate_up", "lm_head"):
        assert entries[name]["precision"] == "nvfp4", name
    for name in ("model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate", "model.embed_tokens",
                 "model.layers.0.linear_attn.in_proj.1"):
        assert entries[name]["precision"] == "bf16", name
        assert entries[name]["reason"], name
    conversion = json.loads((pack / "conversion.json").read_text())
    assert "router" in conversion["policy"]["model.layers.0.mlp.gate"]["reason"]
    tower = {n: e for n, e in entries.items() if n.startswith("model.visual.")}
    assert len(tower) == 21 and all(e["precision"] == "bf16" and "never quantized" in e["reason"]
                                    for e in tower.values())


def test_quantized_fused_experts_match_per_expert_quantization(synth_dir, tmp_path):
    """A BF16 fused-expert source quantized at pack time gives the same bytes as the
    per-expert layout of the same weights (each expert's gate and up on their own)."""
    fused = build_pack(synth_dir("target", "bf16", expert_layout="fused"), tmp_path / "f", quantization="nvfp4")
    per = build_pack(synth_dir("target", "bf16", expert_layout="per-expert"), tmp_path / "p", quantization="nvfp4")
    for suffix in (".weight", ".scales", ".tensor_scale"):
        for name in ("model.layers.0.mlp.experts.gate_up", "model.layers.0.mlp.experts.down"):
            np.testing.assert_array_equal(pack_tensor(fused, name + suffix), pack_tensor(per, name + suffix))


def test_nvfp4_source_build_never_runs_the_quantizer(synth_dir, tmp_path, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("quantizer or dequantizer called during an NVFP4-source build")

    import monolith.pack.convert as convert

    monkeypatch.setattr(formats, "quantize_nvfp4", forbidden)
    monkeypatch.setattr(formats.nvfp4, "quantize_nvfp4", forbidden)
    monkeypatch.setattr(convert.formats, "quantize_nvfp4", forbidden)
    monkeypatch.setattr("monolith.pack.validate.SPOT_CHECKS_PER_PRECISION", 0)  # spot checks dequantize on purpose
    for fmt in ("modelopt-nvfp4", "compressed-tensors"):
        pack = build_pack(synth_dir("target", fmt), tmp_path / fmt)
        assert verify_pack(pack)


@pytest.mark.parametrize("fmt", ["modelopt-mixed", "bf16"])
def test_spot_checks_run_the_quantized_kernels_on_bounded_rows(synth_dir, tmp_path, monkeypatch, fmt):
    """Validation multiplies the first rows of a few quantized linears (source NVFP4/FP8
    dequantized, or the pack's own values when quantized here) through MLX's kernels:
    a kernel result that is off fails the build, naming the entry; no pack is left."""
    import monolith.pack.validate as validate

    src = synth_dir("target", fmt)
    monkeypatch.setattr(validate, "SPOT_ROWS", 8)
    pack = build_pack(src, tmp_path / "ok", quantization="nvfp4")
    checks = json.loads((pack / "validation.json").read_text())["spot_checks"]
    assert checks and all(c["rows"] == 8 and c["max_relative_error"] <= validate.SPOT_TOLERANCE for c in checks)
    real = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: real(*a, **k) * 1.01)  # a kernel 1% off
    with pytest.raises(PackError, match=r"pack entry .*quantized matmul differs from the source"):
        build_pack(src, tmp_path / "bad", quantization="nvfp4")
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------ drafts
DRAFT_FORMATS = ["deepspec", "deepspec-nvfp4", "speculators", "dflash"]


@pytest.mark.parametrize("fmt", DRAFT_FORMATS)
def test_every_draft_format_packs_with_the_draft_keep_policy(synth_dir, tmp_path, fmt):
    pack = build_pack(synth_dir("draft", fmt), tmp_path / "p")  # auto: drafts become NVFP4
    manifest = read_manifest(pack)
    entries = manifest["entries"]
    assert manifest["role"] == "draft"
    for name, entry in entries.items():
        if name in ("markov_head.markov_w1", "confidence_head.proj"):
            assert entry["precision"] == "bf16", name
        elif entry["kind"] == "tensor":
            assert entry["precision"] in ("f32", "i64", "bool"), name
        else:
            assert entry["precision"] == "nvfp4", name
    assert "fc" in entries and "layers.0.self_attn.qkv" in entries and "layers.1.mlp.gate_up" in entries
    settings = manifest["layout"]["draft"]
    assert settings["target_layer_ids"] == [0, 2]  # DeepSpec convention whatever the format
    assert settings["mask_token_id"] is not None and settings["block_size"] in (8, 16)
    assert verify_pack(pack)


def test_speculators_draft_packs_like_its_deepspec_twin(synth_dir, tmp_path):
    """Same weights, two formats: the backbone entries are byte-identical and the tap
    ids agree after the speculators +1 convention is undone."""
    spec = build_pack(synth_dir("draft", "speculators"), tmp_path / "s", quantization="none")
    deep = build_pack(synth_dir("draft", "deepspec"), tmp_path / "d", quantization="none")
    ms, md = read_manifest(spec), read_manifest(deep)
    assert ms["layout"]["draft"]["target_layer_ids"] == md["layout"]["draft"]["target_layer_ids"]
    shared = [n for n in ms["tensors"] if n.startswith(("layers.", "fc", "hidden_norm", "norm", "markov_head.markov_w1"))]
    assert len(shared) > 10
    for name in shared:
        assert ms["tensors"][name]["sha256"] == md["tensors"][name]["sha256"], name
    d2t = pack_tensor(spec, "d2t")
    rows = np.arange(len(d2t)) + d2t  # draft row i is target row i + d2t[i]
    np.testing.assert_array_equal(pack_tensor(spec, "lm_head.weight"), pack_tensor(deep, "lm_head.weight")[rows])


def test_nvfp4_draft_export_is_only_repacked(synth_dir, tmp_path, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("quantizer called during an NVFP4-source build")

    monkeypatch.setattr("monolith.pack.convert.formats.quantize_nvfp4", forbidden)
    pack = build_pack(synth_dir("draft", "deepspec-nvfp4"), tmp_path / "p", quantization="nvfp4")
    validation = json.loads((pack / "validation.json").read_text())
    assert validation["round_trip"]["quantized_parts_byte_identical"] >= 12


def test_reduced_vocabulary_without_d2t_is_refused(synth_dir, tmp_path):
    src = copy_checkpoint(synth_dir("draft", "speculators"), tmp_path / "src")
    for path in src.glob("*.safetensors"):
        st = SafetensorsFile(path)
        tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names() if n != "d2t"}
        write_safetensors(path, tensors)
    index = src / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].pop("d2t", None)
        index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="d2t"):
        build_pack(src, tmp_path / "out")


def test_missing_config_field_is_named(synth_dir, tmp_path):
    src = copy_checkpoint(synth_dir("target", "bf16"), tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["text_config"]["num_hidden_layers"], cfg["text_config"]["layer_types"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert_cli_error(run_cli("build", src, "--out", tmp_path / "out"), "config.json", "num_hidden_layers")
