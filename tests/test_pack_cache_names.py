"""The pack cache's packs named by what they are (pack/catalog.py): `pack list`, `pack rm`,
a served model's name in place of a pack directory, and a cache of the former names
found and renamed without a rebuild."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pack_helpers import copy_checkpoint

from monolith.pack import cache, resolve_pack
from monolith.pack.catalog import cache_name, cached_or_path, old_cache_name
from monolith.pack.demo import demo_pair
from monolith.pack.manifest import read_manifest


def pack_cli(*args, cache_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "monolith.pack", *args], capture_output=True, text=True,
                          env={**os.environ, "MONOLITH_CACHE": str(cache_dir)}, timeout=120, check=False)


def test_a_cached_pack_is_named_by_its_source_role_and_precision(synth_dir, tmp_path):
    assert cache_name("nvidia/Qwen3.6-35B-A3B-NVFP4", Path("/hub/snapshot"), "target", "auto", False) \
        == "nvidia--Qwen3.6-35B-A3B-NVFP4.target.stored"
    assert cache_name("org/Draft", Path("/hub/snapshot"), "draft", "auto", False) == "org--Draft.draft.nvfp4"
    src = copy_checkpoint(synth_dir("target", "modelopt-nvfp4"), tmp_path / "models" / "tiny-qwen")
    plain = resolve_pack(src, role="target", cache_dir=tmp_path / "cache")
    head = resolve_pack(src, role="target", quantization="none", cache_dir=tmp_path / "cache", with_mtp=True)
    assert plain.name.startswith("tiny-qwen-") and plain.name.endswith(".target.stored")
    assert head.name.startswith("tiny-qwen-") and head.name.endswith(".target.unquantized.mtp")
    entry = json.loads((plain.parent / f".{plain.name}.source.json").read_text())
    assert entry["source"] == str(src) and entry["role"] == "target" and entry["last_used"] > 0


def test_pack_list_inspect_by_served_name_and_rm(tmp_path, monkeypatch):
    monkeypatch.setenv("MONOLITH_CACHE", str(tmp_path))
    target, draft = demo_pair(with_mtp=True)
    listing = pack_cli("list", cache_dir=tmp_path)
    assert listing.returncode == 0, listing.stderr
    header, *rows, total = listing.stdout.splitlines()
    assert header.split() == ["NAME", "SOURCE", "ROLE", "SIZE", "LAST", "USED", "VERIFIED"]
    assert len(rows) == 2 and total == f"(2 packs in {tmp_path / 'packs'})"
    names = {row.split()[2]: row.split()[0] for row in rows}  # role -> name
    assert names["target"].startswith("demo-target-") and names["target"].endswith(".target.stored.mtp")
    assert names["draft"].startswith("demo-draft-") and names["draft"].endswith(".draft.nvfp4")
    assert {row.split()[1] for row in rows} == {str(target), str(draft)}
    [doc] = [d for d in json.loads(pack_cli("list", "--json", cache_dir=tmp_path).stdout) if d["role"] == "target"]
    assert doc["aliases"] == ["monolith-demo"] and doc["bytes"] > 0 and doc["verified"] in (True, False)

    inspected = pack_cli("inspect", "monolith-demo", "--json", cache_dir=tmp_path)  # the served name: the target
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["path"] == str(tmp_path / "packs" / names["target"])
    assert pack_cli("verify", names["draft"], cache_dir=tmp_path).stdout.startswith("ok: ")
    assert cached_or_path("monolith-demo") == str(tmp_path / "packs" / names["target"])  # serve's --pack
    missing = pack_cli("inspect", "no-such-model", cache_dir=tmp_path)
    assert missing.returncode == 1 and "no cached pack by that name" in missing.stderr

    removed = pack_cli("rm", names["draft"], cache_dir=tmp_path)
    assert removed.returncode == 0 and removed.stdout == f"removed {names['draft']}\n"
    left = sorted(p.name for p in (tmp_path / "packs").iterdir())
    assert not [n for n in left if names["draft"] in n]  # the pack and its hidden key, entry and locks
    assert names["target"] in left and f".{names['target']}.cache_key" in left


def test_a_pack_cached_under_its_former_name_is_renamed_not_rebuilt(synth_dir, tmp_path, monkeypatch, caplog):
    src = copy_checkpoint(synth_dir("target", "modelopt-nvfp4"), tmp_path / "src")
    root = tmp_path / "cache"
    built = resolve_pack(src, role="target", cache_dir=root)
    sha = read_manifest(built)["pack_sha256"]
    old = root / old_cache_name(src, "target", "auto", False)  # as an earlier version left it
    built.rename(old)
    (root / f".{built.name}.cache_key").rename(root / f".{old.name}.cache_key")
    monkeypatch.setattr(cache, "build_pack", lambda *a, **k: pytest.fail("rebuilt"))
    with caplog.at_level(logging.INFO, logger="monolith.pack"):
        found = resolve_pack(src, role="target", cache_dir=root)
    assert found == built and not old.exists() and read_manifest(found)["pack_sha256"] == sha
    assert f"renamed the cached pack {old.name} to {built.name}" in caplog.text
