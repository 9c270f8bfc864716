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
"""

from __future__ import annotations

from ..checkpoint import Checkpoint
from ..checkpoint.config import QWEN3_5_MOE
from .recipe import PackError, Plan, Planner

ZERO_CENTRED = "zero-centred RMSNorm weight stored as 1 + w in F32"
SKIP = (
    ("model.visual.", "vision tower: the runtime is text-only"),
    ("model.language_model.visual.", "vision tower: the runtime is text-only"),
    ("mtp.", "MTP head: not used by the runtime (DSpark drafts instead)"),
)


def source_prefix(ckpt: Checkpoint) -> str:
    for prefix in ("model.language_model.", "model."):
        if ckpt.has(prefix + "embed_tokens.weight"):
            return prefix
    raise PackError(f"{ckpt.path}: no embed_tokens.weight under model.language_model. or model.")


def config_field(ckpt: Checkpoint, name: str):
    if name not in ckpt.text_config:
        raise PackError(f"{ckpt.path / 'config.json'}: the text config has no field {name}")
    return ckpt.text_config[name]


def plan_target(ckpt: Checkpoint, quantization: str, problems: list[str] | None = None) -> Plan:
    p = Planner(ckpt, "target", quantization, problems)
    plan = Plan("qwen3_5-hybrid", "target", ckpt.architecture, quantization)
    src = source_prefix(ckpt)
    moe = ckpt.architecture == QWEN3_5_MOE

    p.linear("model.embed_tokens", [src + "embed_tokens"], plan)
    for i, kind in enumerate(_layer_types(ckpt)):
        s, d = f"{src}layers.{i}.", f"model.layers.{i}."
        p.tensor(d + "input_layernorm", s + "input_layernorm.weight", plan, "one_plus_f32", ZERO_CENTRED)
        p.tensor(d + "post_attention_layernorm", s + "post_attention_layernorm.weight", plan, "one_plus_f32", ZERO_CENTRED)
        if kind == "linear_attention":
            _plan_linear_attention(p, plan, s + "linear_attn.", d + "linear_attn.")
        else:
            _plan_full_attention(p, plan, s + "self_attn.", d + "self_attn.")
        if moe:
            _plan_moe(p, plan, ckpt, s + "mlp.", d + "mlp.")
        else:
            p.linear(d + "mlp.gate_up", [s + "mlp.gate_proj", s + "mlp.up_proj"], plan)
            p.linear(d + "mlp.down_proj", [s + "mlp.down_proj"], plan)
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
    return p.finish(plan, SKIP)


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
