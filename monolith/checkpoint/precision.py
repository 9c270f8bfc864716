"""Each module's precision: what the quantization config says, checked against the
tensors actually stored.

A module is a tensor prefix with a `.weight` or `.weight_packed`. Its stored layout
decides its precision:
  `.weight_packed` U8                 -> nvfp4 (compressed-tensors)
  `.weight` U8                        -> nvfp4 (ModelOpt)
  `.weight` F8_E4M3                   -> fp8
  `.weight` BF16 / F16 / F32          -> bf16 / f16 / f32 ("plain")
The quantization config then says which of those it allows for the module
(an `Expectation`); a mismatch is a CheckpointError. Weights that are not 2-D
(norms, conv kernels) are never quantized, whatever a broad pattern says.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field


from .errors import CheckpointError

BLOCK = 16
PLAIN_DTYPES = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
SCALE_DTYPES = ("F32", "BF16", "F16")  # tensor and channel scales
CT_FORMATS = ("nvfp4-pack-quantized", "float-quantized", "mixed-precision")
MIXED_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8"}


@dataclass(frozen=True)
class ModuleSpec:
    name: str
    precision: str  # "nvfp4" | "fp8" | "bf16" | "f16" | "f32"
    tensors: dict[str, str] = field(hash=False)  # role -> tensor name
    shape: tuple[int, ...]  # logical (dequantized) shape


@dataclass(frozen=True)
class Expectation:
    allowed: frozenset  # subset of {"nvfp4", "fp8", "plain"}
    reason: str  # the config rule, finishing "the quantization config ..."


PLAIN_ONLY = frozenset({"plain"})


class NoQuantRules:
    """No quantization config: every module must be stored unquantized."""

    def __init__(self, where: str):
        self.subject = where

    def expect(self, name: str) -> Expectation:
        return Expectation(PLAIN_ONLY, "has no quantization config (and there is no hf_quant_config.json)")


class PlainAllowed:
    """The rules of `inner`, except that a module may also be stored unquantized. For the
    modules of PLAIN_ALLOWED_PREFIXES, which published configs' rules wrongly match."""

    def __init__(self, inner):
        self.inner = inner
        self.subject = inner.subject

    def expect(self, name: str) -> Expectation:
        e = self.inner.expect(name)
        return Expectation(e.allowed | PLAIN_ONLY, f"{e.reason} (or it is stored unquantized)")


# The MTP head: unsloth's Qwen3.6-27B stores `mtp.*` BF16 in model_mtp.safetensors while
# its NVFP4 and FP8 rules match those names (and nothing ignores them); a recipe that
# keeps the head (pack/target_recipe.py, --with-mtp) reads such a module as stored.
PLAIN_ALLOWED_PREFIXES = ("mtp.",)


class ModelOptRules:
    """ModelOpt. Single NVFP4: modules matching an `exclude_modules` glob (fnmatch, or
    the pattern names a parent module) are BF16; the rest are NVFP4 or, when the
    tensors say so, unquantized (embeddings, norms, anything ModelOpt left alone).
    MIXED_PRECISION: a module listed in `quantized_layers`, or under a listed
    container such as `...mlp.experts`, has that entry's algo; unlisted is BF16.
    An entry this loader cannot read (unknown algo, other group size) refuses only
    the modules it covers, when they are asked for: a recipe that drops them
    (vision tower, MTP head) never sees it."""

    def __init__(self, block: dict, quant_format: str, where: str):
        self.subject = f"the quantization config ({where})"
        self.mixed = quant_format == "modelopt-mixed"
        if self.mixed:
            layers = block.get("quantized_layers")
            if not isinstance(layers, dict):
                raise CheckpointError(
                    f"{where}.quantized_layers: missing (MIXED_PRECISION needs it; ModelOpt writes it to "
                    "hf_quant_config.json, and recent exports mirror it into config.json)"
                )
            self.layers: dict[str, str] = {}
            self.unreadable: dict[str, str] = {}  # entry -> why it cannot be used
            for module, entry in layers.items():
                algo = str((entry or {}).get("quant_algo")).upper()
                self.layers[module] = algo
                if algo not in MIXED_ALGOS:
                    self.unreadable[module] = (
                        f"{where}.quantized_layers[{module!r}].quant_algo {algo!r} is not supported "
                        f"(supported: {', '.join(MIXED_ALGOS)})"
                    )
                elif MIXED_ALGOS[algo] == "nvfp4" and (entry or {}).get("group_size") not in (None, BLOCK):
                    self.unreadable[module] = (
                        f"{where}.quantized_layers[{module!r}].group_size is {entry['group_size']}; NVFP4 needs {BLOCK}"
                    )
        else:
            _check_group_size(block, where)
            for group, g in (block.get("config_groups") or {}).items():  # the config.json mirror
                weights = (g or {}).get("weights") or {}
                if (weights.get("num_bits"), weights.get("type")) == (4, "float"):
                    _check_group_size(weights, f"{where}.config_groups[{group!r}].weights")
            self.exclude = list(block.get("exclude_modules") or block.get("ignore") or [])

    def _covering(self, name: str) -> str | None:
        """The longest quantized_layers entry that is `name` or one of its parents."""
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            entry = ".".join(parts[:end])
            if entry in self.layers:
                return entry
        return None

    def expect(self, name: str) -> Expectation:
        if self.mixed:
            entry = self._covering(name)
            if entry is None:
                return Expectation(PLAIN_ONLY, "does not list it in quantized_layers (so BF16)")
            if entry in self.unreadable:
                raise CheckpointError(f"{self.unreadable[entry]}; it covers module {name}")
            algo = self.layers[entry]
            return Expectation(
                frozenset({MIXED_ALGOS[algo]}), f"lists it in quantized_layers as {algo} (entry {entry!r})"
            )
        for pattern in self.exclude:
            if fnmatch.fnmatchcase(name, pattern) or name.startswith(pattern + "."):
                return Expectation(PLAIN_ONLY, f"excludes it (exclude_modules {pattern!r})")
        return Expectation(frozenset({"nvfp4", "plain"}), "quantizes it as NVFP4")


class CompressedTensorsRules:
    """compressed-tensors, matching as the package does (utils/match.py): a target or
    ignore entry `re:X` matches a module name when `re.match(X, name)`; a plain entry
    matches the exact name, or is a class name such as `Linear` (CamelCase). Ignore
    wins over targets. Among matching targets the most specific wins: exact name,
    then regex, then class (ties: the smaller target string, as the package sorts).
    A name match fixes the group's scheme; a class match allows the scheme or
    unquantized (a tensor file does not say which class a module had); ignored or
    untargeted modules are unquantized. Class names in `ignore` are not checked.
    A group this loader cannot read refuses only the modules it wins, when they are
    asked for."""

    def __init__(self, qc: dict, where: str):
        self.subject = f"the quantization config ({where})"
        top = qc.get("format")
        if top not in CT_FORMATS:
            raise CheckpointError(
                f"{where}.format {top!r} is not supported (supported: {', '.join(CT_FORMATS)})"
            )
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise CheckpointError(f"{where}.config_groups: missing or empty")
        self.targets: dict[str, tuple[str, str]] = {}  # target -> (group, scheme); later groups win
        self.unreadable: dict[str, str] = {}  # group -> why it cannot be used
        for group, g in groups.items():
            try:
                scheme = _ct_group_scheme(g, top, f"{where}.config_groups[{group!r}]")
            except CheckpointError as e:
                scheme, self.unreadable[group] = "", str(e)
            for target in g.get("targets") or []:
                self.targets[target] = (group, scheme)
        self.ignore = [e for e in qc.get("ignore") or [] if not _is_class_name(e)]

    def expect(self, name: str) -> Expectation:
        for entry in self.ignore:
            if _ct_name_match(name, entry):
                return Expectation(PLAIN_ONLY, f"ignores it ({entry!r})")
        ranked = []
        for target in self.targets:
            if _ct_name_match(name, target):
                ranked.append((1 if target.startswith("re:") else 0, target))
            elif _is_class_name(target):
                ranked.append((2, target))
        if not ranked:
            return Expectation(PLAIN_ONLY, "targets it in no config group")
        rank, target = min(ranked)
        group, scheme = self.targets[target]
        if group in self.unreadable:
            raise CheckpointError(f"{self.unreadable[group]}; it targets module {name} ({target!r})")
        allowed = {scheme, "plain"} if rank == 2 else {scheme}
        return Expectation(frozenset(allowed), f"targets it in config group {group!r} ({target!r}) as {scheme}")


def _ct_name_match(name: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry == name


def _is_class_name(entry: str) -> bool:
    return entry.isidentifier() and entry[0].isupper()


def _ct_group_scheme(group: dict, top: str, where: str) -> str:
    fmt = group.get("format") or top
    weights = group.get("weights") or {}
    bits, kind = weights.get("num_bits"), weights.get("type")
    if fmt == "mixed-precision":  # a group without its own format: infer from its weights
        fmt = {(4, "float"): "nvfp4-pack-quantized", (8, "float"): "float-quantized"}.get((bits, kind))
    if fmt == "nvfp4-pack-quantized" and (bits, kind) == (4, "float"):
        _check_group_size(weights, f"{where}.weights")
        return "nvfp4"
    if fmt == "float-quantized" and (bits, kind) == (8, "float"):
        if weights.get("strategy", "tensor") not in ("tensor", "channel"):
            raise CheckpointError(
                f"{where}.weights.strategy {weights.get('strategy')!r} is not supported for FP8 "
                "(supported: tensor, channel)"
            )
        return "fp8"
    raise CheckpointError(
        f"{where}: format {fmt!r} with {bits}-bit {kind} weights is not supported "
        "(supported: nvfp4-pack-quantized with 4-bit float weights, float-quantized with 8-bit float weights)"
    )


def _check_group_size(block: dict, where: str) -> None:
    size = block.get("group_size")
    if size is not None and size != BLOCK:
        raise CheckpointError(f"{where}.group_size is {size}; NVFP4 needs {BLOCK}")


def rules_for(quant_format: str, quant_config: dict | None, where: str):
    if quant_format == "compressed-tensors":
        return CompressedTensorsRules(quant_config, where)
    if quant_format in ("modelopt-nvfp4", "modelopt-mixed"):
        return ModelOptRules(quant_config, quant_format, where)
    return NoQuantRules(where)


# ---- stored layout -------------------------------------------------------------


def module_spec(ck, name: str, rules) -> ModuleSpec:
    """The checked ModuleSpec of module `name`. `ck` answers has/dtype/shape/file_of."""
    scheme, tensors, shape = _stored(ck, name)
    if ck.has(f"{name}.bias"):
        tensors["bias"] = f"{name}.bias"
    return checked_spec(ck, name, scheme, tensors, shape, rules.expect(name), rules, (f"{name}.weight_packed", f"{name}.weight_scale"))


def checked_spec(ck, name, scheme, tensors, shape, expect: Expectation, rules, missing: tuple[str, str]) -> ModuleSpec:
    """The ModuleSpec, once the stored scheme is one the config allows. `missing`
    names the tensor a compressed-tensors NVFP4 / any other quantized module would
    have, for the message when a matrix the config quantizes is stored plain."""
    main = tensors.get("weight_packed", tensors.get("weight"))
    if scheme not in expect.allowed:
        where = f"{ck.file_of(main)}: module {name}"
        if scheme != "plain":
            raise CheckpointError(
                f"{where} is stored as {scheme} ({main} is {ck.dtype(main)}) but {rules.subject} {expect.reason}"
            )
        if len(shape) == 2 or name == main:  # a matrix (or fused experts) the config quantizes, stored plain
            compressed = isinstance(rules, CompressedTensorsRules) and "nvfp4" in expect.allowed
            raise CheckpointError(
                f"{where}: {rules.subject} {expect.reason}, but {missing[0] if compressed else missing[1]} is "
                f"missing and {main} is {ck.dtype(main)}"
            )
    precision = PLAIN_DTYPES[ck.dtype(main)] if scheme == "plain" else scheme
    return ModuleSpec(name, precision, tensors, shape)


def _stored(ck, name: str) -> tuple[str, dict[str, str], tuple[int, ...]]:
    weight, packed = f"{name}.weight", f"{name}.weight_packed"
    if ck.has(packed):
        if ck.has(weight):
            _fail(ck, packed, f"module {name} has both {weight} and {packed}")
        tensors = {"weight_packed": packed, "weight_scale": f"{name}.weight_scale",
                   "weight_global_scale": f"{name}.weight_global_scale"}
        return "nvfp4", tensors, _check_nvfp4(ck, name, *tensors.values())
    dtype = ck.dtype(weight)
    if dtype == "U8":
        tensors = {"weight": weight, "weight_scale": f"{name}.weight_scale",
                   "weight_scale_2": f"{name}.weight_scale_2"}
        return "nvfp4", tensors, _check_nvfp4(ck, name, *tensors.values())
    if dtype == "F8_E4M3":
        tensors = {"weight": weight, "weight_scale": f"{name}.weight_scale"}
        return "fp8", tensors, _check_fp8(ck, name, weight, tensors["weight_scale"])
    if dtype in PLAIN_DTYPES:
        if ck.has(f"{name}.weight_scale"):
            _fail(ck, weight, f"dtype {dtype} but {name}.weight_scale exists; "
                              "a quantized weight must be U8 (NVFP4) or F8_E4M3 (FP8)")
        return "plain", {"weight": weight}, tuple(ck.shape(weight))
    _fail(ck, weight, f"dtype {dtype} is not a supported weight dtype (U8 NVFP4, F8_E4M3 FP8, BF16, F16, F32)")


def _fail(ck, tensor: str, message: str):
    raise CheckpointError(f"{ck.file_of(tensor)}: {tensor}: {message}")


def _check_nvfp4(ck, name: str, weight: str, scale: str, tensor_scale: str) -> tuple[int, int]:
    for t in (scale, tensor_scale):
        if not ck.has(t):
            _fail(ck, weight, f"module {name}: NVFP4 weight has no {t} (missing in every file)")
    if ck.dtype(weight) != "U8":
        _fail(ck, weight, f"dtype {ck.dtype(weight)}, NVFP4 codes must be U8")
    wshape = tuple(ck.shape(weight))
    if len(wshape) != 2:
        _fail(ck, weight, f"shape {list(wshape)}, NVFP4 codes must be 2-D [out, in/2]")
    n, k = wshape[0], wshape[1] * 2
    if k % BLOCK:
        _fail(ck, weight, f"input size K={k} (codes {list(wshape)}) is not a multiple of {BLOCK}")
    if ck.dtype(scale) != "F8_E4M3":
        _fail(ck, scale, f"dtype {ck.dtype(scale)}, NVFP4 block scales must be F8_E4M3")
    if tuple(ck.shape(scale)) != (n, k // BLOCK):
        _fail(ck, scale, f"shape {list(ck.shape(scale))}, expected [{n}, {k // BLOCK}] for weight "
                         f"{weight} {list(wshape)} (one scale per {BLOCK} inputs)")
    _check_scale(ck, tensor_scale, (1,))
    return (n, k)


def _check_fp8(ck, name: str, weight: str, scale: str) -> tuple[int, int]:
    if not ck.has(scale):
        _fail(ck, weight, f"module {name}: FP8 weight has no {scale} (missing in every file)")
    wshape = tuple(ck.shape(weight))
    if len(wshape) != 2:
        _fail(ck, weight, f"shape {list(wshape)}, FP8 weights must be 2-D")
    _check_scale(ck, scale, (1, wshape[0]))
    return wshape


def _check_scale(ck, scale: str, sizes: tuple[int, ...]) -> None:
    """A float scale holding one value (0-d, [1]) or one per output row ([N], [N, 1])."""
    if ck.dtype(scale) not in SCALE_DTYPES:
        _fail(ck, scale, f"dtype {ck.dtype(scale)}, scales must be one of {', '.join(SCALE_DTYPES)}")
    shape = tuple(ck.shape(scale))
    size = math.prod(shape)
    if size not in sizes or (size > 1 and shape not in ((size,), (size, 1))):
        per_row = f" or one per output row ([{sizes[1]}, 1])" if len(sizes) > 1 else ""
        _fail(ck, scale, f"shape {list(shape)}, expected one value{per_row}")
