"""build_pack: checkpoint -> chip-layout pack, streamed shard by shard, atomically.

The pack is written into a temporary directory beside the destination, validated,
then renamed into place, all under a file lock: a crash or an error leaves no
directory that looks like a pack. A build that was killed leaves its temporary; the next
build into the same directory removes it (manifest.remove_stale_temporaries).
"""

from __future__ import annotations

import hashlib
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from filelock import FileLock
from tqdm import tqdm

from .. import formats
from ..checkpoint import Checkpoint, open_checkpoint
from ..formats.stfile import header_bytes
from . import manifest as mf
from .convert import convert_entry, entry_nbytes, tensor_specs
from .plan import plan_pack
from .recipe import RECIPE_VERSION, PackError, Plan
from .validate import validate_pack

DEFAULT_SHARD_BYTES = 1 << 30


def quantizer_sha256() -> str:
    """Hash of the quantizer's source, recorded so a pack names the code that made it."""
    h = hashlib.sha256()
    root = Path(formats.__file__).parent
    for name in ("codecs.py", "nvfp4.py", "fp8.py", "compressed.py", "mlx_layout.py"):
        h.update((root / name).read_bytes())
    return h.hexdigest()


def plan_shards(plan: Plan, shard_bytes: int) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for entry in plan.entries:
        n = entry_nbytes(entry)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return shards


def write_shard(ckpt: Checkpoint, entries: list, path: Path, tensors: dict, shard: str, pool, progress) -> dict:
    """Stream one shard to disk: header first (sizes are known from the plan), then
    each entry converted and written in turn. Every tensor is hashed on a worker
    thread while this one writes it and feeds the file hash (hashing releases the GIL)."""
    specs = [spec for entry in entries for spec in tensor_specs(entry)]
    file_hash = hashlib.sha256()
    with open(path, "wb") as f:
        head = header_bytes(specs, {"format": "pt"})
        f.write(head)
        file_hash.update(head)
        size = len(head)
        for entry in entries:
            pending = []
            for (name, dtype, data), (_, _, shape) in zip(convert_entry(ckpt, entry), tensor_specs(entry)):
                if tuple(data.shape) != tuple(shape):
                    raise PackError(f"{ckpt.path}: pack entry {name} came out {data.shape}, planned {shape}")
                raw = memoryview(np.ascontiguousarray(data)).cast("B")
                pending.append((name, pool.submit(mf.sha256_bytes, raw)))
                f.write(raw)
                file_hash.update(raw)
                size += raw.nbytes
                tensors[name] = {"dtype": dtype, "shape": list(shape), "shard": shard}
            for name, digest in pending:
                tensors[name]["sha256"] = digest.result()
            ckpt.release()  # unmap the source: resident memory stays about one entry
            progress.update(entry_nbytes(entry))
    return {"bytes": size, "sha256": file_hash.hexdigest()}


def copy_aux_files(ckpt: Checkpoint, dest: Path) -> dict:
    copied = {}
    for name in mf.AUX_FILES:
        src = ckpt.path / name
        if src.is_file():
            shutil.copyfile(src, dest / name)
            copied[name] = mf.sha256_file(dest / name)
    return copied


def _manifest(ckpt: Checkpoint, plan: Plan, tensors: dict, shards: dict, aux: dict, sources: list) -> dict:
    return {
        "format": mf.PACK_FORMAT,
        "format_version": mf.PACK_FORMAT_VERSION,
        "recipe": {"name": plan.recipe, "version": RECIPE_VERSION},
        "architecture": plan.architecture,
        "role": plan.role,
        "quantization": plan.quantization,
        "layout": plan.layout,
        "entries": {e.name: e.describe() for e in plan.entries},
        "tensors": tensors,
        "shards": shards,
        "aux_files": aux,
        "source": {"format": ckpt.quant_format, "config_sha256": ckpt.config_sha256(), "files": sources},
    }


def _conversion(ckpt: Checkpoint, plan: Plan, source_label: dict, sources: list) -> dict:
    policy = {}
    for e in plan.entries:
        policy[e.name] = {"precision": e.precision, "source_precision": e.source_precision, "reason": e.reason}
    return {
        "source": source_label,
        "source_format": ckpt.quant_format,
        "source_files": sources,
        "quantization": plan.quantization,
        "policy": policy,
        "skipped": plan.skipped,
        "quantizer": {"name": "ModelOpt-exact NVFP4 (monolith.formats)", "source_sha256": quantizer_sha256()},
    }


def _check_role(ckpt: Checkpoint, role: str | None) -> None:
    if role is not None and role != ckpt.role:
        raise PackError(f"{ckpt.path}/config.json: --role {role} requested but the checkpoint is a {ckpt.role} "
                        f"({ckpt.architecture})")


def build_pack(
    source,
    out,
    role: str | None = None,
    quantization: str = "auto",
    revision: str | None = None,
    local_files_only: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    force: bool = False,
    extra_manifest: dict | None = None,
    with_mtp: bool = False,
    with_vision: bool = True,
) -> Path:
    """Build a pack at `out` from a checkpoint (local dir or hub id), keeping a target's MTP head
    with `with_mtp` and its vision tower unless `with_vision` is False (pack/target_recipe.py).
    Returns `out`."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(mf.lock_path(out)):
        mf.remove_stale_temporaries(out)  # what killed builds left in this directory
        if out.exists() and not force:
            raise PackError(f"{out}: already exists (use --force to replace it)")
        ckpt = open_checkpoint(str(source), revision=revision, local_files_only=local_files_only)
        _check_role(ckpt, role)
        plan = plan_pack(ckpt, quantization, with_mtp=with_mtp, with_vision=with_vision)
        tmp = mf.temporary_path(out)
        tmp.mkdir()
        try:
            layout = plan_shards(plan, shard_bytes)
            total = sum(entry_nbytes(e) for e in plan.entries)
            with ThreadPoolExecutor(2) as pool, tqdm(total=total, unit="B", unit_scale=True, desc=f"packing {out.name}",
                                                     disable=None, leave=False) as progress:
                source_hashes = pool.submit(ckpt.source_files)  # overlaps the conversion
                tensors: dict = {}
                shards: dict = {}
                for index, entries in enumerate(layout):
                    name = mf.shard_name(index, len(layout))
                    shards[name] = write_shard(ckpt, entries, tmp / name, tensors, name, pool, progress)
                sources = source_hashes.result()
            aux = copy_aux_files(ckpt, tmp)
            label = {"path": str(ckpt.path)} if Path(str(source)).is_dir() else {"repo": str(source), "revision": revision}
            manifest = _manifest(ckpt, plan, tensors, shards, aux, sources)
            if extra_manifest:
                manifest.update(extra_manifest)
            manifest["pack_sha256"] = mf.pack_sha256(manifest)
            mf.write_json(tmp / mf.MANIFEST, manifest)
            mf.write_json(tmp / mf.CONVERSION, _conversion(ckpt, plan, label, sources))
            mf.write_json(tmp / mf.VALIDATION, validate_pack(tmp, ckpt, plan))
            if out.exists():
                old = mf.temporary_path(out, "old")
                out.rename(old)
                tmp.rename(out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out
