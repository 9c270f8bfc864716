"""verify_pack: prove a pack's bytes are the ones its manifest names."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..formats import FormatError, SafetensorsFile
from . import manifest as mf
from .recipe import PackError


def _check_shard(pack: Path, shard: str, expected: dict, tensors: dict, whole_file: bool = True) -> None:
    """Tensor set, dtypes, shapes and per-tensor hashes; with `whole_file` also the
    shard's own SHA-256 (hashed on a second thread meanwhile)."""
    path = pack / shard
    with ThreadPoolExecutor(1) as pool:
        file_digest = pool.submit(mf.sha256_file, path) if whole_file and path.is_file() else None
        _check_tensors(path, shard, tensors)
        if whole_file and (path.stat().st_size != expected["bytes"] or file_digest.result() != expected["sha256"]):
            raise PackError(f"{path}: shard SHA-256 or size mismatch (header or padding changed)")


def _check_tensors(path: Path, shard: str, tensors: dict) -> None:
    if not path.is_file():
        raise PackError(f"{path}: shard listed in the manifest is missing")
    try:
        st = SafetensorsFile(path)
    except FormatError as e:
        raise PackError(f"{path}: {e}") from None
    listed = {n for n, t in tensors.items() if t["shard"] == shard}
    present = set(st.names())
    for name in sorted(present - listed):
        raise PackError(f"{path}: tensor {name} is not in the manifest (extra tensor)")
    for name in sorted(listed - present):
        raise PackError(f"{path}: tensor {name} listed in the manifest is missing")
    for name in sorted(listed):
        t = tensors[name]
        if st.dtype(name) != t["dtype"] or list(st.shape(name)) != t["shape"]:
            raise PackError(
                f"{path}: tensor {name} is {st.dtype(name)}{list(st.shape(name))}, "
                f"manifest says {t['dtype']}{t['shape']}"
            )
        digest = mf.sha256_bytes(memoryview(st.read(name, copy=True)).cast("B"))
        if digest != t["sha256"]:
            raise PackError(f"{path}: tensor {name}: SHA-256 mismatch (contents changed)")


def verify_pack(pack_dir, whole_files: bool = True) -> dict:
    """Check every shard, tensor and copied file against manifest.json; raise
    PackError naming the first culprit. Returns a summary. `whole_files=False` skips
    the shard-level hashes (used right after a build, which hashed the shards as it
    wrote them)."""
    pack = Path(pack_dir)
    manifest = mf.read_manifest(pack)
    tensors, shards = manifest.get("tensors", {}), manifest.get("shards", {})
    if mf.pack_sha256(tensors) != manifest.get("pack_sha256"):
        raise PackError(f"{pack / mf.MANIFEST}: pack_sha256 does not match the tensor inventory")
    for name, t in tensors.items():
        if t.get("shard") not in shards:
            raise PackError(f"{pack / mf.MANIFEST}: tensor {name} names unknown shard {t.get('shard')}")
    on_disk = {p.name for p in pack.glob("*.safetensors")}
    for extra in sorted(on_disk - set(shards)):
        raise PackError(f"{pack / extra}: shard not listed in the manifest")
    for shard in sorted(shards):
        _check_shard(pack, shard, shards[shard], tensors, whole_files)
    for name, digest in sorted(manifest.get("aux_files", {}).items()):
        path = pack / name
        if not path.is_file():
            raise PackError(f"{path}: file listed in the manifest is missing")
        if mf.sha256_file(path) != digest:
            raise PackError(f"{path}: SHA-256 mismatch")
    return {
        "pack_sha256": manifest["pack_sha256"],
        "tensors": len(tensors),
        "shards": len(shards),
        "bytes": sum(s["bytes"] for s in shards.values()),
    }
