"""Packs: bad input is refused with an error naming the culprit, and leaves nothing behind."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from pack_helpers import assert_cli_error, copy_checkpoint, leftovers, run_cli

from monolith.formats import SafetensorsFile, write_safetensors
from monolith.pack import PackError, build_pack, resolve_pack, verify_pack


def test_truncated_shard_is_refused_and_leaves_no_pack(synth_dir, tmp_path):
    src = copy_checkpoint(synth_dir("target", "modelopt-nvfp4"), tmp_path / "src")
    shard = max(src.glob("*.safetensors"))
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
    from monolith.pack import build

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


# ------------------------------------------------------------------ temporaries of killed builds
HOLD_A_BUILD = """
import os, sys
from pathlib import Path
from filelock import FileLock
from monolith.pack.manifest import lock_path
out = Path(sys.argv[1])
with FileLock(lock_path(out)):  # what a running build holds while its temporary exists
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"half a shard")
    print("building", flush=True)
    sys.stdin.read()
"""

KILLABLE_BUILD = """
import sys
import monolith.pack.build as build
from monolith.pack.__main__ import main
real, calls = build.convert_entry, []
def convert(ckpt, entry):
    calls.append(entry)
    if len(calls) == 5:
        print("mid-build", flush=True)
        sys.stdin.read()  # stopped here until killed
    return real(ckpt, entry)
build.convert_entry = convert
sys.exit(main(sys.argv[1:]))
"""


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_build_removes_temporaries_no_running_build_owns(synth_dir, tmp_path, caplog):
    parent = tmp_path / "packs"
    parent.mkdir()
    dead = _dead_pid()
    stale = [f".out.tmp-{dead}", f".other.tmp-{os.getpid()}", f".other.old-{dead}", f".a.b-c.tmp-{dead}"]
    for name in stale:  # the second one's pid is alive (ours) but no build of "other" runs
        (parent / name).mkdir()
        (parent / name / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    (parent / ".notes.tmp-draft").mkdir()  # not a build's temporary: left alone
    (parent / f".file.tmp-{dead}").write_text("a file, not a build's directory")
    with caplog.at_level(logging.WARNING, logger="monolith.pack"):
        out = build_pack(synth_dir("target", "bf16"), parent / "out")
    assert sorted(leftovers(parent)) == [f".file.tmp-{dead}", ".notes.tmp-draft"]
    for name in stale:
        assert name in caplog.text, caplog.text
    assert verify_pack(out)


def test_a_temporary_of_a_running_build_is_kept(synth_dir, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_A_BUILD, str(cache / "other-auto-auto")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "building\n"
        live = f".other-auto-auto.tmp-{holder.pid}"
        pack = resolve_pack(synth_dir("target", "bf16"), cache_dir=cache)  # builds into the same cache
        assert (cache / live / "model.safetensors").read_bytes() == b"half a shard"
    finally:
        holder.stdin.close()
        holder.wait()
    assert (cache / live).is_dir()  # its builder is gone now: the next build removes it
    resolve_pack(synth_dir("target", "bf16"), quantization="none", cache_dir=cache)
    assert leftovers(cache) == []
    assert verify_pack(pack)


def test_a_build_killed_with_sigkill_is_cleaned_up_by_the_next(synth_dir, tmp_path):
    src, out = synth_dir("target", "modelopt-nvfp4"), tmp_path / "out"
    build = subprocess.Popen([sys.executable, "-c", KILLABLE_BUILD, "build", str(src), "--out", str(out)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert build.stdout.readline() == "mid-build\n"
        assert leftovers(tmp_path) == [f".out.tmp-{build.pid}"]
    finally:
        build.kill()  # SIGKILL: no handler runs, the temporary stays
        build.wait()
    assert build.returncode == -signal.SIGKILL
    assert leftovers(tmp_path) == [f".out.tmp-{build.pid}"] and not out.exists()
    result = run_cli("build", src, "--out", out)
    assert result.returncode == 0, result.stderr
    assert f".out.tmp-{build.pid}" in result.stderr  # what was removed is logged
    assert leftovers(tmp_path) == []
    assert run_cli("verify", out).returncode == 0
