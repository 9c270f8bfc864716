"""verify_pack: prove a pack's bytes are the ones its manifest names; ensure_verified:
that proof before a pack is used for running, remembered between starts.

verify_pack checks, naming the file and what differs: the manifest's pack_sha256
against its contents (manifest.pack_sha256: every field the runtime reads and every
copied file's hash), that the directory holds no file the manifest does not list
(besides the manifest and the build's reports), every shard (its header is the
canonical one for its tensors; each tensor's dtype, shape and SHA-256; the file's size
and SHA-256) and every copied file's SHA-256.

ensure_verified(pack, mode) runs it before a pack is loaded (--verify-pack):
- "first" (the default): before the first use, then again whenever a file of the pack
  changes. A success is recorded in the pack cache's state directory
  ($MONOLITH_CACHE/packs/.verified/), keyed by the pack's resolved path, with each
  file's size, mtime_ns, ctime_ns and inode: a file added, removed, written, touched
  (ctime: also when its mtime is set back) or replaced changes them. The record is not
  trusted: one that does not match the files, or cannot be read, means verify again.
  It lives outside the pack so the pack directory stays exactly the files the build
  wrote (reproducible bytes, no exception in the verifier), a read-only or shared pack
  works, and a copied pack (new inodes) is verified afresh.
- "always": at every start; a record is not trusted (once per process all the same).
- "never": not at all; logged as a warning.
The record is removed before verifying and written only after a success with no file
changed meanwhile: a failed verification leaves nothing that claims success.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..formats import FormatError, SafetensorsFile
from ..formats.stfile import header_bytes
from . import manifest as mf
from .recipe import PackError

VERIFY_MODES = ("always", "first", "never")
RECORD_FORMAT = "monolith-pack-verified/1"
SHARD_METADATA = {"format": "pt"}  # what build.write_shard puts in every shard's header
log = logging.getLogger("monolith.pack")
_hashed: dict[str, dict] = {}  # this process's verifications: resolved pack path -> file_stats
_unchecked: set[str] = set()  # packs this process was told not to verify (warned once each)


def _check_shard(pack: Path, shard: str, expected: dict, tensors: dict, whole_file: bool = True) -> None:
    """Tensor set, dtypes, shapes, the canonical header, the size, then per-tensor
    hashes; with `whole_file` also the shard's own SHA-256 (hashed on a second thread
    meanwhile)."""
    path = pack / shard
    try:
        st = SafetensorsFile(path)
    except FormatError as e:
        raise PackError(f"{path}: {e}") from None
    listed = sorted(n for n, t in tensors.items() if t["shard"] == shard)
    _check_header(st, listed, tensors)
    size, want = path.stat().st_size, expected.get("bytes") if isinstance(expected, dict) else None
    if size != want:
        raise PackError(f"{path}: {size} bytes, the manifest says {want}")
    with ThreadPoolExecutor(1) as pool:
        file_digest = pool.submit(mf.sha256_file, path) if whole_file else None
        for name in listed:
            digest = mf.sha256_bytes(memoryview(st.read(name, copy=True)).cast("B"))
            if digest != tensors[name]["sha256"]:
                raise PackError(f"{path}: tensor {name}: SHA-256 mismatch (contents changed)")
        if whole_file and file_digest.result() != expected.get("sha256"):
            raise PackError(f"{path}: SHA-256 mismatch (the shard's bytes are not the ones the manifest names)")


def _check_header(st: SafetensorsFile, listed: list[str], tensors: dict) -> None:
    """The shard holds exactly the listed tensors, with the manifest's dtypes and shapes,
    under the header the builder writes for them (header_bytes, in data order)."""
    path, present = st.path, set(st.names())
    for name in sorted(present - set(listed)):
        raise PackError(f"{path}: tensor {name} is not in the manifest (extra tensor)")
    for name in sorted(set(listed) - present):
        raise PackError(f"{path}: tensor {name} listed in the manifest is missing")
    for name in listed:
        t = tensors[name]
        if st.dtype(name) != t["dtype"] or list(st.shape(name)) != t["shape"]:
            raise PackError(
                f"{path}: tensor {name} is {st.dtype(name)}{list(st.shape(name))}, "
                f"manifest says {t['dtype']}{t['shape']}"
            )
    in_order = sorted(listed, key=st.offsets)
    canonical = header_bytes([(n, st.dtype(n), st.shape(n)) for n in in_order], SHARD_METADATA)
    with open(path, "rb") as f:
        head = f.read(st.header_size)
    if head != canonical or path.stat().st_size != st.header_size + sum(st.nbytes(n) for n in listed):
        raise PackError(f"{path}: the header is not the canonical one for its tensors "
                        "(edited, or the file holds bytes no tensor names)")


def _plain(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def verify_pack(pack_dir, whole_files: bool = True) -> dict:
    """Check the manifest's pack_sha256, the directory's files, every shard, tensor and
    copied file against manifest.json; raise PackError naming the first culprit.
    Returns a summary. `whole_files=False` skips the shard-level hashes (used right
    after a build, which hashed the shards as it wrote them)."""
    pack = Path(pack_dir)
    manifest = mf.read_manifest(pack)
    where = pack / mf.MANIFEST
    for field in ("tensors", "shards", "aux_files"):
        if not isinstance(manifest.get(field), dict):
            raise PackError(f"{where}: malformed manifest (no {field} object)")
    tensors, shards, aux = manifest["tensors"], manifest["shards"], manifest["aux_files"]
    try:
        digest = mf.pack_sha256(manifest)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise PackError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None
    if digest != manifest.get("pack_sha256"):
        raise PackError(f"{where}: pack_sha256 mismatch: the manifest's contents (architecture, role, layout, "
                        "entries, tensors, copied files' hashes) were changed after the build")
    for name in [*shards, *aux]:
        if not _plain(name) or name in (mf.MANIFEST, *mf.REPORTS):
            raise PackError(f"{where}: lists {name!r}, which cannot be a file of the pack")
    for name, t in tensors.items():  # dicts: pack_sha256 read their fields
        if not isinstance(t.get("shard"), str) or t["shard"] not in shards:
            raise PackError(f"{where}: tensor {name} names unknown shard {t.get('shard')!r}")
    listed = {mf.MANIFEST, *mf.REPORTS, *shards, *aux}
    for extra in sorted(p.name for p in pack.iterdir() if p.name not in listed):
        raise PackError(f"{pack / extra}: not listed in the manifest (a pack holds only the files its "
                        "manifest names; remove it)")
    for name in sorted([*shards, *aux]):
        if not (pack / name).is_file():
            raise PackError(f"{pack / name}: listed in the manifest but missing")
    for shard in sorted(shards):
        _check_shard(pack, shard, shards[shard], tensors, whole_files)
    for name, digest in sorted(aux.items()):
        if mf.sha256_file(pack / name) != digest:
            raise PackError(f"{pack / name}: SHA-256 mismatch")
    return {
        "pack_sha256": manifest["pack_sha256"],
        "tensors": len(tensors),
        "shards": len(shards),
        "bytes": sum(s["bytes"] for s in shards.values()),
    }


# ----------------------------------------------------------------------- before use


def file_stats(pack: Path) -> dict:
    """Every entry of the pack directory: name -> [size, mtime_ns, ctime_ns, inode]."""
    stats = {}
    for p in sorted(Path(pack).iterdir()):
        s = p.stat()
        stats[p.name] = [s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino]
    return stats


def record_path(pack_dir) -> Path:
    """Where the verification record of `pack_dir` is kept (whether or not it exists)."""
    resolved = Path(pack_dir).resolve()
    key = hashlib.sha256(str(resolved).encode()).hexdigest()[:24]
    return mf.cache_root() / ".verified" / f"{resolved.name}-{key}.json"


def is_recorded(pack: Path, stats: dict) -> bool:
    """Does a record say this pack, with exactly these files, was verified?"""
    try:
        record = json.loads(record_path(pack).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(record, dict) and record.get("format") == RECORD_FORMAT
            and record.get("pack") == str(pack.resolve()) and record.get("files") == stats)


def _record(pack: Path, stats: dict, summary: dict) -> None:
    path = record_path(pack)
    record = {"format": RECORD_FORMAT, "pack": str(pack.resolve()), "pack_sha256": summary["pack_sha256"],
              "files": stats}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: verified again at the next start
        log.info("%s: verified, but the record could not be written (%s)", pack, e)


def ensure_verified(pack_dir, mode: str = "first") -> None:
    """Verify `pack_dir` before it is used, as `mode` (--verify-pack) says: "first" when
    no record matches its files, "always" once per process, "never" not (a warning).
    Raises PackError naming the file and what differs."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"--verify-pack must be one of {', '.join(VERIFY_MODES)}, got {mode!r}")
    pack = Path(pack_dir)
    key = str(pack.resolve())
    if mode == "never":
        if key not in _unchecked:
            _unchecked.add(key)
            log.warning("%s: pack not checked (--verify-pack never): its files are used as they are", pack)
        return
    stats = file_stats(pack)
    if _hashed.get(key) == stats or (mode == "first" and is_recorded(pack, stats)):
        return
    _hashed.pop(key, None)
    try:
        record_path(pack).unlink(missing_ok=True)  # nothing claims success until it is proven
    except OSError:
        pass  # a read-only cache: a record there cannot match these files anyway
    started = time.perf_counter()
    summary = verify_pack(pack)
    after = file_stats(pack)
    if after != stats:
        changed = sorted(n for n in {*stats, *after} if stats.get(n) != after.get(n))
        raise PackError(f"{pack}: {', '.join(changed)} changed while the pack was being verified "
                        "(is a build or copy still writing it?)")
    _hashed[key] = stats
    _record(pack, stats, summary)
    log.info("verified the pack %s: %d tensors, %.1f MB in %.1f s", pack, summary["tensors"],
             summary["bytes"] / 2**20, time.perf_counter() - started)
