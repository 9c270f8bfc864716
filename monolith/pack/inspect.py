"""inspect_pack: what a pack holds, for people (table) and tools (JSON)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from . import manifest as mf


def inspect_pack(pack_dir) -> dict:
    manifest = mf.read_manifest(Path(pack_dir))
    entries = manifest["entries"]
    precisions = Counter(e["precision"] for e in entries.values())
    return {
        "path": str(Path(pack_dir).absolute()),
        "architecture": manifest["architecture"],
        "role": manifest["role"],
        "quantization": manifest["quantization"],
        "recipe": manifest["recipe"],
        "pack_sha256": manifest["pack_sha256"],
        "source_format": manifest["source"]["format"],
        "bytes": sum(s["bytes"] for s in manifest["shards"].values()),
        "shards": len(manifest["shards"]),
        "tensors": len(manifest["tensors"]),
        "entries": len(entries),
        "entries_by_precision": dict(sorted(precisions.items())),
        "layout": manifest["layout"],
    }


def format_inspection(info: dict) -> str:
    lines = [
        f"pack          {info['path']}",
        f"architecture  {info['architecture']} ({info['role']})",
        f"source        {info['source_format']}, quantization {info['quantization']}",
        f"recipe        {info['recipe']['name']} v{info['recipe']['version']}",
        f"size          {info['bytes'] / 1e6:.1f} MB in {info['shards']} shard(s), {info['tensors']} tensors",
        f"pack_sha256   {info['pack_sha256']}",
        "entries       " + ", ".join(f"{n} {p}" for p, n in info["entries_by_precision"].items()),
    ]
    return "\n".join(lines)
