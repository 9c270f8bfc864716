"""Storage schemes (how one logical tensor becomes checkpoint tensors) and the shard
writer. A checkpoint is planned as a list of Units; each unit is encoded on its own,
shard by shard, so memory stays bounded by one shard."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from monolith.formats import (
    encode_fp8,
    quantize_compressed_nvfp4,
    quantize_fp8,
    quantize_nvfp4,
)
from monolith.formats.stfile import STORAGE_DTYPES, header_bytes

from .values import Param, as_bf16, bf16_bits

# scheme -> suffixes it writes for a linear module <m> (in this order)
SCHEMES = {
    "bf16": None,  # <param name> as BF16
    "nvfp4": ("weight", "weight_scale", "weight_scale_2", "input_scale"),  # ModelOpt NVFP4 (W4A4)
    "w4a16": ("weight", "weight_scale", "weight_scale_2"),  # ModelOpt W4A16_NVFP4
    "fp8": ("weight", "weight_scale", "input_scale"),  # ModelOpt per-tensor FP8
    "ct-nvfp4": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
    "ct-nvfp4-dynamic": ("weight_packed", "weight_scale", "weight_global_scale"),
    "ct-fp8-channel": ("weight", "weight_scale"),  # scale F32 [out, 1]
    "ct-fp8-channel-bf16": ("weight", "weight_scale"),  # scale BF16 [out, 1] (llm-compressor's default)
    "ct-fp8-tensor": ("weight", "weight_scale"),  # scale [1]
}
MAX_SHARD_BYTES = 256 * 1024 * 1024  # default shard counts grow to keep shards below this
ST_METADATA = {"format": "pt"}

Tensors = dict[str, tuple[str, np.ndarray]]


@dataclass(frozen=True)
class Unit:
    """Logical tensors encoded together. With several params and a quantized scheme they
    share one tensor scale (ModelOpt gives linears that read the same input, e.g. q/k/v
    or an expert's gate/up, one scale). `fused` stacks per-expert params of one layer
    into `<fused>.gate_up_proj [E, 2I, H]` and `<fused>.down_proj [E, H, I]`."""

    params: tuple[Param, ...]
    scheme: str = "bf16"
    fused: str | None = None


def stored_specs(unit: Unit) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor the unit writes, without computing values."""
    if unit.fused:
        n_exp = len(unit.params) // 3
        (inter, hidden) = unit.params[0].shape
        return [
            (f"{unit.fused}.gate_up_proj", "BF16", (n_exp, 2 * inter, hidden)),
            (f"{unit.fused}.down_proj", "BF16", (n_exp, hidden, inter)),
        ]
    specs = []
    for p in unit.params:
        if unit.scheme == "bf16":
            specs.append((p.name, "BF16", p.shape))
            continue
        m, (n, k) = p.module, p.shape
        packed = unit.scheme in ("nvfp4", "w4a16", "ct-nvfp4", "ct-nvfp4-dynamic")
        shapes = {
            "weight": ("U8", (n, k // 2)) if packed else ("F8_E4M3", (n, k)),
            "weight_packed": ("U8", (n, k // 2)),
            "weight_scale": ("F8_E4M3", (n, k // 16)) if packed else ("F32", ()),
            "weight_scale_2": ("F32", ()),
            "input_scale": ("F32", ()),
            "weight_global_scale": ("F32", (1,)),
            "input_global_scale": ("F32", (1,)),
        }
        if unit.scheme == "ct-fp8-channel":
            shapes["weight_scale"] = ("F32", (n, 1))
        elif unit.scheme == "ct-fp8-channel-bf16":
            shapes["weight_scale"] = ("BF16", (n, 1))
        elif unit.scheme == "ct-fp8-tensor":
            shapes["weight_scale"] = ("F32", (1,))
        for suffix in SCHEMES[unit.scheme]:
            specs.append((f"{m}.{suffix}", *shapes[suffix]))
    return specs


ITEMSIZE = {"BF16": 2, "U8": 1, "F8_E4M3": 1, "F32": 4, "I64": 8, "BOOL": 1}


def stored_bytes(unit: Unit) -> int:
    return sum(ITEMSIZE[d] * math.prod(s) for _, d, s in stored_specs(unit))


def _input_scale(first: np.ndarray, divisor: float) -> np.float32:
    """A plausible calibrated activation scale (amax / divisor), fixed by the unit's
    first weight matrix."""
    amax = 1.0 + float(np.abs(first).max()) * 8.0
    return np.float32(amax / divisor)


def encode(unit: Unit, values_of: Callable[[Param], np.ndarray]) -> Tensors:
    """Encode one unit into {name: (safetensors dtype, stored bits)}."""
    if unit.fused:  # filled expert by expert: memory stays at the output size
        (_, _, gate_up), (_, _, down) = stored_specs(unit)
        gate_up, down = np.empty(gate_up, dtype=np.uint16), np.empty(down, dtype=np.uint16)
        inter = unit.params[0].shape[0]
        for e in range(len(unit.params) // 3):
            gate_up[e, :inter] = bf16_bits(values_of(unit.params[3 * e]))
            gate_up[e, inter:] = bf16_bits(values_of(unit.params[3 * e + 1]))
            down[e] = bf16_bits(values_of(unit.params[3 * e + 2]))
        return {f"{unit.fused}.gate_up_proj": ("BF16", gate_up), f"{unit.fused}.down_proj": ("BF16", down)}
    if unit.scheme == "bf16":
        return {p.name: ("BF16", bf16_bits(values_of(p))) for p in unit.params}
    mats = [values_of(p) for p in unit.params]
    rows = np.cumsum([0] + [w.shape[0] for w in mats])
    out: Tensors = {}
    scheme = unit.scheme
    if scheme in ("nvfp4", "w4a16"):
        q = quantize_nvfp4(mats[0] if len(mats) == 1 else np.concatenate(mats), name=unit.params[0].module)
        for i, p in enumerate(unit.params):
            out[f"{p.module}.weight"] = ("U8", q.packed[rows[i] : rows[i + 1]])
            out[f"{p.module}.weight_scale"] = ("F8_E4M3", q.scales[rows[i] : rows[i + 1]])
            out[f"{p.module}.weight_scale_2"] = ("F32", np.array(q.tensor_scale, dtype=np.float32))
            if scheme == "nvfp4":
                out[f"{p.module}.input_scale"] = ("F32", np.array(_input_scale(mats[0], 6 * 448)))
    elif scheme == "fp8":
        codes, scale = quantize_fp8(mats[0] if len(mats) == 1 else np.concatenate(mats))
        for i, p in enumerate(unit.params):
            out[f"{p.module}.weight"] = ("F8_E4M3", codes[rows[i] : rows[i + 1]])
            out[f"{p.module}.weight_scale"] = ("F32", np.array(scale, dtype=np.float32).reshape(()))
            out[f"{p.module}.input_scale"] = ("F32", np.array(_input_scale(mats[0], 448)))
    else:  # compressed-tensors: one scale set per matrix (the unit holds one param)
        for p, w in zip(unit.params, mats, strict=True):
            if scheme.startswith("ct-nvfp4"):
                packed, scales, global_scale = quantize_compressed_nvfp4(w)
                out[f"{p.module}.weight_packed"] = ("U8", packed)
                out[f"{p.module}.weight_scale"] = ("F8_E4M3", scales)
                out[f"{p.module}.weight_global_scale"] = ("F32", global_scale)
                if scheme == "ct-nvfp4":
                    g = np.float32(1.0) / _input_scale(mats[0], 6 * 448)
                    out[f"{p.module}.input_global_scale"] = ("F32", np.array([g], dtype=np.float32))
            elif scheme == "ct-fp8-channel-bf16":  # the codes use the BF16-rounded scale
                _, scale = quantize_fp8(w, per_channel=True)
                scale = as_bf16(scale)
                out[f"{p.module}.weight"] = ("F8_E4M3", encode_fp8(w, scale))
                out[f"{p.module}.weight_scale"] = ("BF16", bf16_bits(scale.reshape(-1, 1)))
            else:
                codes, scale = quantize_fp8(w, per_channel=scheme == "ct-fp8-channel")
                scale = scale.reshape(-1, 1) if scheme == "ct-fp8-channel" else scale.reshape(1)
                out[f"{p.module}.weight"] = ("F8_E4M3", codes)
                out[f"{p.module}.weight_scale"] = ("F32", scale.astype(np.float32))
    return out


def plan_shards(units: list[Unit], shards: int) -> list[list[Unit]]:
    """Split units (in order) into at most `shards` contiguous groups of similar size."""
    sizes = [stored_bytes(u) for u in units]
    total = max(sum(sizes), 1)
    groups: dict[int, list[Unit]] = {}
    done = 0
    for unit, size in zip(units, sizes, strict=True):
        index = min(shards - 1, int((done + size / 2) * shards / total))
        groups.setdefault(index, []).append(unit)
        done += size
    return [groups[i] for i in sorted(groups)]


def default_shards(units: list[Unit], preferred: int) -> int:
    total = sum(stored_bytes(u) for u in units)
    return max(preferred, math.ceil(total / MAX_SHARD_BYTES))


def clear_checkpoint(out: Path) -> None:
    """Remove weight files a previous write may have left (another shard count)."""
    for stale in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        if stale.exists():
            stale.unlink()


def shard_names(n: int, naming: str = "of") -> list[str]:
    """File names of n shards: "of" is Hugging Face's `model-00001-of-00003.safetensors`
    (`model.safetensors` alone), "numbered" is `model-00001.safetensors` (even alone)."""
    if naming == "of":
        return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    if naming == "numbered":
        return [f"model-{i + 1:05d}.safetensors" for i in range(n)]
    raise ValueError(f"unknown shard naming {naming!r} (known: of, numbered)")


def write_checkpoint(
    out: Path,
    units: list[Unit],
    values_of: Callable[[Param], np.ndarray] | None,
    shards: int,
    extra: Tensors | None = None,
    naming: str = "of",
    separate: dict[str, list[Unit]] | None = None,
) -> None:
    """Write units as `model.safetensors` or shards named by `naming` (see shard_names),
    plus `model.safetensors.index.json` (when there are several files). `extra`
    tensors (already encoded) go to the last shard; `separate` maps more file names
    (such as `model_mtp.safetensors`) to their units, listed in the index too.
    values_of None writes a skeleton: each file gets its real header and is then
    extended to its real size with no data (sparse, zero bytes; no value is computed)."""
    clear_checkpoint(out)
    groups = plan_shards(units, max(1, shards)) if units else [[]]
    files = list(zip(shard_names(len(groups), naming), groups, strict=True))
    files += list((separate or {}).items())
    weight_map: dict[str, str] = {}
    total_size = 0
    for i, (fname, group) in enumerate(files):
        specs = [spec for unit in group for spec in stored_specs(unit)]
        if extra and i == len(groups) - 1:
            specs += [(name, dtype, array.shape) for name, (dtype, array) in extra.items()]
        for name, dtype, shape in specs:
            if name in weight_map:
                raise AssertionError(f"synth: tensor {name} written twice")
            weight_map[name] = fname
            total_size += math.prod(shape) * ITEMSIZE[dtype]
        _write_file(out / fname, group, values_of, extra if i == len(groups) - 1 else None)
    if len(files) > 1:
        data = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(out / "model.safetensors.index.json", data)


def _write_file(path: Path, group: list[Unit], values_of, extra: Tensors | None) -> None:
    """The file write_safetensors would write (data in name order), filled unit by unit
    at each tensor's offset, so memory stays bounded by one unit. With values_of None
    nothing is filled: a valid header, then a hole to the full size (a skeleton)."""
    specs = [spec for unit in group for spec in stored_specs(unit)]
    specs += [(name, dtype, array.shape) for name, (dtype, array) in (extra or {}).items()]
    header = header_bytes(sorted(specs), ST_METADATA)
    offsets, at = {}, len(header)
    for name, dtype, shape in sorted(specs):
        offsets[name] = at
        at += math.prod(shape) * ITEMSIZE[dtype]
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(at)
        for tensors in _encoded(group, values_of, extra) if values_of else ():
            for name, (dtype, array) in tensors.items():
                if np.dtype(STORAGE_DTYPES[dtype]) != array.dtype:
                    raise AssertionError(f"synth: tensor {name}: numpy {array.dtype} stored as {dtype}")
                f.seek(offsets[name])
                f.write(np.ascontiguousarray(array).tobytes())


def _encoded(group: list[Unit], values_of, extra: Tensors | None):
    for unit in group:
        encoded = encode(unit, values_of)
        expected = stored_specs(unit)
        got = [(name, encoded[name][0], encoded[name][1].shape) for name, _, _ in expected]
        if got != expected or len(encoded) != len(expected):
            raise AssertionError(f"synth: encoded tensors {got} differ from the plan {expected}")
        yield encoded
    if extra:
        yield extra


def write_json(path: Path, data) -> None:
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
