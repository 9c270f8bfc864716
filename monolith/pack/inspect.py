"""inspect_pack: what a pack holds, for people (table) and tools (JSON)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..checkpoint.errors import CheckpointError
from . import manifest as mf
from .split import split_layers, target_costs, tensor_bytes
from .target_recipe import VISION_PREFIX


def inspect_pack(pack_dir, ranks: int | None = None) -> dict:
    """What the pack holds; with `ranks`, a target's split across that many pipeline
    ranks (`--distributed`): the bytes each rank holds."""
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
        "vision": vision_summary(manifest),
    } | ({} if ranks is None else {"ranks": rank_split(Path(pack_dir), manifest, ranks)})


def vision_summary(manifest: dict) -> dict | None:
    """The vision tower's share of the pack: packed (tensors, bytes) or left out; None
    when the source had no tower."""
    vision = (manifest.get("layout") or {}).get("vision")
    if vision is None:
        return None
    tensors = [t for name, t in manifest["tensors"].items() if name.startswith(VISION_PREFIX)]
    summary = {"packed": bool(vision.get("packed")), "tensors": len(tensors),
               "bytes": sum(tensor_bytes(t) for t in tensors)}
    return summary if summary["packed"] else summary | {"reason": vision["reason"]}


def rank_split(pack_dir: Path, manifest: dict, ranks: int) -> list[dict]:
    """Per rank: its layers and the bytes they (and on rank 0 the head: embedding, final
    norm, lm_head) hold, split by the cost a decode step reads (pack/split.py). At start
    `--distributed` times the stages and may move a layer; the draft (rank 0) is not counted."""
    if manifest["role"] != "target":
        raise CheckpointError(f"{pack_dir}: a {manifest['role']} pack is not split across ranks (only targets are)")
    costs = target_costs(pack_dir, manifest)
    try:
        split = split_layers(list(costs.layer_reads), ranks, costs.head_reads)
    except ValueError as e:
        raise CheckpointError(f"{pack_dir}: {e}") from None
    return [{"rank": r, "layers": [part.start, part.stop - 1],
             "bytes": sum(costs.layer_bytes[i] for i in part) + (costs.head_bytes if r == 0 else 0)}
            for r, part in enumerate(split)]


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
    vision = info.get("vision")
    if vision and vision["packed"]:
        lines.append(f"vision        {vision['bytes'] / 1e6:.1f} MB in {vision['tensors']} tensors "
                     f"({vision['bytes']} bytes; loaded on the first image)")
    elif vision:
        lines.append(f"vision        none: {vision['reason']}")
    for r in info.get("ranks", ()):
        first, last = r["layers"]
        lines.append(f"rank {r['rank']:<8d}layers {first}-{last}{' + head' if r['rank'] == 0 else ''}: "
                     f"{r['bytes'] / 1e6:.1f} MB")
    if info.get("ranks") and vision and vision["packed"]:
        lines.append("vision        on no rank: a pipeline (--distributed) serves text only")
    return "\n".join(lines)
