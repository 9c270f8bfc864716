"""DSpark / DFlash drafts (DeepSpec-native, speculators, z-lab DFlash) as pack entries.

All three formats use the same flat names (`layers.{i}....`, `fc`, `hidden_norm`,
`norm`, optional `embed_tokens` / `lm_head`, `markov_head.*`, `confidence_head.*`,
`d2t` / `t2d`). The pack fuses `self_attn.qkv` (q|k|v) and `mlp.gate_up` (gate|up);
draft norms are plain weights, stored as F32. The manifest's `layout.draft` records
the draft settings in one convention (DeepSpec layer ids: id i = output of target
layer i), whatever the source format.
"""

from __future__ import annotations

from ..checkpoint import Checkpoint
from .recipe import PackError, Plan, Planner

DRAFT_ARCHITECTURES = ("dspark", "dspark-speculators", "dflash")
PLAIN_NORM = "draft RMSNorm weight (plain w) stored in F32"


def _get(cfg: dict, key: str, *nests: str):
    """A field at the top level or under one of the nested config blocks."""
    if key in cfg:
        return cfg[key]
    for nest in nests:
        block = cfg.get(nest) or {}
        if key in block:
            return block[key]
    return None


def draft_settings(ckpt: Checkpoint) -> dict:
    """Draft settings normalised to the DeepSpec conventions (dspark.md section 3)."""
    cfg = ckpt.config
    nests = ("dflash_config", "dspark_config", "speculators_config")
    if ckpt.architecture == "dspark-speculators":
        aux = cfg.get("aux_hidden_state_layer_ids")
        if aux is None:
            raise PackError(f"{ckpt.path}/config.json: speculators draft without aux_hidden_state_layer_ids")
        taps = [int(i) - 1 for i in aux]  # speculators counts the embedding as layer 0
        layer_cfg = cfg.get("transformer_layer_config") or {}
    else:
        taps = _get(cfg, "target_layer_ids", *nests)
        layer_cfg = cfg
    if not taps:
        raise PackError(f"{ckpt.path}/config.json: draft has no target_layer_ids")
    settings = {
        "target_layer_ids": [int(t) for t in taps],
        "block_size": _get(cfg, "block_size", *nests),
        "mask_token_id": _get(cfg, "mask_token_id", *nests),
        "markov_rank": int(_get(cfg, "markov_rank", *nests) or 0),
        "markov_head_type": _get(cfg, "markov_head_type", *nests) or "vanilla",
        "enable_confidence_head": bool(_get(cfg, "enable_confidence_head", *nests)),
        "confidence_head_with_markov": bool(_get(cfg, "confidence_head_with_markov", *nests)),
        "draft_vocab_size": cfg.get("draft_vocab_size"),
        "sample_from_anchor": ckpt.architecture != "dflash" if cfg.get("sample_from_anchor") is None else bool(cfg["sample_from_anchor"]),
        "hidden_size": layer_cfg.get("hidden_size"),
        "num_hidden_layers": layer_cfg.get("num_hidden_layers"),
        "sliding_window": layer_cfg.get("sliding_window") if "sliding_attention" in (layer_cfg.get("layer_types") or []) else None,
    }
    for field in ("block_size", "mask_token_id"):
        if settings[field] is None:
            raise PackError(f"{ckpt.path}/config.json: draft config has no {field} (top level or dflash_config)")
    return settings


def plan_draft(ckpt: Checkpoint, quantization: str) -> Plan:
    settings = draft_settings(ckpt)
    p = Planner(ckpt, "draft", quantization)
    plan = Plan("dspark-draft", "draft", ckpt.architecture, quantization)
    for name in ("embed_tokens", "lm_head", "fc"):
        if p.has_module(name):
            p.linear(name, [name], plan)
    if not p.has_module("fc"):
        raise PackError(f"{ckpt.path}: draft has no fc.weight (context projection)")
    for name in ("hidden_norm", "norm", "verifier_norm"):
        if ckpt.has(name + ".weight"):
            p.tensor(name, name + ".weight", plan, "f32", PLAIN_NORM)
    layer = 0
    while ckpt.has(f"layers.{layer}.input_layernorm.weight"):
        s = f"layers.{layer}."
        p.linear(s + "self_attn.qkv", [s + "self_attn.q_proj", s + "self_attn.k_proj", s + "self_attn.v_proj"], plan)
        p.linear(s + "self_attn.o_proj", [s + "self_attn.o_proj"], plan)
        p.linear(s + "mlp.gate_up", [s + "mlp.gate_proj", s + "mlp.up_proj"], plan)
        p.linear(s + "mlp.down_proj", [s + "mlp.down_proj"], plan)
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            p.tensor(s + norm, s + norm + ".weight", plan, "f32", PLAIN_NORM)
        layer += 1
    if layer == 0:
        raise PackError(f"{ckpt.path}: draft has no decoder layers (layers.0.input_layernorm.weight)")
    for name in ("markov_head.markov_w1", "markov_head.markov_w2", "markov_head.gate_proj",
                 "markov_head.joint_proj", "confidence_head.proj"):
        if p.has_module(name):
            p.linear(name, [name], plan)
            if ckpt.has(name + ".bias"):
                p.tensor(name + ".bias", name + ".bias", plan, "f32", "bias in F32, never quantized")
    for name in ("d2t", "t2d"):
        if ckpt.has(name):
            p.tensor(name, name, plan, reason="draft-to-target vocabulary map, stored as is")
    if settings["draft_vocab_size"] and not ckpt.has("d2t"):
        raise PackError(f"{ckpt.path}: reduced draft vocabulary (draft_vocab_size) without a d2t tensor")
    settings["num_layers"] = layer
    settings["has_embedding"] = p.has_module("embed_tokens")
    settings["has_lm_head"] = p.has_module("lm_head")
    plan.layout = {
        "fusions": {"self_attn.qkv": ["q_proj", "k_proj", "v_proj"], "mlp.gate_up": ["gate_proj", "up_proj"]},
        "fp8": "mxfp8 words, E8M0 group scales 127, F32 per-row tensor scale",
        "nvfp4": "uint32 words [N, K/8], E4M3 scales [N, K/16], F32 per-row tensor scale",
        "norms": "plain weights in F32",
        "draft": settings,
    }
    return p.finish(plan)
