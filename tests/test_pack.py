"""Packs: reproducible builds, verify, unpack round trips, keep policy, bad input, cache."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from filelock import FileLock

from monolith import formats
from monolith.checkpoint import CheckpointError, open_checkpoint
from monolith.formats import SafetensorsFile, write_safetensors
from monolith.pack import (
    PackError,
    build_pack,
    inspect_pack,
    read_manifest,
    resolve_pack,
    unpack_pack,
    verify_pack,
)
from monolith.pack.manifest import lock_path

TARGET_FORMATS = ["bf16", "modelopt-nvfp4", "modelopt-mixed", "compressed-tensors", "compressed-tensors-mixed"]


def run_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "monolith.pack", *map(str, args)],
                          capture_output=True, text=True, **kw)


def pack_tensor(pack: Path, name: str) -> np.ndarray:
    manifest = read_manifest(pack)
    return SafetensorsFile(pack / manifest["tensors"][name]["shard"]).read(name)


def copy_checkpoint(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# ------------------------------------------------------------------ reproducibility
def test_two_builds_are_byte_identical(synth_dir, tmp_path):
    src = synth_dir("target", "modelopt-mixed")
    a = build_pack(src, tmp_path / "a", shard_bytes=64 << 10)
    b = build_pack(src, tmp_path / "b", shard_bytes=64 << 10)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert sum(f.endswith(".safetensors") for f in files) > 1  # sharded
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert read_manifest(a)["pack_sha256"] == read_manifest(b)["pack_sha256"]


def test_pack_hash_does_not_depend_on_shard_size(synth_dir, tmp_path):
    src = synth_dir("target", "modelopt-nvfp4")
    a = build_pack(src, tmp_path / "a", shard_bytes=32 << 10)
    b = build_pack(src, tmp_path / "b")
    assert len(read_manifest(a)["shards"]) > len(read_manifest(b)["shards"])
    assert read_manifest(a)["pack_sha256"] == read_manifest(b)["pack_sha256"]


# ------------------------------------------------------------------ verify
@pytest.fixture
def built(synth_dir, tmp_path):
    return build_pack(synth_dir("target", "modelopt-nvfp4"), tmp_path / "pack", shard_bytes=64 << 10)


def test_verify_accepts_a_good_pack_and_cli_exit_0(built):
    summary = verify_pack(built)
    assert summary["tensors"] == len(read_manifest(built)["tensors"])
    result = run_cli("verify", built)
    assert result.returncode == 0 and "ok" in result.stdout


def test_verify_catches_one_flipped_byte(built):
    manifest = read_manifest(built)
    name = "model.layers.0.linear_attn.in_proj.weight"
    shard = built / manifest["tensors"][name]["shard"]
    st = SafetensorsFile(shard)
    offset = st._data_start + st._entries[name][2] + 5
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(PackError, match=f"{shard.name}.*{name}.*SHA-256"):
        verify_pack(built)
    result = run_cli("verify", built)
    assert result.returncode == 1 and name in result.stderr and "Traceback" not in result.stderr


def test_verify_catches_a_missing_shard(built):
    shard = sorted(read_manifest(built)["shards"])[-1]
    (built / shard).unlink()
    with pytest.raises(PackError, match=f"{shard}.*missing"):
        verify_pack(built)
    assert run_cli("verify", built).returncode == 1


def test_verify_catches_an_extra_tensor(built):
    manifest = read_manifest(built)
    shard = sorted(manifest["shards"])[0]
    st = SafetensorsFile(built / shard)
    tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
    tensors["smuggled.weight"] = ("F32", np.ones(4, np.float32))
    write_safetensors(built / shard, tensors)
    with pytest.raises(PackError, match="smuggled.weight.*extra tensor"):
        verify_pack(built)


def test_verify_catches_a_tampered_manifest(built):
    path = built / "manifest.json"
    manifest = json.loads(path.read_text())
    name = next(iter(manifest["tensors"]))
    manifest["tensors"][name]["sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    with pytest.raises(PackError, match="pack_sha256"):
        verify_pack(built)


# ------------------------------------------------------------------ layout and precision
MIXED_EXPECTED = {  # formats.md: the nvidia Qwen3.6-35B-A3B MIXED_PRECISION table
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
    assert any("vision" in why for why in conversion["skipped"].values())


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


# ------------------------------------------------------------------ unpack
@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "modelopt-mixed", "compressed-tensors", "compressed-tensors-mixed"])
def test_unpack_gives_back_the_source_quantized_bytes(synth_dir, tmp_path, fmt):
    src = synth_dir("target", fmt)
    source = open_checkpoint(str(src))
    pack = build_pack(src, tmp_path / "p")
    out = unpack_pack(pack, tmp_path / "u")
    unpacked = open_checkpoint(str(out))
    checked = 0
    for name, spec in source.modules().items():
        if spec.precision not in ("nvfp4", "fp8"):
            continue
        assert unpacked.module(name).precision == spec.precision, name
        if spec.precision == "nvfp4":
            a, b = source.read_nvfp4(name), unpacked.read_nvfp4(name)
            assert np.array_equal(a.packed, b.packed) and np.array_equal(a.scales, b.scales), name
            assert a.tensor_scale.tobytes() == b.tensor_scale.tobytes(), name
            if fmt.startswith("modelopt"):  # same tensors, same bytes
                for role in ("weight", "weight_scale", "weight_scale_2"):
                    assert source.read(spec.tensors[role]).tobytes() == unpacked.read(f"{name}.{role}").tobytes()
        else:
            (ca, sa), (cb, sb) = source.read_fp8(name), unpacked.read_fp8(name)
            assert np.array_equal(ca, cb) and np.array_equal(np.ravel(sa), np.ravel(sb)), name
        checked += 1
    assert checked > 10
    rebuilt = build_pack(out, tmp_path / "p2")
    assert read_manifest(rebuilt)["pack_sha256"] == read_manifest(pack)["pack_sha256"]
    assert run_cli("unpack", pack, "--out", tmp_path / "u2").returncode == 0


def test_unpack_of_a_bf16_source_restores_its_tensors(synth_dir, tmp_path):
    src = synth_dir("target", "bf16", expert_layout="fused")
    source = open_checkpoint(str(src))
    out = unpack_pack(build_pack(src, tmp_path / "p"), tmp_path / "u")
    unpacked = open_checkpoint(str(out))
    skipped = ("model.visual.", "mtp.")
    names = [n for n in source.tensor_names() if not n.startswith(skipped)]
    assert sorted(names) == unpacked.tensor_names()
    for name in names:
        assert source.read(name).tobytes() == unpacked.read(name).tobytes(), name


# ------------------------------------------------------------------ bad input
def assert_cli_error(result, *needles):
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


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


def test_existing_pack_is_not_overwritten_without_force(built):
    before = read_manifest(built)["pack_sha256"]
    with pytest.raises(PackError, match="already exists"):
        build_pack(built, built)
    assert read_manifest(built)["pack_sha256"] == before


def test_build_waits_for_the_lock(synth_dir, tmp_path):
    out = tmp_path / "out"
    lock = FileLock(lock_path(out))
    lock.acquire()
    thread = threading.Thread(target=build_pack, args=(synth_dir("target", "bf16"), out))
    thread.start()
    time.sleep(1.0)
    assert not out.exists()  # blocked behind the lock
    lock.release()
    thread.join(60)
    assert verify_pack(out)


def test_inspect_cli_json(built):
    result = run_cli("inspect", built, "--json")
    assert result.returncode == 0
    info = json.loads(result.stdout)
    assert info == json.loads(json.dumps(inspect_pack(built)))
    assert info["architecture"] == "qwen3_5_moe" and info["entries_by_precision"]["nvfp4"] > 0


# ------------------------------------------------------------------ cache
def test_pack_cache_builds_once_and_rebuilds_when_the_source_changes(synth_dir, tmp_path):
    src = copy_checkpoint(synth_dir("target", "modelopt-nvfp4"), tmp_path / "src")
    cache = tmp_path / "cache"
    first = resolve_pack(src, cache_dir=cache)
    stamp = (first / "manifest.json").stat().st_mtime_ns
    again = resolve_pack(src, cache_dir=cache)
    assert again == first and (first / "manifest.json").stat().st_mtime_ns == stamp
    assert resolve_pack(first) == first  # a pack is used as it is
    other = resolve_pack(src, quantization="none", role="target", cache_dir=cache)
    assert other != first
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["rms_norm_eps"] = 1e-5
    (src / "config.json").write_text(json.dumps(cfg))
    rebuilt = resolve_pack(src, cache_dir=cache)
    assert rebuilt == first
    assert read_manifest(rebuilt)["source"]["config_sha256"] == open_checkpoint(str(src)).config_sha256()
    assert verify_pack(rebuilt)


def test_role_mismatch_is_an_error(synth_dir, tmp_path):
    with pytest.raises(CheckpointError, match="--role draft"):
        build_pack(synth_dir("target", "bf16"), tmp_path / "out", role="draft")


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


# ------------------------------------------------------------------ modules the recipe drops
def move_tensors(src: Path, prefix: str, file: str, listed: bool) -> list[str]:
    """Move every tensor starting with `prefix` into `file` (as unsloth stores its MTP head
    in model_mtp.safetensors) and write an index that lists it, or leaves it out."""
    weight_map, moved = {}, {}
    for path in sorted(src.glob("*.safetensors")):
        st = SafetensorsFile(path)
        kept = {}
        for n in st.names():
            (moved if n.startswith(prefix) else kept)[n] = (st.dtype(n), np.array(st.read(n)))
        st.close()
        write_safetensors(path, kept)
        weight_map.update({n: path.name for n in kept})
    write_safetensors(src / file, moved)
    if listed:
        weight_map.update({n: file for n in moved})
    index = {"metadata": {"total_size": 0}, "weight_map": dict(sorted(weight_map.items()))}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return sorted(moved)


def unsloth_27b_layout(synth_dir, dest: Path, listed: bool) -> tuple[Path, list[str]]:
    """unsloth Qwen3.6-27B Dynamic NVFP4: no ignore entry covers mtp.*, so its MLP and
    attention rules match the BF16 mtp.layers.0 linears, stored in model_mtp.safetensors."""
    src = copy_checkpoint(synth_dir("target", "compressed-tensors-mixed"), dest)
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg["quantization_config"]
    qc["ignore"] = [e for e in qc["ignore"] if "mtp" not in e]
    (src / "config.json").write_text(json.dumps(cfg))
    return src, move_tensors(src, "mtp.", "model_mtp.safetensors", listed)


@pytest.mark.parametrize("listed", [True, False], ids=["index-lists-mtp", "mtp-file-not-in-index"])
def test_dropped_mtp_modules_are_not_checked_against_the_quantization_rules(synth_dir, tmp_path, listed):
    src, mtp = unsloth_27b_layout(synth_dir, tmp_path / "src", listed)
    assert len(mtp) == 15
    pack = build_pack(src, tmp_path / "p")
    skipped = json.loads((pack / "conversion.json").read_text())["skipped"]
    for name in mtp:
        assert "MTP head" in skipped[name], name
        assert ("model_mtp.safetensors" in skipped[name]) == (not listed), skipped[name]
    # a module the runtime uses is still checked strictly
    ckpt = open_checkpoint(str(src))
    assert ckpt.has_module("mtp.layers.0.mlp.gate_proj")
    with pytest.raises(CheckpointError, match="mtp.layers.0.mlp.gate_proj.*weight_packed is missing"):
        ckpt.module("mtp.layers.0.mlp.gate_proj")


def test_a_used_tensor_only_in_a_file_the_index_does_not_list_is_refused(synth_dir, tmp_path):
    src, _ = unsloth_27b_layout(synth_dir, tmp_path / "src", listed=True)
    move_tensors(src, "model.language_model.norm.weight", "extra.safetensors", listed=False)
    assert_cli_error(run_cli("build", src, "--out", tmp_path / "out"), "extra.safetensors",
                     "model.language_model.norm.weight", "index")


def add_quantized_layer(src: Path, module: str, algo: str) -> None:
    for name in ("config.json", "hf_quant_config.json"):
        cfg = json.loads((src / name).read_text())
        block = cfg.get("quantization_config") or cfg["quantization"]
        block["quantized_layers"][module] = {"quant_algo": algo, "group_size": 16}
        (src / name).write_text(json.dumps(cfg))


def test_unsupported_quant_algo_on_a_dropped_module_does_not_refuse_the_checkpoint(synth_dir, tmp_path):
    src = copy_checkpoint(synth_dir("target", "modelopt-mixed"), tmp_path / "src")
    add_quantized_layer(src, "mtp.layers.0.mlp.experts", "NVFP4_AWQ")
    add_quantized_layer(src, "model.visual.blocks.0.mlp.linear_fc1", "SOMETHING_NEW")
    assert verify_pack(build_pack(src, tmp_path / "p"))
    # the same entry on a module the runtime uses is refused, naming entry and algo
    used = copy_checkpoint(synth_dir("target", "modelopt-mixed"), tmp_path / "used")
    add_quantized_layer(used, "model.language_model.layers.0.mlp.gate", "NVFP4_AWQ")
    assert_cli_error(run_cli("build", used, "--out", tmp_path / "o"), "NVFP4_AWQ",
                     "quantized_layers['model.language_model.layers.0.mlp.gate']")


# ------------------------------------------------------------------ fused (3-D) quantized experts
EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(\w+)$")


def fuse_experts(src: Path) -> None:
    """Rewrite the single shard of `src` with every layer's experts fused, named and
    merged as transformers 5 does (MergeModulelist(dim=0) + Concatenate(dim=1)): the
    group name plus the serialized name without `weight` (`gate_up_proj_packed`,
    `_scale`, `_global_scale`, `_scale_2`, `_input_scale`...); scalars become [E, 2] / [E, 1]."""
    path = src / "model.safetensors"
    st = SafetensorsFile(path)
    out, groups = {}, {}
    for n in st.names():
        m = EXPERT.match(n)
        data = np.array(st.read(n))
        if m is None:
            out[n] = (st.dtype(n), data)
            continue
        container, e, proj, role = m.groups()
        if data.ndim == 0:
            data = data.reshape(1)
        groups.setdefault((container, role), {}).setdefault(int(e), {})[proj] = (st.dtype(n), data)
    st.close()
    for (container, role), experts in groups.items():
        suffix = role[len("weight"):] if role.startswith("weight") else "_" + role
        dtype = experts[0]["gate"][0]
        gate_up = [np.concatenate([experts[e]["gate"][1], experts[e]["up"][1]]) for e in sorted(experts)]
        down = [experts[e]["down"][1] for e in sorted(experts)]
        out[f"{container}.gate_up_proj{suffix}"] = (dtype, np.stack(gate_up))
        out[f"{container}.down_proj{suffix}"] = (dtype, np.stack(down))
    write_safetensors(path, out)


def fp8_experts(src: Path, exporter: str) -> None:
    """Turn a BF16 per-expert checkpoint's experts into FP8: compressed-tensors per
    channel with BF16 [N, 1] scales, or ModelOpt MIXED_PRECISION per tensor."""
    path = src / "model.safetensors"
    st = SafetensorsFile(path)
    out, containers = {}, set()
    for n in st.names():
        m = EXPERT.match(n)
        if m is None:
            out[n] = (st.dtype(n), np.array(st.read(n)))
            continue
        containers.add(m.group(1))
        codes, scale = formats.quantize_fp8(formats.bf16_bits_to_f32(st.read(n)), per_channel=exporter == "ct")
        out[n] = ("F8_E4M3", codes)
        scale_name = n.rsplit(".", 1)[0] + ".weight_scale"
        out[scale_name] = ("BF16", formats.f32_to_bf16_bits(scale)) if exporter == "ct" else ("F32", scale)
    st.close()
    write_safetensors(path, out)
    cfg = json.loads((src / "config.json").read_text())
    if exporter == "ct":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": [],
            "config_groups": {"group_0": {"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                                          "weights": weights, "format": "float-quantized"}}}
    else:
        block = {"quant_algo": "MIXED_PRECISION", "quantized_layers": {c: {"quant_algo": "FP8"} for c in sorted(containers)}}
        (src / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": block}))
        cfg["quantization_config"] = {"quant_method": "modelopt", **block}
    (src / "config.json").write_text(json.dumps(cfg))


def expert_sources(synth_dir, tmp_path: Path, fmt: str) -> tuple[Path, Path]:
    """(per-expert, fused) checkpoints holding the same quantized experts."""
    if fmt.endswith("fp8"):
        per = copy_checkpoint(synth_dir("target", "bf16", expert_layout="per-expert", shards=1), tmp_path / "per")
        fp8_experts(per, fmt.split("-")[0])
    else:
        per = copy_checkpoint(synth_dir("target", fmt, shards=1), tmp_path / "per")
    fused = copy_checkpoint(per, tmp_path / "fused")
    fuse_experts(fused)
    return per, fused


FUSED_FORMATS = ["compressed-tensors", "modelopt-nvfp4", "ct-fp8", "modelopt-fp8"]


@pytest.mark.parametrize("fmt", FUSED_FORMATS)
def test_fused_quantized_experts_pack_like_per_expert_ones(synth_dir, tmp_path, monkeypatch, fmt):
    per, fused = expert_sources(synth_dir, tmp_path, fmt)
    a, b = open_checkpoint(str(per)), open_checkpoint(str(fused))
    group = "model.language_model.layers.0.mlp.experts"
    assert not b.has_module(f"{group}.0.gate_proj") and b.has_fused_experts(f"{group}.gate_up_proj")
    for e in (0, 5):  # reading: the same values as the per-expert modules
        want = np.concatenate([a.dequantize(f"{group}.{e}.gate_proj"), a.dequantize(f"{group}.{e}.up_proj")])
        np.testing.assert_array_equal(b.dequantize(f"{group}.gate_up_proj", e), want)
        np.testing.assert_array_equal(b.dequantize(f"{group}.down_proj", e), a.dequantize(f"{group}.{e}.down_proj"))

    def forbidden(*args, **kw):
        raise AssertionError("quantizer called while packing an already-quantized source")

    monkeypatch.setattr(formats, "quantize_nvfp4", forbidden)
    pack_per, pack_fused = build_pack(per, tmp_path / "pp"), build_pack(fused, tmp_path / "pf")
    mp, mf_ = read_manifest(pack_per), read_manifest(pack_fused)
    assert mp["pack_sha256"] == mf_["pack_sha256"]  # byte-identical tensors
    precision = "fp8" if fmt.endswith("fp8") else "nvfp4"
    for name in ("model.layers.0.mlp.experts.gate_up", "model.layers.0.mlp.experts.down"):
        assert mf_["entries"][name]["precision"] == precision and mf_["entries"][name]["stacked_source"]
    vp, vf = (json.loads((p / "validation.json").read_text())["round_trip"] for p in (pack_per, pack_fused))
    assert vf == vp and vf["quantized_parts_byte_identical"] > 16
    skipped = json.loads((pack_fused / "conversion.json").read_text())["skipped"]
    assert all("activation" in why for t, why in skipped.items() if t.startswith("model.") and ".experts." in t)
    rebuilt = build_pack(unpack_pack(pack_fused, tmp_path / "u"), tmp_path / "p2")
    assert read_manifest(rebuilt)["pack_sha256"] == mp["pack_sha256"]


def test_fused_expert_scale_of_the_wrong_shape_is_named(synth_dir, tmp_path):
    _, fused = expert_sources(synth_dir, tmp_path, "compressed-tensors")
    path = fused / "model.safetensors"
    st = SafetensorsFile(path)
    tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
    st.close()
    victim = "model.language_model.layers.3.mlp.experts.down_proj_scale"
    tensors[victim] = ("F8_E4M3", tensors[victim][1][:, :, :-1].copy())
    write_safetensors(path, tensors)
    assert_cli_error(run_cli("build", fused, "--out", tmp_path / "o"), victim, "expected")


# ------------------------------------------------------------------ unsloth's FP8 per-channel groups
UNSLOTH_FP8 = re.compile(r".*(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|self_attn\.(q|k|v|o)_proj)$|^lm_head$")


def unsloth_fp8_map(synth_dir, dest: Path) -> Path:
    """The unsloth 27B map: FP8 per channel with BF16 [N, 1] weight scales for the GDN
    and attention projections and lm_head, NVFP4 MLPs (with input_global_scale), BF16
    self_attn.k_scale / v_scale, no ignore entry for mtp.*."""
    src = copy_checkpoint(synth_dir("target", "compressed-tensors-mixed", shards=1), dest)
    ckpt = open_checkpoint(str(src))
    st = SafetensorsFile(src / "model.safetensors")
    out = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
    st.close()
    for module in ckpt.module_names():
        if UNSLOTH_FP8.match(module) and not module.startswith("mtp."):
            w = ckpt.dequantize(module)
            for suffix in ("weight", "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
                out.pop(f"{module}.{suffix}", None)
            codes, scale = formats.quantize_fp8(w, per_channel=True)
            out[module + ".weight"] = ("F8_E4M3", codes)
            out[module + ".weight_scale"] = ("BF16", formats.f32_to_bf16_bits(scale))
            if module.endswith(("self_attn.k_proj", "self_attn.v_proj")):
                out[module.rsplit("_", 1)[0] + "_scale"] = ("BF16", formats.f32_to_bf16_bits(np.array(0.05, np.float32)))
        elif ckpt.has(module + ".weight_packed"):  # static NVFP4 activations: a calibrated input scale
            out[module + ".input_global_scale"] = ("F32", np.array([448.0 * 6 / 3.5], np.float32))
    write_safetensors(src / "model.safetensors", out)
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg["quantization_config"]
    nvfp4 = qc["config_groups"]["group_0"]
    nvfp4["targets"] = [r"re:.*mlp\.(gate|up|down)_proj$"]
    nvfp4["input_activations"]["dynamic"] = False
    fp8 = {"format": "float-quantized", "targets": [r"re:.*linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$",
                                                    r"re:.*self_attn\.(q|k|v|o)_proj$", "lm_head"],
           "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
                       "group_size": None, "observer": "minmax", "actorder": None, "block_structure": None,
                       "observer_kwargs": {}},
           "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
    qc["config_groups"] = {"group_0": fp8, "group_1": nvfp4}
    qc["ignore"] = [e for e in qc["ignore"] if "mtp" not in e and e != "lm_head"]
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_unsloth_fp8_channel_map_packs_exactly(synth_dir, tmp_path):
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    src = unsloth_fp8_map(synth_dir, tmp_path / "src")
    ckpt = open_checkpoint(str(src))
    pack = build_pack(src, tmp_path / "p")
    manifest = read_manifest(pack)
    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
    checked = 0
    for name, entry in manifest["entries"].items():
        if entry["precision"] != "fp8":
            continue
        words, ts = pack_tensor(pack, name + ".weight"), pack_tensor(pack, name + ".tensor_scale")
        codes = formats.words_to_bytes(words)
        for part in entry["parts"]:
            a, b = part["rows"]
            spec = ckpt.module(part["source"])
            assert ckpt.dtype(spec.tensors["weight_scale"]) == "BF16" and ckpt.shape(spec.tensors["weight_scale"])[1] == 1
            source_codes = ckpt.read(spec.tensors["weight"])
            assert codes[a:b].tobytes() == source_codes.tobytes(), part["source"]
            reference = dequantize(  # compressed-tensors' own FP8 dequantization, in float32
                x_q=torch.from_numpy(np.array(source_codes)).view(torch.float8_e4m3fn),
                scale=torch.from_numpy(ckpt.read_float(spec.tensors["weight_scale"])), args=args,
                dtype=torch.float32).numpy()
            ours = formats.e4m3_decode(codes[a:b]) * ts[a:b, None]
            np.testing.assert_array_equal(ours, reference, err_msg=part["source"])
            checked += 1
    assert checked >= 10 and "lm_head" in manifest["entries"] and manifest["entries"]["lm_head"]["precision"] == "fp8"
    skipped = json.loads((pack / "conversion.json").read_text())["skipped"]
    kv = [t for t in skipped if t.endswith(("self_attn.k_scale", "self_attn.v_scale"))]
    assert kv and all("KV-cache" in skipped[t] for t in kv)
    assert any(t.endswith("input_global_scale") for t in skipped)
