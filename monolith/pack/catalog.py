"""The pack cache's packs by name: what each is, `pack list`, `pack rm`, and a served
model's name (`monolith-demo`, a hub id) taken wherever a pack directory is.

A cached pack is named by what it is: its source (the hub id, `org--name`; a local
checkpoint's directory name, with its parent's where that is only a role such as
`target`, and a short hash of the directory holding it, so that two checkouts never
share one), its role and its precision, plus `.mtp` when it
keeps the MTP head: `nvidia--Qwen3.6-35B-A3B-NVFP4.target.stored`,
`demo-draft-3fa2c1.draft.nvfp4`. Beside it, `.NAME.source.json` records the source, the
build options, the names it is served as (`monolith-demo`) and when it was last used."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from . import manifest as mf
from .recipe import PackError
from .verify import file_stats, is_recorded, record_path

SIDE_FILES = ("cache_key", "source.json", "cache.lock", "build.lock")  # beside each cached pack, hidden
ROLE_WORDS = ("target", "draft", "checkpoint", "model")  # a directory named so says nothing alone


def precision_word(role: str | None, quantization: str) -> str:
    """The precision a pack's name gives for its build options."""
    if quantization == "auto":
        return {"target": "stored", "draft": "nvfp4"}.get(role or "", "auto")
    return {"none": "unquantized"}.get(quantization, quantization)


def cache_name(source, path: Path, role: str | None, quantization: str, with_mtp: bool) -> str:
    """The cached pack's directory name for this source (`path`: the resolved checkpoint)
    and build options."""
    text = str(source)
    if Path(text).is_dir():  # a local checkpoint: its name, and where it is
        where = hashlib.sha256(str(path.resolve().parent).encode()).hexdigest()[:6]  # one per checkout
        name = path.resolve().name
        if name.lower() in ROLE_WORDS:
            name = f"{path.resolve().parent.name}-{name}"
        base = f"{name}-{where}"
    else:  # a hub id
        base = text.replace("/", "--")
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", base).strip("_.")[-80:] or "model"
    return f"{base}.{role or 'auto'}.{precision_word(role, quantization)}{'.mtp' if with_mtp else ''}"


def old_cache_name(source, role: str | None, quantization: str, with_mtp: bool) -> str:
    """The name caches used before packs were named by what they are (found and renamed)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", str(source)).strip("_")[-80:] or "model"
    return f"{slug}-{role or 'auto'}-{quantization}{'-mtp' if with_mtp else ''}"


def entry_path(pack: Path) -> Path:
    return pack.parent / f".{pack.name}.source.json"


def read_entry(pack: Path) -> dict:
    try:
        entry = json.loads(entry_path(pack).read_text())
    except (OSError, ValueError):
        return {}
    return entry if isinstance(entry, dict) else {}


def record_use(pack: Path, source, role: str | None, quantization: str, with_mtp: bool,
               alias: str | None = None) -> None:
    """Note in the pack's entry what it was built from and that it was used now."""
    entry = read_entry(pack)
    aliases = sorted(set(entry.get("aliases", [])) | ({alias} if alias else set()))
    entry.update(source=str(source), role=role, quantization=quantization, with_mtp=with_mtp, aliases=aliases,
                 last_used=time.time())
    tmp = pack.parent / f".{pack.name}.source.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(entry, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, entry_path(pack))
    except OSError:
        pass  # a read-only cache: the pack still serves, `pack list` knows less


def cached_packs(cache_dir: Path | None = None) -> list[Path]:
    root = Path(cache_dir or mf.cache_root())
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and mf.is_pack(p))


def describe(pack: Path) -> dict:
    """One row of `pack list`."""
    manifest, entry = mf.read_manifest(pack), read_entry(pack)
    used = entry.get("last_used") or pack.stat().st_mtime
    return {"name": pack.name, "source": entry.get("source", "?"), "role": manifest["role"],
            "aliases": entry.get("aliases", []),
            "bytes": sum(s["bytes"] for s in manifest["shards"].values()),
            "last_used": time.strftime("%Y-%m-%d %H:%M", time.localtime(used)),
            "verified": is_recorded(pack, file_stats(pack)), "path": str(pack)}


def format_list(rows: list[dict]) -> str:
    if not rows:
        return f"no cached packs in {mf.cache_root()}"
    table = [("NAME", "SOURCE", "ROLE", "SIZE", "LAST USED", "VERIFIED")] + [
        (r["name"], r["source"], r["role"], f"{r['bytes'] / 2**20:.1f} MiB", r["last_used"],
         "yes" if r["verified"] else "no") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join(lines + [f"({len(rows)} packs in {mf.cache_root()})"])


def matches(text: str, cache_dir: Path | None = None) -> list[Path]:
    """Cached packs named `text`: by directory name, else by a name they are served as or
    their source (a target before a draft, the most recently used first)."""
    packs = cached_packs(cache_dir)
    exact = [p for p in packs if p.name == text]
    if exact:
        return exact
    found = [p for p in packs if text in read_entry(p).get("aliases", []) or read_entry(p).get("source") == text]
    return sorted(found, key=lambda p: (mf.read_manifest(p)["role"] != "target", -read_entry(p).get("last_used", 0)))


def find_pack(text: str, cache_dir: Path | None = None) -> Path:
    """A pack directory: `text` itself, or the cached pack it names (PackError if none)."""
    if Path(text).exists():
        return Path(text)
    found = matches(text, cache_dir)
    if not found and (os.sep in text or text.startswith(".")):
        return Path(text)  # a path after all: the caller says it is missing
    if not found:
        raise PackError(f"{text}: no such pack directory, and no cached pack by that name (python -m monolith.pack "
                        "list shows them)")
    return found[0]


def cached_or_path(given: str | None) -> str | None:
    """serve's --pack / --draft-pack: a directory, or a cached pack's name (`pack list`;
    a served model's name such as monolith-demo) when no such directory exists."""
    if given is None or Path(given).exists():
        return given
    found = matches(given)
    return str(found[0]) if found else given


def remove(text: str, cache_dir: Path | None = None) -> list[str]:
    """Delete the cached packs `text` names (a name as `pack list` prints it, or a served
    name or source naming them all) with their records; the names removed."""
    found = matches(text, cache_dir)
    if not found:
        raise PackError(f"{text}: no cached pack by that name (python -m monolith.pack list shows them)")
    for pack in found:
        record_path(pack).unlink(missing_ok=True)
        shutil.rmtree(pack)
        for suffix in SIDE_FILES:  # the key, the entry, the locks
            (pack.parent / f".{pack.name}.{suffix}").unlink(missing_ok=True)
    return [p.name for p in found]
