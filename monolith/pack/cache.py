"""The automatic pack cache: give it any model source, get a pack directory.

A cached pack is keyed by the source's identity (resolved path or hub snapshot, every
weight/config file's name, size and modification time) and the build options; when
the source changes the pack is rebuilt in place. Full SHA-256 hashes of the source
are in the pack's manifest; the key only has to notice change cheaply.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from filelock import FileLock

from ..checkpoint import resolve_checkpoint
from . import manifest as mf
from .build import build_pack
from .recipe import RECIPE_VERSION

CACHE_KEY_FILE = "cache_key"


def cache_root() -> Path:
    env = os.environ.get("MONOLITH_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "monolith"
    return base / "packs"


def source_key(path: Path, role: str | None, quantization: str) -> str:
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".jinja", ".txt"))
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    material = repr((str(path.resolve()), stats, role, quantization, RECIPE_VERSION, mf.PACK_FORMAT_VERSION))
    return hashlib.sha256(material.encode()).hexdigest()


def resolve_pack(
    source,
    role: str | None = None,
    quantization: str = "auto",
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: Path | None = None,
) -> Path:
    """A pack directory for `source`: the source itself if it is a pack, else a cached
    pack built (once) from the checkpoint."""
    if Path(str(source)).is_dir() and mf.is_pack(Path(str(source))):
        mf.read_manifest(Path(str(source)))
        return Path(str(source))
    path = resolve_checkpoint(str(source), revision=revision, local_files_only=local_files_only)
    key = source_key(path, role, quantization)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", str(source)).strip("_")[-80:] or "model"
    out = Path(cache_dir or cache_root()) / f"{slug}-{role or 'auto'}-{quantization}"
    stamp = out / CACHE_KEY_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(mf.lock_path(out, "cache")):  # check, build and stamp as one step
        if stamp.is_file() and stamp.read_text() == key and mf.is_pack(out):
            return out
        build_pack(path, out, role=role, quantization=quantization, force=True)
        stamp.write_text(key)
    return out
