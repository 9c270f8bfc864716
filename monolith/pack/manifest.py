"""Pack files, hashing and the canonical JSON that makes builds reproducible."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

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
# Files copied from the source next to the shards (the runtime needs config and tokenizer).
AUX_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
CHUNK = 8 << 20


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
    `aux_files` the bytes of config.json, generation_config.json, the tokenizer files
    and the chat template."""
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


def is_pack(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()
