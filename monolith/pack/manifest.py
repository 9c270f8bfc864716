"""Pack files, hashing and the canonical JSON that makes builds reproducible."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

from filelock import FileLock, Timeout

PACK_FORMAT = "monolith-pack"
# 2: pack_sha256 covers the whole manifest (and so every copied file), not only the tensors
PACK_FORMAT_VERSION = 2
MANIFEST = "manifest.json"
CONVERSION = "conversion.json"
VALIDATION = "validation.json"
# the build's reports beside the manifest: never read at run time, the only files a pack
# holds that its manifest does not list (validation.json is written after the manifest)
REPORTS = (CONVERSION, VALIDATION)
# manifest fields outside pack_sha256: the hash itself and the split into shards (so the
# hash does not depend on the shard size; verify.py checks each shard's header is the
# canonical one for its tensors, so the shards' bytes follow from what is covered)
NOT_HASHED = ("pack_sha256", "shards")
# Files copied from the source next to the shards (the runtime needs config and tokenizer,
# and for images the processor's settings, models/image_inputs.py read_image_settings).
AUX_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
CHUNK = 8 << 20
TEMPORARY = re.compile(r"\.(.+)\.(?:tmp|old)-\d+")  # temporary_path's names

log = logging.getLogger("monolith.pack")


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, sort_keys=True, indent=1) + "\n")


def sha256_bytes(data) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tensor_inventory(tensors: dict) -> dict:
    """Every tensor's dtype, shape and content hash (its entry in pack_sha256)."""
    return {name: {k: t[k] for k in ("dtype", "shape", "sha256")} for name, t in sorted(tensors.items())}


def pack_sha256(manifest: dict) -> str:
    """The pack's identity: the SHA-256 of the canonical manifest without NOT_HASHED,
    every tensor as its inventory entry. It covers everything the runtime reads: the
    architecture, role, quantization, layout, entries and tensors, and through
    `aux_files` the bytes of config.json, generation_config.json, the tokenizer files,
    the chat template and the image processor's configs."""
    covered = {k: v for k, v in manifest.items() if k not in NOT_HASHED}
    covered["tensors"] = tensor_inventory(manifest.get("tensors", {}))
    return sha256_bytes(canonical_json(covered))


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def read_manifest(pack_dir: Path) -> dict:
    from .recipe import PackError

    path = Path(pack_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise PackError(f"{path}: not a monolith pack (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PackError(f"{path}: corrupt manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != PACK_FORMAT:
        raise PackError(f"{path}: not a monolith pack manifest")
    if manifest.get("format_version") != PACK_FORMAT_VERSION:
        raise PackError(
            f"{path}: pack format version {manifest.get('format_version')} is not supported "
            f"(this monolith reads version {PACK_FORMAT_VERSION}); rebuild the pack: "
            f"python -m monolith.pack build SOURCE --out {Path(pack_dir)} --force "
            "(packs in the pack cache are rebuilt by themselves)"
        )
    return manifest


def cache_root() -> Path:
    """Where the pack cache keeps its packs and state ($MONOLITH_CACHE/packs)."""
    env = os.environ.get("MONOLITH_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "monolith"
    return base / "packs"


def lock_path(out: Path, purpose: str = "build") -> str:
    """A hidden lock file beside `out` (left in place after use, as lock files must be)."""
    out = Path(out)
    return str(out.parent / f".{out.name}.{purpose}.lock")


def temporary_path(out: Path, kind: str = "tmp") -> Path:
    """A hidden directory beside `out`: where a build writes ("tmp"), or where it parks the
    pack it replaces ("old"). Named by the builder's pid, which says who made it."""
    out = Path(out)
    return out.parent / f".{out.name}.{kind}-{os.getpid()}"


def remove_stale_temporaries(out: Path) -> None:
    """Remove the temporaries in `out`'s directory that no running build or unpack owns;
    call it holding `out`'s build lock.

    Temporaries exist only while their builder holds the build lock of their output (it
    makes them after taking the lock and renames or removes them before letting go). That
    lock is an flock, which the kernel drops when its holder dies, kill -9 included. So a
    temporary is stale exactly when its output's lock is free or ours, whatever the pid in
    its name: pids are reused, so a live pid proves nothing, and a lock held by another
    process (a build running now) keeps its temporaries."""
    out = Path(out)
    for path in sorted(out.parent.iterdir()):
        match = TEMPORARY.fullmatch(path.name)
        if not match or path.is_symlink() or not path.is_dir():
            continue
        if match[1] == out.name:
            _remove_stale(path)
            continue
        try:
            with FileLock(lock_path(out.parent / match[1]), timeout=0):
                _remove_stale(path)
        except Timeout:  # that output is being built now
            continue


def _remove_stale(path: Path) -> None:
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        log.warning("could not remove %s, a temporary of a build that is no longer running", path)
    else:
        log.warning("removed %s (%.1f MB), a temporary of a build that is no longer running", path, size / 1e6)


def is_pack(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()
