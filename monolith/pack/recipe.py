"""Recipe: which pack entries a checkpoint becomes, in what precision, and why.

A pack entry is one array group the kernels read: a linear (possibly several source
matrices fused along output rows, or experts stacked along a leading axis) or a plain
tensor (norms, conv, gates' parameters). The recipe only plans; build.py converts.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

from ..checkpoint import Checkpoint, CheckpointError, ModuleSpec
from ..checkpoint.experts import halves_of
from ..checkpoint.reader import INDEX_FILE
from ..formats import BLOCK
from ..formats.mlx_layout import MXFP8_GROUP

RECIPE_VERSION = 3  # 2: per-layer block masks, input embedding scale and heads in layout.draft; 3: the vision tower
QUANTIZATION_CHOICES = ("auto", "none", "nvfp4")
FLOAT_PRECISIONS = ("bf16", "f16", "f32")


class PackError(CheckpointError):
    """A pack cannot be built, verified or read; the message names the file/tensor."""


@dataclass(frozen=True)
class Part:
    """One source matrix (or tensor) inside an entry: rows [start, stop) of expert `expert`."""

    source: str  # source module name (linear) or tensor name (plain tensor)
    start: int
    stop: int
    expert: int | None = None


@dataclass
class Entry:
    name: str  # canonical pack name
    kind: str  # "linear" | "experts" | "tensor"
    precision: str  # output: "nvfp4" | "fp8" | "bf16" | "f16" | "f32"
    source_precision: str
    shape: tuple[int, ...]  # logical: (N, K), (E, N, K), or the tensor's shape
    parts: list[Part]
    transform: str | None = None  # tensors: "one_plus_f32" (zero-centred norm) | "f32"
    reason: str = ""
    stacked_source: bool = False  # experts read from one stacked source tensor [E, N, K]
    source_shape: tuple[int, ...] | None = None  # tensors stored re-shaped (same bytes): the source's shape

    def describe(self) -> dict:
        d = {
            "kind": self.kind,
            "precision": self.precision,
            "source_precision": self.source_precision,
            "shape": list(self.shape),
            "parts": [
                {k: v for k, v in (("source", p.source), ("rows", [p.start, p.stop]), ("expert", p.expert)) if v is not None}
                for p in self.parts
            ],
        }
        if self.transform:
            d["transform"] = self.transform
        if self.stacked_source:
            d["stacked_source"] = True
        if self.source_shape is not None:
            d["source_shape"] = list(self.source_shape)
        if self.reason:
            d["reason"] = self.reason
        return d


@dataclass
class Plan:
    recipe: str
    role: str
    architecture: str
    quantization: str
    entries: list[Entry] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # source tensor -> why
    layout: dict = field(default_factory=dict)


# ---------------------------------------------------------------- keep policy
# Never quantized, whatever --quantization says (docs/formats.md 5, docs/drafts.md 2).
KEEP_RULES = [
    (re.compile(r"(^|\.)mlp\.gate$"), "MoE router: F32 softmax over logits, kept in source precision"),
    (re.compile(r"shared_expert_gate$"), "shared-expert gate: one row, kept in source precision"),
    (re.compile(r"linear_attn\.in_proj_[ab]$"), "GDN gate projections (beta, decay): kept as NVIDIA's recipe does"),
    (re.compile(r"markov_w1$"), "Markov W1 embedding stays BF16 (DSpark recipe)"),
    (re.compile(r"confidence_head"), "confidence head is never quantized"),
    (re.compile(r"markov_head\.(gate_proj|joint_proj)$"), "Markov head gate/joint projections are never quantized"),
]
RUNTIME_UNUSED_SCALES = ("input_scale", "input_global_scale", "k_scale", "v_scale", "output_scale")
TARGET_EMBEDDING_REASON = "target embedding kept in source precision (gathered, not multiplied)"


def is_activation_scale(tensor: str) -> bool:
    """`<module>.input_scale` and the like, or fused experts' `<group>_input_scale`."""
    base, _, leaf = tensor.rpartition(".")
    if leaf in RUNTIME_UNUSED_SCALES:
        return True
    group, _, suffix = leaf.partition("_proj_")
    return base.endswith(".experts") and group in ("gate_up", "down") and suffix in RUNTIME_UNUSED_SCALES


def keep_reason(module: str, role: str) -> str | None:
    for pattern, reason in KEEP_RULES:
        if pattern.search(module):
            return reason
    if role == "target" and module.endswith("embed_tokens"):
        return TARGET_EMBEDDING_REASON
    return None


def wants_quantization(quantization: str, role: str) -> bool:
    """auto: drafts are quantized to NVFP4 at pack time, targets keep their source
    precision; nvfp4: quantize both; none: quantize nothing."""
    if quantization not in QUANTIZATION_CHOICES:
        raise PackError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")
    return quantization == "nvfp4" or (quantization == "auto" and role == "draft")


# ---------------------------------------------------------------- planning helpers
def collected(plan_step):
    """A Planner step that, when the planner collects problems (a dry run), records
    its error and goes on instead of raising; the sources it names are then not
    reported again as unexpected tensors."""

    @functools.wraps(plan_step)
    def step(self, name, sources, *args, **kwargs):
        try:
            return plan_step(self, name, sources, *args, **kwargs)
        except CheckpointError as e:
            if self.problems is None:
                raise
            self.problems.append(str(e))
            self.failed.update(_names(sources))

    return step


def _names(sources) -> list[str]:
    """A step's source names: one, a list, or a list of lists (experts)."""
    if isinstance(sources, str):
        return [sources]
    return [name for group in sources for name in ([group] if isinstance(group, str) else group)]


class Planner:
    """Plans entries from a checkpoint. Modules are looked up (and checked against the
    quantization config) only when a recipe asks for them. With a `problems` list,
    every failing step is recorded there and planning goes on (dry run)."""

    def __init__(self, ckpt: Checkpoint, role: str, quantization: str, problems: list[str] | None = None):
        self.ckpt = ckpt
        self.role = role
        self.quantize = wants_quantization(quantization, role)
        self.used: set[str] = set()  # source tensor names consumed
        self.problems = problems
        self.failed: set[str] = set()  # sources of steps that failed (dry run)

    def spec(self, module: str) -> ModuleSpec:
        return self.ckpt.module(module)

    def _use(self, tensor: str) -> None:
        unlisted = self.ckpt.unlisted_file(tensor)
        if unlisted is not None:
            raise PackError(
                f"{unlisted}: tensor {tensor} is needed, but {INDEX_FILE} does not list {unlisted.name} "
                "(transformers and vLLM read only the files the index lists); add its tensors to the "
                "index's weight_map, or remove the file"
            )
        self.used.add(tensor)

    def _use_module(self, module: str) -> None:
        for tensor in self.spec(module).tensors.values():
            self._use(tensor)

    def has_module(self, module: str) -> bool:
        return self.ckpt.has_module(module)

    def require(self, module: str) -> None:
        if not self.ckpt.has_module(module):
            raise PackError(f"{self.ckpt.path}: missing weight for module {module}")

    def output_precision(self, module: str) -> tuple[str, str]:
        """(output precision, reason) for one source linear."""
        spec = self.spec(module)
        k = spec.shape[-1]
        if spec.precision == "nvfp4":
            return "nvfp4", "already NVFP4: repacked without arithmetic"
        if spec.precision == "fp8":
            if k % MXFP8_GROUP:
                return "bf16", f"FP8 with K={k} not a multiple of {MXFP8_GROUP}: dequantized to BF16"
            return "fp8", "FP8 kept 8-bit (mxfp8 words, unit group scales, its per-tensor or per-channel scale per row)"
        reason = keep_reason(module, self.role)
        if reason:
            return spec.precision, reason
        if not self.quantize:
            return spec.precision, "kept in source precision (quantization not requested)"
        if k % BLOCK or len(spec.shape) != 2:
            return spec.precision, f"K={k} is not a multiple of {BLOCK} (or not a matrix): kept in source precision"
        return "nvfp4", "quantized to NVFP4 at pack time (ModelOpt-exact quantizer)"

    @collected
    def linear(self, name: str, sources: list[str], plan: Plan) -> None:
        """Fuse `sources` along output rows; consecutive members of one precision share
        an entry (named `name`, or `name.0`, `name.1`... when precisions differ)."""
        if not self._all_present(sources):
            return
        runs: list[list] = []  # [precision, source precision, reason, members]
        for s in sources:
            precision, reason = self.output_precision(s)
            key = [precision, self.spec(s).precision, reason]
            if runs and runs[-1][:3] == key and self._same_k(runs[-1][3][0], s):
                runs[-1][3].append(s)
            else:
                runs.append(key + [[s]])
        for index, (precision, source_precision, reason, members) in enumerate(runs):
            parts, row = [], 0
            for s in members:
                n = self.spec(s).shape[0]
                parts.append(Part(s, row, row + n))
                row += n
                self._use_module(s)
            k = self.spec(members[0]).shape[-1]
            entry_name = name if len(runs) == 1 else f"{name}.{index}"
            plan.entries.append(Entry(entry_name, "linear", precision, source_precision, (row, k), parts, reason=reason))

    @collected
    def experts(self, name: str, per_expert: list[list[str]], plan: Plan) -> None:
        """Stack experts [E, N, K]; expert e fuses the modules per_expert[e] along rows."""
        if not self._all_present(s for sources in per_expert for s in sources):
            return
        first = None
        parts, rows = [], 0
        for e, sources in enumerate(per_expert):
            row = 0
            for s in sources:
                spec = self.spec(s)
                precision, reason = self.output_precision(s)
                key = (precision, spec.precision, spec.shape[-1])
                if first is None:
                    first = key + (reason,)
                elif key != first[:3]:
                    main = spec.tensors.get("weight", spec.tensors.get("weight_packed"))
                    raise PackError(
                        f"{self.ckpt.file_of(main)}: expert module {s} is {spec.precision} but other experts of "
                        f"{name} are {first[1]}; stacked experts need one precision"
                    )
                n = spec.shape[0]
                parts.append(Part(s, row, row + n, e))
                row += n
                self._use_module(s)
            if rows and row != rows:
                raise PackError(f"{self.ckpt.path}: experts of {name} have different sizes ({rows} vs {row} rows)")
            rows = row
        precision, source_precision, k, reason = first
        plan.entries.append(Entry(name, "experts", precision, source_precision, (len(per_expert), rows, k), parts, reason=reason))

    def _all_present(self, sources) -> bool:
        """Every source module is there and passes its checks. Collecting (dry run),
        each failing one is recorded and False returned (the step's other sources are
        then not reported as unexpected tensors); otherwise the first raises."""
        ok = True
        sources = list(sources)
        for s in sources:
            try:
                self.require(s)
                self.spec(s)
            except CheckpointError as e:
                if self.problems is None:
                    raise
                self.problems.append(str(e))
                ok = False
        if not ok:
            self.failed.update(sources)
        return ok

    def _same_k(self, a: str, b: str) -> bool:
        return self.spec(a).shape[-1] == self.spec(b).shape[-1]

    @collected
    def tensor(self, name: str, source: str, plan: Plan, transform: str | None = None, reason: str = "",
               shape: tuple[int, ...] | None = None) -> None:
        """A plain tensor; with `shape`, stored in that shape (the same bytes in the same
        order, e.g. a conv kernel flattened to a matrix; the manifest keeps source_shape)."""
        if not self.ckpt.has(source):
            raise PackError(f"{self.ckpt.path}: missing tensor {source}")
        dtype = self.ckpt.dtype(source)
        precision = {"BF16": "bf16", "F16": "f16", "F32": "f32"}.get(dtype, dtype.lower())
        out = "f32" if transform else precision
        stored = tuple(self.ckpt.shape(source))
        if shape is not None and math.prod(shape) != math.prod(stored):
            raise PackError(f"{self.ckpt.file_of(source)}: tensor {source} of shape {list(stored)} cannot be stored "
                            f"as {list(shape)}")
        self._use(source)
        plan.entries.append(Entry(name, "tensor", out, precision, tuple(shape or stored),
                                  [Part(source, 0, stored[0] if stored else 1)], transform=transform, reason=reason,
                                  source_shape=None if shape is None or tuple(shape) == stored else stored))

    def finish(self, plan: Plan, skip: tuple[tuple[str, str], ...] = ()) -> Plan:
        """Every source tensor is either used or skipped for a stated reason."""
        for t in self.ckpt.tensor_names():
            if t in self.used:
                continue
            why = next((reason for prefix, reason in skip if t.startswith(prefix)), None)
            if why is None and is_activation_scale(t):
                why = "activation / KV-cache scale: the runtime is weight-only and keeps KV in BF16"
            if why is None and self._failed_source(t):
                continue  # its step's problem is reported already
            if why is None:
                error = PackError(
                    f"{self.ckpt.file_of(t)}: tensor {t} is not part of the {plan.architecture} "
                    "recipe (unexpected tensor; refusing to guess what it means)"
                )
                if self.problems is None:
                    raise error
                self.problems.append(str(error))
                continue
            unlisted = self.ckpt.unlisted_file(t)
            if unlisted is not None:
                why += f" (in {unlisted.name}, which {INDEX_FILE} does not list)"
            plan.skipped[t] = why
        return plan

    def _failed_source(self, tensor: str) -> bool:
        """Is `tensor` a failed step's source, or one of a failed module's tensors?"""
        base, _, leaf = tensor.rpartition(".")
        fused = [f"{base}.{g}" for g in ("gate_up_proj", "down_proj") if leaf.startswith(g + "_")]
        return any(name in self.failed for name in [tensor, base, *fused])

    @collected
    def fused_experts(self, name: str, source: str, plan: Plan) -> None:
        """Experts stored stacked in the source, [E, N, K] in any precision (see
        checkpoint/experts.py); gate_up rows are gate then up, each expert's halves
        become separate parts (own tensor scale, own pack-time quantization)."""
        if not self.ckpt.has_fused_experts(source):
            raise PackError(f"{self.ckpt.path}: missing fused experts {source}")
        spec = self.spec(source)
        e, n, k = spec.shape
        if spec.precision in FLOAT_PRECISIONS and self.quantize and k % BLOCK == 0:
            precision, reason = "nvfp4", "quantized to NVFP4 at pack time, each expert's gate and up separately"
        else:
            precision, reason = self.output_precision(source)
        step = n // halves_of(source)
        parts = [Part(source, a, a + step, ex) for ex in range(e) for a in range(0, n, step)]
        self._use_module(source)
        plan.entries.append(Entry(name, "experts", precision, spec.precision, (e, n, k), parts, reason=reason,
                                  stacked_source=True))
