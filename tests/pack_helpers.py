"""Shared by tests/test_pack_*.py: the pack CLI, reading one pack tensor, copying a
synthetic checkpoint to break it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from monolith.formats import SafetensorsFile
from monolith.pack import read_manifest

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


def assert_cli_error(result, *needles):
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
