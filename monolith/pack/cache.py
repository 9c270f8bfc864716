"""The automatic pack cache: give it any model source, get a verified pack directory.

A cached pack is keyed by the source's identity (resolved path or hub snapshot, every
weight/config file's name, size and modification time) and the build options; when
the source changes the pack is rebuilt in place. Full SHA-256 hashes of the source
are in the pack's manifest; the key only has to notice change cheaply. The key is kept
beside the pack (`.NAME.cache_key`), as a pack directory holds only its own files.

A cached pack is derived data: one that fails verification (a changed byte, an
unlisted file, an older pack format) is logged, naming the file, and rebuilt from its
source. A pack directory given as the source is the user's: it is verified and
refused on any mismatch, never rebuilt.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from filelock import FileLock

from ..checkpoint import resolve_checkpoint
from . import manifest as mf
from .build import build_pack
from .catalog import cache_name, old_cache_name, record_use
from .manifest import cache_root
from .recipe import RECIPE_VERSION, PackError
from .verify import ensure_verified

log = logging.getLogger("monolith.pack")


def source_key(path: Path, role: str | None, quantization: str, with_mtp: bool = False) -> str:
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".jinja", ".txt"))
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    options = (role, quantization) + (("with_mtp",) if with_mtp else ())  # keys without it as before
    material = repr((str(path.resolve()), stats, *options, RECIPE_VERSION, mf.PACK_FORMAT_VERSION))
    return hashlib.sha256(material.encode()).hexdigest()


def resolve_pack(
    source,
    role: str | None = None,
    quantization: str = "auto",
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: Path | None = None,
    verify: str = "first",
    with_mtp: bool = False,
    alias: str | None = None,
) -> Path:
    """A pack directory for `source`: the source itself if it is a pack (verified as
    `verify` says, see verify.ensure_verified; PackError on a mismatch), else a cached
    pack built (once) from the checkpoint and verified, rebuilt when it fails. `with_mtp`:
    the target pack keeps its MTP head (its own cache entry, `....mtp`). `alias`: the name
    the model is served as (`monolith-demo`), which names the pack and finds it
    (catalog.py)."""
    if Path(str(source)).is_dir() and mf.is_pack(Path(str(source))):
        ensure_verified(Path(str(source)), verify)
        return Path(str(source))
    path = resolve_checkpoint(str(source), revision=revision, local_files_only=local_files_only)
    key = source_key(path, role, quantization, with_mtp)
    root = Path(cache_dir or cache_root())
    out = root / cache_name(source, path, role, quantization, with_mtp)
    stamp = out.parent / f".{out.name}.cache_key"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(mf.lock_path(out, "cache")):  # check, build and stamp as one step
        if not out.exists():
            _adopt_old(root / old_cache_name(source, role, quantization, with_mtp), out, key)
        if stamp.is_file() and stamp.read_text() == key and mf.is_pack(out):
            try:
                ensure_verified(out, verify)
                record_use(out, source, role, quantization, with_mtp, alias)
                return out
            except PackError as e:
                log.warning("the cached pack %s failed verification: %s; rebuilding it from %s", out, e, source)
        stamp.unlink(missing_ok=True)
        build_pack(path, out, role=role, quantization=quantization, force=True, with_mtp=with_mtp)
        stamp.write_text(key)
        record_use(out, source, role, quantization, with_mtp, alias)
    return out


def _adopt_old(old: Path, out: Path, key: str) -> None:
    """A pack cached under its former name (from the install path) for this very source
    and options: renamed to its name by what it is, with a log line; verified again under
    the new name at its first use."""
    old_stamp = old.parent / f".{old.name}.cache_key"
    if not (old_stamp.is_file() and old_stamp.read_text() == key and mf.is_pack(old)):
        return
    with FileLock(mf.lock_path(old, "cache")):
        old.rename(out)
        old_stamp.rename(out.parent / f".{out.name}.cache_key")
    log.info("renamed the cached pack %s to %s (packs are named by what they are)", old.name, out.name)
