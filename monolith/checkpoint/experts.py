"""Fused experts: all experts of one MoE layer stored as one stacked [E, N, K] group.

The group is named like the official BF16 tensor, `<layer>.mlp.experts.gate_up_proj`
(N = 2I, rows gate then up) or `.down_proj`. Quantized exports that keep experts fused
name each companion tensor as transformers 5 does when it merges per-expert tensors
into one parameter (quantizers/base.py, update_weight_conversions): the parameter
name plus the serialized name without its leading `weight`, stacked over experts
(dim 0) and, for gate_up, gate and up concatenated along dim 1:
  compressed-tensors NVFP4  `<g>_packed` U8 [E, N, K/2], `<g>_scale` F8_E4M3 [E, N, K/16],
                            `<g>_global_scale` float (divided by)
  ModelOpt NVFP4            `<g>` U8 [E, N, K/2], `<g>_scale` F8_E4M3 [E, N, K/16],
                            `<g>_scale_2` float (multiplied by)
  FP8 (either)              `<g>` F8_E4M3 [E, N, K], `<g>_scale` float
  BF16 / F16 / F32          `<g>` [E, N, K]
A per-expert scalar scale holds one value for all experts ([1]), one per expert
([E], [E, 1]) or, for gate_up, one per expert and half ([E, 2]: gate, up); an FP8
scale may instead hold one per row ([E, N], [E, N, 1]). Activation scales
(`<g>_input_scale`, `<g>_input_global_scale`) are not read (weight-only runtime).

Quantization configs name experts one by one (compressed-tensors targets such as
`re:.*mlp\\.experts\\.\\d+\\..*`, ModelOpt `quantized_layers` keys or their
`...mlp.experts` container), so a fused group is checked as expert 0's modules.
"""

from __future__ import annotations

import numpy as np

from .errors import CheckpointError
from .precision import BLOCK, PLAIN_DTYPES, SCALE_DTYPES, ModuleSpec, checked_spec

FUSED_LEAVES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def is_fused_experts_name(name: str) -> bool:
    base, _, leaf = name.rpartition(".")
    return base.endswith(".experts") and leaf in FUSED_LEAVES


def halves_of(name: str) -> int:
    """2 for gate_up (rows gate then up), 1 for down."""
    return len(FUSED_LEAVES[name.rpartition(".")[2]])


def fused_experts_spec(ck, name: str, rules) -> ModuleSpec:
    scheme, tensors, shape = _stored(ck, name)
    base, _, leaf = name.rpartition(".")
    members = [f"{base}.0.{proj}" for proj in FUSED_LEAVES[leaf]]
    expects = [rules.expect(m) for m in members]
    if len({e.allowed for e in expects}) > 1:
        raise CheckpointError(
            f"{ck.file_of(tensors.get('weight_packed', tensors.get('weight')))}: module {name} stores "
            f"{' and '.join(members)} in one tensor, but {rules.subject} gives them different schemes "
            f"({'; '.join(e.reason for e in expects)})"
        )
    return checked_spec(ck, name, scheme, tensors, shape, expects[0], rules, (f"{name}_packed", f"{name}_scale"))


def _fail(ck, tensor: str, message: str):
    raise CheckpointError(f"{ck.file_of(tensor)}: {tensor}: {message}")


def _stored(ck, name: str) -> tuple[str, dict[str, str], tuple[int, ...]]:
    halves = halves_of(name)
    if ck.has(name + "_packed"):
        if ck.has(name):
            _fail(ck, name, f"fused experts {name} are stored both as {name} and {name}_packed")
        tensors = {"weight_packed": name + "_packed", "weight_scale": name + "_scale",
                   "weight_global_scale": name + "_global_scale"}
        return "nvfp4", tensors, _check_nvfp4(ck, name, halves, *tensors.values())
    dtype = ck.dtype(name)
    if dtype == "U8":
        tensors = {"weight": name, "weight_scale": name + "_scale", "weight_scale_2": name + "_scale_2"}
        return "nvfp4", tensors, _check_nvfp4(ck, name, halves, *tensors.values())
    shape = _check_stack(ck, name, halves, name)
    if dtype == "F8_E4M3":
        scale = name + "_scale"
        if not ck.has(scale):
            _fail(ck, name, f"FP8 fused experts have no {scale} (missing in every file)")
        e, n, _ = shape
        _check_scale(ck, scale, e, halves, rows=n)
        return "fp8", {"weight": name, "weight_scale": scale}, shape
    if dtype in PLAIN_DTYPES:
        if ck.has(name + "_scale"):
            _fail(ck, name, f"dtype {dtype} but {name}_scale exists; quantized fused experts must be U8 or F8_E4M3")
        return "plain", {"weight": name}, shape
    _fail(ck, name, f"dtype {dtype} is not a supported weight dtype (U8 NVFP4, F8_E4M3 FP8, BF16, F16, F32)")


def _check_stack(ck, name: str, halves: int, tensor: str) -> tuple[int, int, int]:
    shape = tuple(ck.shape(tensor))
    if len(shape) != 3:
        _fail(ck, tensor, f"shape {list(shape)}, fused experts {name} must be 3-D [experts, out, in]")
    if shape[1] % halves:
        _fail(ck, tensor, f"shape {list(shape)}: {shape[1]} rows do not split into gate and up halves")
    return shape


def _check_nvfp4(ck, name: str, halves: int, codes: str, scale: str, tensor_scale: str) -> tuple[int, int, int]:
    for t in (scale, tensor_scale):
        if not ck.has(t):
            _fail(ck, codes, f"NVFP4 fused experts {name} have no {t} (missing in every file)")
    if ck.dtype(codes) != "U8":
        _fail(ck, codes, f"dtype {ck.dtype(codes)}, NVFP4 codes must be U8")
    e, n, half_k = _check_stack(ck, name, halves, codes)
    k = half_k * 2
    if k % BLOCK:
        _fail(ck, codes, f"input size K={k} (codes {[e, n, half_k]}) is not a multiple of {BLOCK}")
    if ck.dtype(scale) != "F8_E4M3":
        _fail(ck, scale, f"dtype {ck.dtype(scale)}, NVFP4 block scales must be F8_E4M3")
    if tuple(ck.shape(scale)) != (e, n, k // BLOCK):
        _fail(ck, scale, f"shape {list(ck.shape(scale))}, expected [{e}, {n}, {k // BLOCK}] for codes "
                         f"{codes} {[e, n, half_k]} (one scale per {BLOCK} inputs)")
    _check_scale(ck, tensor_scale, e, halves)
    return (e, n, k)


def _scalar_shapes(e: int, halves: int) -> tuple[tuple[int, ...], ...]:
    return ((), (1,), (e,), (e, 1)) + (((e, halves),) if halves > 1 else ())


def _check_scale(ck, scale: str, e: int, halves: int, rows: int | None = None) -> None:
    if ck.dtype(scale) not in SCALE_DTYPES:
        _fail(ck, scale, f"dtype {ck.dtype(scale)}, scales must be one of {', '.join(SCALE_DTYPES)}")
    shape = tuple(ck.shape(scale))
    allowed = _scalar_shapes(e, halves) + (((e, rows), (e, rows, 1)) if rows else ())
    if shape not in allowed:
        _fail(ck, scale, f"shape {list(shape)}, expected one of {', '.join(str(list(s)) for s in allowed)}")


def expert_scale(values: np.ndarray, shape: tuple[int, int, int], halves: int, expert: int,
                 rows: tuple[int, int]) -> np.ndarray:
    """The scale of rows [a, b) of `expert` of fused experts of `shape` [E, N, K]: 0-d,
    or [b - a, 1] when the stored scale has one value per row."""
    e, n, _ = shape
    a, b = rows
    values = np.asarray(values, np.float32)
    if values.ndim >= 2 and values.shape[1] == n and n > halves:
        return values.reshape(e, n)[expert, a:b].reshape(-1, 1)
    half = a // (n // halves)
    if b <= a or (b - 1) // (n // halves) != half:
        raise CheckpointError(f"rows [{a}, {b}) of expert {expert} do not lie inside one of its {halves} halves")
    flat = values.reshape(-1)
    if flat.size == 1:
        return flat[0].reshape(())
    if flat.size == e:
        return flat[expert].reshape(())
    return flat[expert * halves + half].reshape(())
