"""Turn one planned entry into the arrays the kernels read (stored bits, numpy).

NVFP4 sources are only re-viewed (U8 -> uint32 words, E4M3 bytes as they are);
FP8 sources stay 8-bit; float sources are quantized only when the plan says so.
"""

from __future__ import annotations

import numpy as np

from .. import formats
from ..checkpoint import Checkpoint
from .recipe import Entry

FLOAT_DTYPES = {"bf16": "BF16", "f16": "F16", "f32": "F32"}


def tensor_specs(entry: Entry) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every pack tensor of an entry, in data order."""
    if entry.kind == "tensor":
        dtype = "F32" if entry.transform else FLOAT_DTYPES.get(entry.precision, entry.precision.upper())
        return [(entry.name, dtype, entry.shape)]
    *lead, n, k = entry.shape
    lead = tuple(lead)
    if entry.precision == "nvfp4":
        return [
            (entry.name + ".weight", "U32", lead + (n, k // 8)),
            (entry.name + ".scales", "U8", lead + (n, k // formats.BLOCK)),
            (entry.name + ".tensor_scale", "F32", lead + (n,)),
        ]
    if entry.precision == "fp8":
        return [
            (entry.name + ".weight", "U32", lead + (n, k // 4)),
            (entry.name + ".scales", "U8", lead + (n, k // formats.mlx_layout.MXFP8_GROUP)),
            (entry.name + ".tensor_scale", "F32", lead + (n,)),
        ]
    return [(entry.name + ".weight", FLOAT_DTYPES[entry.precision], entry.shape)]


def entry_nbytes(entry: Entry) -> int:
    return sum(
        int(np.prod(shape, dtype=np.int64)) * np.dtype(formats.stfile.STORAGE_DTYPES[dtype]).itemsize
        for _, dtype, shape in tensor_specs(entry)
    )


def _selection(entry: Entry, part) -> tuple:
    """Checkpoint read arguments of a part: (expert, rows) of a stacked source, else none."""
    return (part.expert, (part.start, part.stop)) if entry.stacked_source else ()


def _source_float_bits(ckpt: Checkpoint, entry: Entry, part) -> np.ndarray:
    """Stored bits of a float part, unchanged (no rounding); FP8 that cannot stay
    8-bit comes back dequantized to BF16."""
    spec = ckpt.module(part.source)
    if spec.precision == "fp8":
        return formats.f32_to_bf16_bits(ckpt.dequantize(part.source, *_selection(entry, part)))
    bits = ckpt.read(spec.tensors["weight"])
    return np.asarray(bits[part.expert, part.start : part.stop] if entry.stacked_source else bits)


def _quantized_part(ckpt: Checkpoint, entry: Entry, part):
    """(codes-or-fp8 bytes U8 [n, ...], block scales U8, per-row F32 tensor scale [n])."""
    n = part.stop - part.start
    sel = _selection(entry, part)
    if entry.precision == "fp8":
        codes, scale = ckpt.read_fp8(part.source, *sel)
        rows = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (n,))
        k = codes.shape[-1]
        return np.asarray(codes), formats.mxfp8_unit_scales(n, k), rows
    if entry.source_precision == "nvfp4":
        q = ckpt.read_nvfp4(part.source, *sel)
    else:
        q = formats.quantize_nvfp4(ckpt.dequantize(part.source, *sel), name=part.source)
    return np.asarray(q.packed), np.asarray(q.scales), np.full((n,), q.tensor_scale, np.float32)


def convert_entry(ckpt: Checkpoint, entry: Entry) -> list[tuple[str, str, np.ndarray]]:
    """The pack tensors of one entry: [(name, dtype, stored bits)], in tensor_specs order."""
    specs = tensor_specs(entry)
    if entry.kind == "tensor":
        (name, dtype, _), part = specs[0], entry.parts[0]
        if entry.transform == "one_plus_f32":
            data = np.float32(1.0) + ckpt.read_float(part.source)
        elif entry.transform == "f32":
            data = ckpt.read_float(part.source)
        else:
            data = np.asarray(ckpt.read(part.source))
        return [(name, dtype, np.ascontiguousarray(data).reshape(entry.shape))]

    lead = entry.shape[:-2]
    if entry.precision in FLOAT_DTYPES:
        (name, dtype, shape), = specs
        if len(entry.parts) == 1 and not lead and entry.source_precision == entry.precision:
            return [(name, dtype, np.asarray(ckpt.read(ckpt.module(entry.parts[0].source).tensors["weight"])))]
        out = np.empty(shape, dtype=formats.stfile.STORAGE_DTYPES[dtype])
        for part in entry.parts:
            target = out[part.expert] if lead else out
            target[part.start : part.stop] = _source_float_bits(ckpt, entry, part)
        return [(name, dtype, out)]

    (wn, _, ws), (sn, _, ss), (tn, _, ts) = specs
    codes = np.empty(ws[:-1] + (ws[-1] * 4,), dtype=np.uint8)
    scales = np.empty(ss, dtype=np.uint8)
    tensor_scale = np.empty(ts, dtype=np.float32)
    for part in entry.parts:
        c, s, t = _quantized_part(ckpt, entry, part)
        sel = (part.expert,) if lead else ()
        codes[sel][part.start : part.stop] = c
        scales[sel][part.start : part.stop] = s
        tensor_scale[sel][part.start : part.stop] = t
    words = codes.view("<u4")
    return [(wn, "U32", words), (sn, "U8", scales), (tn, "F32", tensor_scale)]
