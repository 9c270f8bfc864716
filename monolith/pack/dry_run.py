"""dry_run: what `build` would do with a checkpoint, from its configs and safetensors
headers only (no tensor data is read, no file is hashed, nothing is written).

Every source tensor gets one action:
  keep       its bytes go into the pack unchanged
  re-lay out the same values in another arrangement: rows fused with other matrices,
             experts stacked, NVFP4 / FP8 bytes viewed as MLX words, scales per row
  convert    values computed exactly from the source: a norm stored as 1 + w in F32,
             a parameter widened to F32, FP8 dequantized to BF16
  quantize   a float matrix quantized to NVFP4 at pack time
  drop       not in the pack (vision tower with --no-vision, MTP head unless --with-mtp,
             activation / KV-cache scales)
with the reason the plan gives, the vision tower's policy (a line of its own), plus the
pack's size and every problem found (every
failing module is listed; a draft's config problem stops its plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..checkpoint import CheckpointError, open_checkpoint
from ..formats import FormatError
from ..formats.stfile import STORAGE_DTYPES, header_bytes
from .build import DEFAULT_SHARD_BYTES, plan_shards
from .convert import tensor_specs
from .plan import plan_pack
from .recipe import Entry, Plan

SHARD_METADATA = {"format": "pt"}  # what build.write_shard puts in every shard header


@dataclass
class Row:
    tensor: str  # source tensor
    action: str  # keep | re-lay out | convert | quantize | drop
    entry: str  # pack entry it goes into ("" when dropped)
    reason: str


@dataclass
class DryRun:
    source: str
    architecture: str = ""
    role: str = ""
    quant_format: str = ""
    quantization: str = ""
    rows: list[Row] = field(default_factory=list)
    payload_bytes: int = 0  # tensor data of the pack
    pack_bytes: int = 0  # shard files: headers + tensor data
    shards: int = 0
    problems: list[str] = field(default_factory=list)
    vision: str = ""  # what happens to the vision tower, and its precision policy


def entry_action(entry: Entry) -> str:
    if entry.kind == "tensor":
        same = entry.transform is None or (entry.transform == "f32" and entry.source_precision == "f32")
        return "keep" if same else "convert"
    if entry.precision == entry.source_precision:
        whole = (len(entry.parts) == 1 and entry.kind == "linear") or entry.stacked_source
        return "keep" if whole and entry.precision not in ("nvfp4", "fp8") else "re-lay out"
    return "quantize" if entry.precision == "nvfp4" else "convert"


def _source_tensors(ckpt, entry: Entry) -> list[str]:
    if entry.kind == "tensor":
        return [entry.parts[0].source]
    names: list[str] = []
    for source in dict.fromkeys(p.source for p in entry.parts):  # a module's bias is an entry of its own
        names += [t for role, t in ckpt.module(source).tensors.items() if role != "bias"]
    return names


def shard_bytes_of(plan: Plan, shard_bytes: int) -> tuple[int, int, int]:
    """(payload bytes, shard file bytes, shard count) of the pack `build` would write."""
    payload = files = 0
    shards = plan_shards(plan, shard_bytes)
    for entries in shards:
        specs = [spec for entry in entries for spec in tensor_specs(entry)]
        data = sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(STORAGE_DTYPES[dtype]).itemsize
                   for _, dtype, shape in specs)
        payload += data
        files += len(header_bytes(specs, SHARD_METADATA)) + data
    return payload, files, len(shards)


def dry_run(source, out=None, role: str | None = None, quantization: str = "auto", revision: str | None = None,
            local_files_only: bool = False, shard_bytes: int | None = None, force: bool = False,
            with_mtp: bool = False, with_vision: bool = True) -> DryRun:
    """What build_pack(source, out, ...) would do; problems are collected, not raised."""
    report = DryRun(str(source), quantization=quantization)
    try:
        ckpt = open_checkpoint(str(source), revision=revision, local_files_only=local_files_only)
    except (CheckpointError, FormatError, OSError) as e:
        report.problems.append(str(e))
        return report
    report.architecture, report.role, report.quant_format = ckpt.architecture, ckpt.role, ckpt.quant_format
    if role is not None and role != ckpt.role:
        report.problems.append(f"{ckpt.path}/config.json: --role {role} requested but the checkpoint is a "
                               f"{ckpt.role} ({ckpt.architecture})")
    if out is not None and Path(out).exists() and not force:
        report.problems.append(f"{Path(out).absolute()}: already exists (use --force to replace it)")
    try:
        plan = plan_pack(ckpt, quantization, report.problems, with_mtp, with_vision)
    except (CheckpointError, FormatError) as e:
        report.problems.append(str(e))
        return report
    for entry in plan.entries:
        action = entry_action(entry)
        for tensor in _source_tensors(ckpt, entry):
            report.rows.append(Row(tensor, action, entry.name, entry.reason))
    for tensor, why in plan.skipped.items():
        report.rows.append(Row(tensor, "drop", "", why))
    report.rows.sort(key=lambda r: r.tensor)
    report.vision = vision_line(plan.layout.get("vision"))
    report.payload_bytes, report.pack_bytes, report.shards = shard_bytes_of(plan, shard_bytes or DEFAULT_SHARD_BYTES)
    return report


def vision_line(vision: dict | None) -> str:
    """The tower's fate for people (layout.vision, target_recipe.py); "" without a tower."""
    if not vision:
        return ""
    if not vision.get("packed"):
        return f"tower {vision.get('reason', 'left out')}"
    return (f"tower packed: {vision['tensors']} tensors, {vision['precision']}, {vision['policy']}; "
            "--no-vision leaves it out")


def format_dry_run(report: DryRun) -> str:
    lines = [f"dry run     {report.source} (nothing read but configs and headers, nothing written)"]
    if report.architecture:
        lines.append(f"checkpoint  {report.architecture} ({report.role}), {report.quant_format}, "
                     f"quantization {report.quantization}")
    width = max((len(r.tensor) for r in report.rows), default=0)
    for r in report.rows:
        target = f" -> {r.entry}" if r.entry else ""
        lines.append(f"  {r.tensor:<{width}}  {r.action:<10}{target}  ({r.reason})")
    counts: dict[str, int] = {}
    for r in report.rows:
        counts[r.action] = counts.get(r.action, 0) + 1
    lines.append("tensors     " + (", ".join(f"{n} {a}" for a, n in sorted(counts.items())) or "none planned"))
    if report.vision:
        lines.append(f"vision      {report.vision}")
    incomplete = " (incomplete: the plan has problems)" if report.problems else ""
    lines.append(f"pack size   {report.pack_bytes} bytes in {report.shards} shard(s) "
                 f"({report.payload_bytes} bytes of tensor data){incomplete}")
    lines.append(f"problems    {len(report.problems)}")
    lines += [f"  problem: {p}" for p in report.problems]
    return "\n".join(lines)
