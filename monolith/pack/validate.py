"""Build-time validation, recorded in validation.json: the pack is read back and
hashed, NVFP4/FP8 sources round-trip byte for byte, and a few linears are multiplied
through MLX's quantized kernels and compared with the source's dequantized matmul."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import formats
from ..checkpoint import Checkpoint
from ..formats import SafetensorsFile
from . import manifest as mf
from .recipe import PackError, Plan
from .verify import verify_pack

SPOT_CHECKS_PER_PRECISION = 3
SPOT_TOLERANCE = 1e-4  # relative to the output's scale, F32 compute
SPOT_ROWS = 64


class PackTensors:
    """Read pack tensors by name across shards (stored bits)."""

    def __init__(self, pack: Path, manifest: dict):
        self.tensors = manifest["tensors"]
        self.files = {s: SafetensorsFile(pack / s) for s in manifest["shards"]}

    def read(self, name: str, rows: int | None = None) -> np.ndarray:
        """A private copy (plain file reads: validating a large pack maps nothing), or
        of the first `rows` rows only."""
        st = self.files[self.tensors[name]["shard"]]
        if rows is None:
            return st.read(name, copy=True)
        data = np.array(st.read(name)[:rows])
        st.close()  # unmap: the pages read stop counting as resident
        return data


def _round_trip(ckpt: Checkpoint, plan: Plan, reader: PackTensors) -> dict:
    checked = 0
    for entry in plan.entries:
        if entry.source_precision not in ("nvfp4", "fp8") or entry.precision != entry.source_precision:
            continue
        words, scales, tscale = (reader.read(entry.name + s) for s in (".weight", ".scales", ".tensor_scale"))
        for part in entry.parts:
            sel = (part.expert,) if entry.kind == "experts" else ()
            rows = slice(part.start, part.stop)
            codes, ts = formats.words_to_bytes(words[sel][rows]), tscale[sel][rows]
            source = (part.expert, (part.start, part.stop)) if entry.stacked_source else ()
            if entry.precision == "nvfp4":
                q = ckpt.read_nvfp4(part.source, *source)
                same = np.array_equal(codes, q.packed) and np.array_equal(scales[sel][rows], q.scales)
                same = same and np.all(ts == q.tensor_scale)
            else:
                src_codes, src_scale = ckpt.read_fp8(part.source, *source)
                same = np.array_equal(codes, src_codes)
                same = same and np.all(ts == np.asarray(src_scale, np.float32).reshape(-1))
            if not same:
                raise PackError(f"pack entry {entry.name}: rows of {part.source} do not round-trip to the source bytes")
            checked += 1
        ckpt.release()  # keep resident source pages small
    return {"quantized_parts_byte_identical": checked}


def _source_rows(ckpt: Checkpoint, entry, rows: int) -> np.ndarray:
    """float32 values of the entry's first `rows` rows, dequantized from the source."""
    out, need = [], rows
    for part in entry.parts:
        take = min(need, part.stop - part.start)
        if entry.source_precision == "nvfp4":
            q = ckpt.read_nvfp4(part.source)
            out.append(formats.dequantize_nvfp4(q.packed[:take], q.scales[:take], q.tensor_scale, name=part.source))
        else:
            codes, scale = ckpt.read_fp8(part.source)
            out.append(formats.dequantize_fp8(codes[:take], scale if scale.ndim == 0 else scale[:take], part.source))
        need -= take
        if not need:
            break
    return np.concatenate(out)


def _spot_check(ckpt: Checkpoint, plan: Plan, reader: PackTensors) -> list[dict]:
    """The first SPOT_ROWS rows of a few quantized linears through MLX's quantized matmul
    against the source's dequantized rows (or, quantized here, the pack's own): the cost
    does not grow with the matrix (a [248320, 2048] embedding is checked on 64 rows)."""
    import mlx.core as mx

    rng = np.random.default_rng(0)
    results, per_precision = [], {}
    for entry in plan.entries:
        if entry.kind != "linear" or entry.precision not in ("nvfp4", "fp8"):
            continue
        if per_precision.get(entry.precision, 0) >= SPOT_CHECKS_PER_PRECISION:
            continue
        per_precision[entry.precision] = per_precision.get(entry.precision, 0) + 1
        n, k = entry.shape
        rows = min(n, SPOT_ROWS)
        x = rng.standard_normal((4, k)).astype(np.float32)
        words, scales, tensor_scale = (reader.read(entry.name + s, rows) for s in (".weight", ".scales", ".tensor_scale"))
        if entry.source_precision in ("nvfp4", "fp8"):
            reference = _source_rows(ckpt, entry, rows)
        else:  # quantized here: the kernel must reproduce the pack's own dequantized values
            reference = formats.dequantize_nvfp4(formats.words_to_bytes(words), scales, tensor_scale)
        expected = x @ reference.T
        mode, group, bits = ("nvfp4", 16, 4) if entry.precision == "nvfp4" else ("mxfp8", 32, 8)
        y = mx.quantized_matmul(mx.array(x), mx.array(words), mx.array(scales), transpose=True, group_size=group,
                                bits=bits, mode=mode) * mx.array(tensor_scale)
        error = float(np.max(np.abs(np.array(y) - expected)) / (np.max(np.abs(expected)) + 1e-30))
        if not error <= SPOT_TOLERANCE:
            raise PackError(f"pack entry {entry.name}: quantized matmul differs from the source by {error:.2e} (relative)")
        results.append({"entry": entry.name, "precision": entry.precision, "rows": rows, "max_relative_error": error})
        ckpt.release()
    return results


def validate_pack(pack: Path, ckpt: Checkpoint, plan: Plan) -> dict:
    summary = verify_pack(pack, whole_files=False)  # the shards were hashed as written
    reader = PackTensors(pack, mf.read_manifest(pack))
    return {
        "read_back": {"tensors_hashed": summary["tensors"], "shards_hashed_while_writing": summary["shards"], "ok": True},
        "round_trip": _round_trip(ckpt, plan, reader),
        "spot_checks": _spot_check(ckpt, plan, reader),
        "pack_sha256": summary["pack_sha256"],
    }
