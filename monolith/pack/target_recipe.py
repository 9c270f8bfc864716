"""The Qwen3.5/3.6 hybrid target (MoE and dense) as pack entries.

Canonical names drop the `model.language_model.` wrapper: `model.embed_tokens`,
`model.layers.{i}....`, `model.norm`, `lm_head`. Fusions (rows in this order):
  self_attn.qkv        = q_proj (query|gate per head) | k_proj | v_proj
  linear_attn.in_proj  = in_proj_qkv | in_proj_z | in_proj_b | in_proj_a
  mlp.gate_up, mlp.shared_expert.gate_up = gate_proj | up_proj
  mlp.experts.gate_up [E, 2I, H], mlp.experts.down [E, H, I]
Members of different precisions split into `<name>.0`, `<name>.1`, ... (see Entry.parts).
Zero-centred norms are stored as 1 + w in F32; A_log, dt_bias and the gated-norm
weight as F32.

With `with_mtp` the checkpoint's multi-token-prediction head is kept (docs/formats.md 5):
its decoder layer `mtp.layers.{j}.` is planned exactly as a target full-attention layer
`model.layers.{i}.` is, `mtp.fc` as a linear, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden` and `mtp.norm` as zero-centred norms. Its linears follow a
draft's quantization rules (under auto, float matrices become NVFP4: it drafts), and its
modules may be stored unquantized whatever the quantization rules say
(checkpoint/precision.py PLAIN_ALLOWED_PREFIXES: unsloth's 27B stores them BF16 although
its NVFP4 and FP8 rules match their names). Without it, the head is dropped.

The vision tower is kept under `model.visual.` in its source precision, never quantized
(`_plan_vision`, docs/formats.md 5); `with_vision=False` (--no-vision) drops it.
"""

from __future__ import annotations

from ..checkpoint import Checkpoint, CheckpointError
from ..checkpoint.config import QWEN3_5_MOE
from ..checkpoint.vision_config import VisionArgs, expected_shapes
from .recipe import PackError, Plan, Planner

ZERO_CENTRED = "zero-centred RMSNorm weight stored as 1 + w in F32"
MTP_SKIP = ("mtp.", "MTP head: not used by the runtime (DSpark drafts instead)")  # without --with-mtp
MTP_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
VISION_PREFIX = "model.visual."  # the tower's pack names, from either source prefix
VISION_SOURCES = ("model.visual.", "model.language_model.visual.")  # where checkpoints keep the tower
VISION_PRECISIONS = ("BF16", "F16", "F32")
VISION_POLICY = "kept in source precision, never quantized (--quantization applies to the language model only)"
PATCH_EMBED = "patch_embed.proj.weight"


def source_prefix(ckpt: Checkpoint) -> str:
    for prefix in ("model.language_model.", "model."):
        if ckpt.has(prefix + "embed_tokens.weight"):
            return prefix
    raise PackError(f"{ckpt.path}: no embed_tokens.weight under model.language_model. or model.")


def config_field(ckpt: Checkpoint, name: str):
    if name not in ckpt.text_config:
        raise PackError(f"{ckpt.path / 'config.json'}: the text config has no field {name}")
    return ckpt.text_config[name]


def plan_target(ckpt: Checkpoint, quantization: str, problems: list[str] | None = None,
                with_mtp: bool = False, with_vision: bool = True) -> Plan:
    """The target's entries; the vision tower is kept unless `with_vision` is False
    (--no-vision), the MTP head only `with_mtp`."""
    p = Planner(ckpt, "target", quantization, problems)
    plan = Plan("qwen3_5-hybrid", "target", ckpt.architecture, quantization)
    src = source_prefix(ckpt)

    p.linear("model.embed_tokens", [src + "embed_tokens"], plan)
    for i, kind in enumerate(_layer_types(ckpt)):
        _plan_layer(p, plan, ckpt, f"{src}layers.{i}.", f"model.layers.{i}.", kind)
    p.tensor("model.norm", src + "norm.weight", plan, "one_plus_f32", ZERO_CENTRED)
    if ckpt.has("lm_head.weight") or ckpt.has("lm_head.weight_packed"):
        p.linear("lm_head", ["lm_head"], plan)
    plan.layout = {
        "fusions": {
            "self_attn.qkv": ["q_proj", "k_proj", "v_proj"],
            "linear_attn.in_proj": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"],
            "gate_up": ["gate_proj", "up_proj"],
        },
        "experts": "stacked [E, N, K]",
        "fp8": "mxfp8 words, E8M0 group scales 127, F32 per-row tensor scale",
        "nvfp4": "uint32 words [N, K/8], E4M3 scales [N, K/16], F32 per-row tensor scale",
        "norms": "zero-centred stored as 1 + w (F32)",
        "tied_embeddings": not (ckpt.has("lm_head.weight") or ckpt.has("lm_head.weight_packed")),
    }
    skip = _plan_vision(p, plan, ckpt, with_vision)
    if with_mtp:
        plan.layout["mtp"] = _plan_mtp(p, plan, ckpt, quantization, problems)
    else:
        skip += (MTP_SKIP,)
    return p.finish(plan, skip)


def _plan_vision(p: Planner, plan: Plan, ckpt: Checkpoint, with_vision: bool) -> tuple[tuple[str, str], ...]:
    """The vision tower's entries (docs/formats.md 5): every `model.visual.*` tensor
    (or `model.language_model.visual.*`) as a plain tensor `model.visual.*` in its source
    precision, never quantized; the patch embedding's Conv3d kernel [D, C, T, ps, ps]
    stored flattened [D, C*T*ps*ps] (the same bytes; the tower multiplies by it).
    Records layout.vision; returns the skip rules for the tensors not packed."""
    source = next((s for s in VISION_SOURCES if any(t.startswith(s) for t in ckpt.tensor_names())), None)
    if source is None:
        return ()
    if not with_vision:
        plan.layout["vision"] = {"packed": False, "reason": "left out (--no-vision)"}
        return ((source, "vision tower: left out (--no-vision)"),)
    names = sorted(t for t in ckpt.tensor_names() if t.startswith(source))
    try:
        shapes = _vision_shapes(ckpt, source, names)
    except CheckpointError as e:
        if p.problems is None:
            raise
        p.problems.append(str(e))
        p.failed.update(names)
        return ()
    for t in names:
        rest = t[len(source):]
        flat = rest == PATCH_EMBED
        p.tensor(VISION_PREFIX + rest, t, plan, reason="vision tower: source precision, never quantized"
                 + (", stored flattened [D, C*T*ps*ps]" if flat else ""), shape=shapes[rest] if flat else None)
    precision = "/".join(sorted({ckpt.dtype(t).lower() for t in names}))
    plan.layout["vision"] = {"packed": True, "prefix": VISION_PREFIX, "tensors": len(names), "precision": precision,
                             "policy": VISION_POLICY, "patch_embed": "flattened [D, C*T*ps*ps]"}
    return ()


def _vision_shapes(ckpt: Checkpoint, prefix: str, names: list[str]) -> dict[str, tuple[int, ...]]:
    """The shapes the tower's tensors (`names`, under `prefix`) are packed in
    (checkpoint/vision_config.py expected_shapes, the patch embedding flattened), checked
    against the checkpoint's names, shapes and dtypes."""
    config = ckpt.config.get("vision_config")
    where = f"{ckpt.path / 'config.json'}: vision_config"
    if not isinstance(config, dict):
        raise PackError(f"{ckpt.path / 'config.json'}: the checkpoint has vision tower tensors but no vision_config "
                        "(build with --no-vision to leave them out)")
    args = VisionArgs.from_config(config, where=where)
    shapes = expected_shapes(args)
    stored = [t[len(prefix):] for t in names]
    missing, extra = sorted(set(shapes) - set(stored)), sorted(set(stored) - set(shapes))
    if missing or extra:
        raise PackError(f"{ckpt.path}: vision tower tensors: missing {missing[:5]}, unexpected {extra[:5]} "
                        "(build with --no-vision to leave the tower out)")
    for name, shape in shapes.items():
        if ckpt.dtype(prefix + name) not in VISION_PRECISIONS:
            raise PackError(f"{ckpt.file_of(prefix + name)}: vision tower tensor {prefix}{name} is "
                            f"{ckpt.dtype(prefix + name)}; a tower is packed only from {'/'.join(VISION_PRECISIONS)} "
                            "(build with --no-vision to leave it out)")
        if tuple(ckpt.shape(prefix + name)) != shape:
            raise PackError(f"{ckpt.file_of(prefix + name)}: {prefix}{name}: shape {list(ckpt.shape(prefix + name))}, "
                            f"the vision_config says {list(shape)}")
    return shapes | {PATCH_EMBED: (args.hidden_size, args.patch_dim)}


def _plan_layer(p: Planner, plan: Plan, ckpt: Checkpoint, s: str, d: str, kind: str) -> None:
    """One decoder layer: source names under `s`, pack names under `d`."""
    p.tensor(d + "input_layernorm", s + "input_layernorm.weight", plan, "one_plus_f32", ZERO_CENTRED)
    p.tensor(d + "post_attention_layernorm", s + "post_attention_layernorm.weight", plan, "one_plus_f32", ZERO_CENTRED)
    if kind == "linear_attention":
        _plan_linear_attention(p, plan, s + "linear_attn.", d + "linear_attn.")
    else:
        _plan_full_attention(p, plan, s + "self_attn.", d + "self_attn.")
    if ckpt.architecture == QWEN3_5_MOE:
        _plan_moe(p, plan, ckpt, s + "mlp.", d + "mlp.")
    else:
        p.linear(d + "mlp.gate_up", [s + "mlp.gate_proj", s + "mlp.up_proj"], plan)
        p.linear(d + "mlp.down_proj", [s + "mlp.down_proj"], plan)


def _plan_mtp(p: Planner, plan: Plan, ckpt: Checkpoint, quantization: str, problems: list[str] | None) -> dict:
    """The MTP head's entries (module docstring), planned by a draft-rules planner that
    shares `p`'s record of used and failed sources; returns the manifest's layout.mtp."""
    if not ckpt.has("mtp.fc.weight"):
        raise PackError(f"{ckpt.path}: --with-mtp, but the checkpoint has no MTP head (no mtp.fc.weight)")
    layers = config_field(ckpt, "mtp_num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise PackError(f"{ckpt.path / 'config.json'}: mtp_num_hidden_layers {layers!r} is not a positive integer")
    m = Planner(ckpt, "draft", quantization, problems)
    m.used, m.failed = p.used, p.failed
    m.linear("mtp.fc", ["mtp.fc"], plan)
    for norm in MTP_NORMS:
        m.tensor(f"mtp.{norm}", f"mtp.{norm}.weight", plan, "one_plus_f32", ZERO_CENTRED)
    for j in range(layers):
        _plan_layer(m, plan, ckpt, f"mtp.layers.{j}.", f"mtp.layers.{j}.", "full_attention")
    return {"num_layers": layers, "concat": ["pre_fc_norm_embedding", "pre_fc_norm_hidden"]}


def _layer_types(ckpt: Checkpoint) -> list[str]:
    """Each layer's kind: the config's layer_types, else every full_attention_interval-th
    layer is full attention."""
    cfg = ckpt.text_config
    return cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(config_field(ckpt, "num_hidden_layers"))
    ]


def _plan_linear_attention(p: Planner, plan: Plan, a: str, b: str) -> None:
    """A Gated DeltaNet layer: source names under `a`, pack names under `b`."""
    p.linear(b + "in_proj", [a + "in_proj_qkv", a + "in_proj_z", a + "in_proj_b", a + "in_proj_a"], plan)
    p.linear(b + "out_proj", [a + "out_proj"], plan)
    p.tensor(b + "conv1d", a + "conv1d.weight", plan, reason="depthwise conv weight [C, 1, K], never quantized")
    p.tensor(b + "A_log", a + "A_log", plan, "f32", "decay parameter in F32, never quantized")
    p.tensor(b + "dt_bias", a + "dt_bias", plan, "f32", "decay bias in F32, never quantized")
    p.tensor(b + "norm", a + "norm.weight", plan, "f32", "gated RMSNorm weight (plain w) in F32")


def _plan_full_attention(p: Planner, plan: Plan, a: str, b: str) -> None:
    p.linear(b + "qkv", [a + "q_proj", a + "k_proj", a + "v_proj"], plan)
    p.linear(b + "o_proj", [a + "o_proj"], plan)
    p.tensor(b + "q_norm", a + "q_norm.weight", plan, "one_plus_f32", ZERO_CENTRED)
    p.tensor(b + "k_norm", a + "k_norm.weight", plan, "one_plus_f32", ZERO_CENTRED)


def _plan_moe(p: Planner, plan: Plan, ckpt: Checkpoint, m: str, n: str) -> None:
    """The router, the shared expert and the experts (fused 3-D in the source, or one per expert)."""
    p.linear(n + "gate", [m + "gate"], plan)
    p.linear(n + "shared_expert_gate", [m + "shared_expert_gate"], plan)
    p.linear(n + "shared_expert.gate_up", [m + "shared_expert.gate_proj", m + "shared_expert.up_proj"], plan)
    p.linear(n + "shared_expert.down_proj", [m + "shared_expert.down_proj"], plan)
    if ckpt.has_fused_experts(m + "experts.gate_up_proj"):
        p.fused_experts(n + "experts.gate_up", m + "experts.gate_up_proj", plan)
        p.fused_experts(n + "experts.down", m + "experts.down_proj", plan)
    else:
        count = config_field(ckpt, "num_experts")
        p.experts(n + "experts.gate_up",
                  [[f"{m}experts.{e}.gate_proj", f"{m}experts.{e}.up_proj"] for e in range(count)], plan)
        p.experts(n + "experts.down", [[f"{m}experts.{e}.down_proj"] for e in range(count)], plan)
