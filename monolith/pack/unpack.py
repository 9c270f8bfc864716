"""unpack_pack: a pack back to a ModelOpt-style checkpoint.

Quantized tensors come back byte-identical to the source's (codes, E4M3 scales, F32
tensor scales; compressed-tensors sources come back in ModelOpt naming with
weight_scale_2 = 1 / weight_global_scale; quantized experts stored fused in the source
come back per expert, `experts.{e}.{gate,up,down}_proj`). Float tensors come back in
their source dtype, parameter transforms undone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from filelock import FileLock

from .. import formats
from ..formats.stfile import STORAGE_DTYPES, write_safetensors
from . import manifest as mf
from .recipe import PackError
from .validate import PackTensors
from .verify import verify_pack

SOURCE_DTYPES = {"bf16": "BF16", "f16": "F16", "f32": "F32"}


def _to_source_float(values: np.ndarray, precision: str) -> tuple[str, np.ndarray]:
    if precision == "bf16":
        return "BF16", formats.f32_to_bf16_bits(values)
    if precision == "f16":
        return "F16", values.astype(np.float16)
    return "F32", values.astype(np.float32)


def _expert_module(source: str, part: dict, halves: int, rows_per_expert: int) -> str:
    """Per-expert module name for one part of a stacked source tensor."""
    base = source.rsplit(".", 1)[0]  # ...mlp.experts
    if halves == 2:
        kind = "gate_proj" if part["rows"][0] < rows_per_expert // 2 else "up_proj"
    else:
        kind = "down_proj"
    return f"{base}.{part['expert']}.{kind}"


def _unpack_entry(reader: PackTensors, name: str, entry: dict, out: dict, quantized: dict) -> None:
    parts, precision = entry["parts"], entry["precision"]
    if entry["kind"] == "tensor":
        part = parts[0]
        data = reader.read(name)
        transform = entry.get("transform")
        if transform:
            values = data - np.float32(1.0) if transform == "one_plus_f32" else data
            out[part["source"]] = _to_source_float(values, entry["source_precision"])
        else:
            shape = entry.get("source_shape", data.shape)  # a tensor stored re-shaped goes back as it was
            out[part["source"]] = (reader.tensors[name]["dtype"], np.asarray(data).reshape(shape))
        return
    stacked = entry.get("stacked_source", False)
    if precision in SOURCE_DTYPES:
        weight = reader.read(name + ".weight")
        dtype = SOURCE_DTYPES[precision]
        if stacked:
            out[parts[0]["source"]] = (dtype, np.asarray(weight))
            if len({p["source"] for p in parts}) != 1:
                raise PackError(f"pack entry {name}: stacked entry with several sources")
            return
        for part in parts:
            sel = (part["expert"],) if "expert" in part else ()
            a, b = part["rows"]
            out[part["source"] + ".weight"] = (dtype, np.ascontiguousarray(weight[sel][a:b]))
        return
    words = reader.read(name + ".weight")
    scales = reader.read(name + ".scales")
    tscale = reader.read(name + ".tensor_scale")
    halves = 2 if parts[0]["source"].endswith("gate_up_proj") else 1
    for part in parts:
        sel = (part["expert"],) if "expert" in part else ()
        a, b = part["rows"]
        module = _expert_module(part["source"], part, halves, entry["shape"][-2]) if stacked else part["source"]
        codes = formats.words_to_bytes(words[sel][a:b])
        rows = np.asarray(tscale[sel][a:b], dtype=np.float32)
        if precision == "nvfp4":
            if np.any(rows != rows[0]):
                raise PackError(f"pack entry {name}: rows of {module} carry different tensor scales")
            out[module + ".weight"] = ("U8", np.ascontiguousarray(codes))
            out[module + ".weight_scale"] = ("F8_E4M3", np.ascontiguousarray(scales[sel][a:b]))
            out[module + ".weight_scale_2"] = ("F32", np.array(rows[0], dtype=np.float32))
            quantized[module] = "NVFP4"
        else:
            scale = np.array(rows[0], np.float32) if np.all(rows == rows[0]) else rows.reshape(-1, 1).copy()
            out[module + ".weight"] = ("F8_E4M3", np.ascontiguousarray(codes))
            out[module + ".weight_scale"] = ("F32", scale)
            quantized[module] = "FP8"


def _write_config(pack: Path, dest: Path, quantized: dict) -> None:
    config = json.loads((pack / "config.json").read_text()) if (pack / "config.json").is_file() else {}
    config.pop("quantization_config", None)
    if quantized:
        block = {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": None,
            "quantized_layers": {m: {"quant_algo": q, "group_size": 16} for m, q in sorted(quantized.items())},
        }
        config["quantization_config"] = {"quant_method": "modelopt", **block}
        mf.write_json(dest / "hf_quant_config.json", {"producer": {"name": "monolith", "version": "unpack"}, "quantization": block})
    mf.write_json(dest / "config.json", config)


def unpack_pack(pack_dir, out, force: bool = False) -> Path:
    """Write the checkpoint a pack was built from (ModelOpt-style) into `out`."""
    pack, out = Path(pack_dir), Path(out).absolute()
    verify_pack(pack)
    manifest = mf.read_manifest(pack)
    reader = PackTensors(pack, manifest)
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(mf.lock_path(out)):
        mf.remove_stale_temporaries(out)
        if out.exists() and not force:
            raise PackError(f"{out}: already exists (use --force to replace it)")
        tmp = mf.temporary_path(out)
        tmp.mkdir()
        try:
            by_shard: dict[str, list] = {}
            for name, entry in manifest["entries"].items():
                first = name if entry["kind"] == "tensor" else name + ".weight"
                by_shard.setdefault(manifest["tensors"][first]["shard"], []).append((name, entry))
            quantized: dict = {}
            weight_map: dict = {}
            shards = sorted(by_shard)
            for index, shard in enumerate(shards):
                tensors: dict = {}
                for name, entry in by_shard[shard]:
                    _unpack_entry(reader, name, entry, tensors, quantized)
                file = mf.shard_name(index, len(shards)) if len(shards) > 1 else "model.safetensors"
                for tname, (dtype, data) in tensors.items():
                    if np.dtype(STORAGE_DTYPES[dtype]) != data.dtype:
                        tensors[tname] = (dtype, data.view(STORAGE_DTYPES[dtype]))
                    weight_map[tname] = file
                write_safetensors(tmp / file, tensors, {"format": "pt"})
            if len(shards) > 1:
                mf.write_json(tmp / "model.safetensors.index.json", {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))})
            for name in mf.AUX_FILES:
                if name != "config.json" and (pack / name).is_file():
                    shutil.copyfile(pack / name, tmp / name)
            _write_config(pack, tmp, quantized)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out
