"""monolith.checkpoint: finding checkpoints (local directories and hub ids). Nothing
touches the network: the hub tests use a fake local cache and a socket guard.
"""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import pytest
from checkpoint_builders import H, MODELOPT_EXCLUDES, V, modelopt_nvfp4_fmt, write_checkpoint

from monolith.checkpoint import CheckpointError, open_checkpoint, resolve_checkpoint

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
