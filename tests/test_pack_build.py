"""Packs: reproducible builds, verify, locking, inspect, unpack round trips, cache."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from filelock import FileLock
from pack_helpers import copy_checkpoint, run_cli

from monolith.checkpoint import CheckpointError, open_checkpoint
from monolith.cli import STDOUT_CLOSED
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
from monolith.pack.manifest import lock_path, tensor_inventory


def tensors_of(pack) -> dict:
    """Every tensor of a pack as dtype, shape and SHA-256."""
    return tensor_inventory(read_manifest(pack)["tensors"])


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
    shard = max(read_manifest(built)["shards"])
    (built / shard).unlink()
    with pytest.raises(PackError, match=f"{shard}.*missing"):
        verify_pack(built)
    assert run_cli("verify", built).returncode == 1


def test_verify_catches_an_extra_tensor(built):
    manifest = read_manifest(built)
    shard = min(manifest["shards"])
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



def test_inspect_into_a_reader_that_leaves_ends_quietly(built):
    """`pack inspect --json | head`: no "Broken pipe" error line, no traceback; the status
    is 141 (128 + SIGPIPE) when the output was cut short."""
    command = [sys.executable, "-m", "monolith.pack", "inspect", str(built), "--json"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before the first byte
    _, stderr = proc.communicate(timeout=120)
    assert (proc.returncode, stderr) == (STDOUT_CLOSED, b"") and STDOUT_CLOSED == 141
    whole = subprocess.run(command, capture_output=True, check=True).stdout
    head = subprocess.run(["bash", "-o", "pipefail", "-c", "\"$@\" | head -c 10", "bash", *command],
                          capture_output=True, check=False)
    assert head.stdout == whole[:10] and head.stderr == b"" and head.returncode in (0, STDOUT_CLOSED)


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
    rebuilt = build_pack(out, tmp_path / "p2")  # the same tensors (unpack writes its own config.json, so
    assert tensors_of(rebuilt) == tensors_of(pack)  # pack_sha256, which covers it, differs)
    assert run_cli("unpack", pack, "--out", tmp_path / "u2").returncode == 0


def test_unpack_of_a_bf16_source_restores_its_tensors(synth_dir, tmp_path):
    src = synth_dir("target", "bf16", expert_layout="fused")
    source = open_checkpoint(str(src))
    out = unpack_pack(build_pack(src, tmp_path / "p"), tmp_path / "u")
    unpacked = open_checkpoint(str(out))
    names = [n for n in source.tensor_names() if not n.startswith("mtp.")]  # the vision tower comes back too
    assert sorted(names) == unpacked.tensor_names()
    for name in names:
        assert source.read(name).tobytes() == unpacked.read(name).tobytes(), name


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
