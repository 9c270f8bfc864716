"""DSpark / DFlash drafts (DeepSpec-native, speculators, z-lab DFlash) as pack entries.

All three formats use the same flat names (`layers.{i}....`, `fc`, `hidden_norm`,
`norm`, optional `embed_tokens` / `lm_head`, `markov_head.*`, `confidence_head.*`,
`d2t` / `t2d`). The pack fuses `self_attn.qkv` (q|k|v) and `mlp.gate_up` (gate|up);
draft norms are plain weights, stored as F32. The manifest's `layout.draft` records
the draft settings in one convention (DeepSpec layer ids: id i = output of target
layer i), whatever the source format, and every decision that needs the tensors:
the heads (a Markov head is read from the `markov_head.*` tensors, whatever the
config's label), per layer the sliding window and whether the block is causal,
whether slot 0 predicts (`sample_from_anchor`) and the block input's scale. Where the
formats' configs differ (the taps, the layer fields, the block mask, an unstated
sample_from_anchor) is not said here: this recipe asks the draft's format
(pack/draft_formats, DRAFT_FORMATS, one file a format).
"""

from __future__ import annotations

import math

from ..checkpoint import Checkpoint
from .draft_formats import DRAFT_FORMATS, NESTS, DraftFormat, config_field
from .recipe import PackError, Plan, Planner

PLAIN_NORM = "draft RMSNorm weight (plain w) stored in F32"
# the nested-block fields a draft may carry; any other one changes what the draft computes
# in some engine (vLLM's use_swa, swa_window_size, attention_sink_bias, DFlash2's selector
# and conv fields...) and is refused, never ignored
NESTED_FIELDS = ("block_size", "mask_token_id", "target_layer_ids", "causal", "input_embedding_scale",
                 "use_aux_hidden_state", "markov_rank", "markov_head_type", "enable_confidence_head",
                 "confidence_head_with_markov", "sample_from_anchor")
HEAD_PROJECTIONS = {"gated": "markov_head.gate_proj", "rnn": "markov_head.joint_proj"}


def _where(ckpt: Checkpoint) -> str:
    return f"{ckpt.path}/config.json"


def _check_nested(ckpt: Checkpoint, cfg: dict) -> None:
    for nest in NESTS:
        block = cfg.get(nest)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise PackError(f"{_where(ckpt)}: {nest} is not an object")
        unknown = sorted(k for k in block if k not in NESTED_FIELDS)
        if unknown:
            raise PackError(f"{_where(ckpt)}: {nest}.{unknown[0]} is not supported (supported {nest} fields: "
                            f"{', '.join(NESTED_FIELDS)})")
    if config_field(cfg, "use_aux_hidden_state") is False:
        raise PackError(f"{_where(ckpt)}: use_aux_hidden_state false (a draft without target features) "
                        "is not supported")
    if cfg.get("logit_scale") not in (None, 1, 1.0):
        raise PackError(f"{_where(ckpt)}: logit_scale {cfg['logit_scale']} is not supported (only 1)")
    if cfg.get("is_neox_style") is False:
        raise PackError(f"{_where(ckpt)}: is_neox_style false (interleaved RoPE) is not supported")


def _input_embedding_scale(ckpt: Checkpoint, cfg: dict) -> float:
    """DFlash's `input_embedding_scale`: the block's input embeddings (anchor and mask
    rows) are multiplied by it before the first layer (z-lab DFlash2 and vLLM's plugin
    for it); 1 when absent."""
    scale = config_field(cfg, "input_embedding_scale")
    if scale is None:
        return 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise PackError(f"{_where(ckpt)}: input_embedding_scale {scale!r} must be a positive finite number")
    return float(scale)


def _layer_attention(ckpt: Checkpoint, fmt: DraftFormat, cfg: dict, layer_cfg: dict,
                     layers: int) -> tuple[list, list]:
    """Per layer (context rows the block sees: an int window or None = all; whether the
    block is causal: slot k sees block slots <= k, as the format states it).

    The window: a `layer_types` "sliding_attention" layer, with `sliding_window` only when
    `use_sliding_window` is true (transformers' Qwen3Config, which speculators, z-lab and
    vLLM build the layer config with, drops the window otherwise)."""
    where = _where(ckpt)
    types = layer_cfg.get("layer_types")
    if types is None:
        if layer_cfg.get("use_sliding_window"):
            raise PackError(f"{where}: use_sliding_window without layer_types (which layers slide is not stated)")
        types = ["full_attention"] * layers
    if len(types) != layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise PackError(f"{where}: layer_types {types} must name full_attention or sliding_attention for each "
                        f"of the draft's {layers} layers")
    if layer_cfg.get("use_sliding_window") and "sliding_window" not in layer_cfg:
        raise PackError(f"{where}: use_sliding_window without sliding_window (Qwen3Config would default it)")
    window = layer_cfg.get("sliding_window") if layer_cfg.get("use_sliding_window") else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise PackError(f"{where}: sliding_window {window!r} must be a positive integer")
    sliding = [t == "sliding_attention" for t in types]
    windows = [window if s else None for s in sliding]
    return windows, fmt.block_causal(where, cfg, layer_cfg, sliding, windows)


def _speculative_tokens(ckpt: Checkpoint, spec: dict) -> int | None:
    """speculative_tokens of the default proposal method of a speculators_config."""
    methods = spec.get("proposal_methods") or []
    default = spec.get("default_proposal_method")
    chosen = [m for m in methods if isinstance(m, dict) and (default is None or m.get("proposal_type") == default)]
    if not methods:
        return None
    if len(chosen) != 1:
        raise PackError(f"{_where(ckpt)}: speculators_config.default_proposal_method {default!r} does not name "
                        "exactly one of speculators_config.proposal_methods")
    tokens = chosen[0].get("speculative_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)):
        raise PackError(f"{_where(ckpt)}: speculators_config.proposal_methods[{default}].speculative_tokens "
                        f"{tokens!r} is not an integer")
    return tokens


def _sample_from_anchor(ckpt: Checkpoint, fmt: DraftFormat, cfg: dict, block_size: int) -> bool:
    """Whether slot 0 predicts too (DSpark) or is dropped (DFlash: the anchor is the bonus
    token). Read from every field that states it; they must agree: `sample_from_anchor`,
    vLLM's `dspark_bonus_anchor` (its negation) and block_size minus the default proposal
    method's speculative_tokens (0: true, 1: false). Unstated: as the format says
    (DraftFormat.unstated_sample_from_anchor)."""
    where = _where(ckpt)
    stated = {}
    value = config_field(cfg, "sample_from_anchor")
    if value is not None:
        stated[f"sample_from_anchor {value}"] = value
    if cfg.get("dspark_bonus_anchor") is not None:
        stated[f"dspark_bonus_anchor {cfg['dspark_bonus_anchor']}"] = not cfg["dspark_bonus_anchor"]
    spec = cfg.get("speculators_config")
    tokens = _speculative_tokens(ckpt, spec) if isinstance(spec, dict) else None
    if tokens is not None:
        if block_size - tokens not in (0, 1):
            raise PackError(f"{where}: block_size {block_size} and speculators_config speculative_tokens {tokens} "
                            "differ by neither 0 (sample_from_anchor) nor 1 (the anchor is the bonus token)")
        stated[f"block_size {block_size} - speculative_tokens {tokens}"] = block_size == tokens
    if any(not isinstance(v, bool) for v in stated.values()):
        raise PackError(f"{where}: {', '.join(stated)}: must be true or false")
    if len(set(stated.values())) > 1:
        raise PackError(f"{where}: {' and '.join(stated)} contradict each other on whether slot 0 predicts "
                        "(sample_from_anchor)")
    if stated:
        return next(iter(stated.values()))
    return fmt.unstated_sample_from_anchor(ckpt, where)


def _heads(ckpt: Checkpoint, cfg: dict, hidden: int) -> dict:
    """Markov and confidence heads from the tensors present; a config field that says
    otherwise is a contradiction (a DFlash-labelled config can carry DSpark heads)."""
    where = _where(ckpt)
    heads = ["markov_head.markov_w1", "confidence_head.proj", *HEAD_PROJECTIONS.values()]
    modules = {name: ckpt.module(name) for name in heads if ckpt.has_module(name)}  # only these are checked here

    w1 = modules.get("markov_head.markov_w1")
    rank = 0 if w1 is None else int(w1.shape[1])
    stated = config_field(cfg, "markov_rank")
    if stated is not None and int(stated) != rank:
        has = f"markov_head.markov_w1.weight has rank {rank}" if w1 else "there is no markov_head.markov_w1.weight"
        raise PackError(f"{where}: markov_rank {stated} but {has}")
    head_type = config_field(cfg, "markov_head_type") or "vanilla"
    for kind, module in HEAD_PROJECTIONS.items():
        if (module in modules) != (rank > 0 and head_type == kind):
            raise PackError(f"{where}: markov_head_type {head_type!r} (markov rank {rank}) contradicts "
                            f"{module}.weight being {'present' if module in modules else 'absent'}")
    proj = modules.get("confidence_head.proj")
    enabled = config_field(cfg, "enable_confidence_head")
    if enabled is not None and bool(enabled) != (proj is not None):
        raise PackError(f"{where}: enable_confidence_head {enabled} but confidence_head.proj.weight is "
                        f"{'present' if proj else 'absent'}")
    with_markov = False
    if proj is not None:
        width = int(proj.shape[1])
        if width not in (hidden, hidden + rank):
            raise PackError(f"{where}: confidence_head.proj.weight has {width} columns, neither hidden_size "
                            f"{hidden} nor hidden_size + markov rank {hidden + rank}")
        with_markov = rank > 0 and width == hidden + rank
        stated = config_field(cfg, "confidence_head_with_markov")
        if stated is not None and bool(stated) != with_markov:
            raise PackError(f"{where}: confidence_head_with_markov {stated} but confidence_head.proj.weight has "
                            f"{width} columns (hidden_size {hidden}, markov rank {rank})")
    return {"markov_rank": rank, "markov_head_type": head_type, "enable_confidence_head": proj is not None,
            "confidence_head_with_markov": with_markov}


def draft_settings(ckpt: Checkpoint) -> dict:
    """Draft settings normalised to the DeepSpec conventions (docs/drafts.md section 3)."""
    cfg, where, fmt = ckpt.config, _where(ckpt), DRAFT_FORMATS[ckpt.architecture]
    _check_nested(ckpt, cfg)
    taps = fmt.taps(where, cfg)
    layer_cfg = fmt.layer_config(cfg)
    if not taps:
        raise PackError(f"{where}: draft has no target_layer_ids")
    settings = {field: config_field(cfg, field) for field in ("block_size", "mask_token_id")}
    for field in ("block_size", "mask_token_id"):
        if settings[field] is None:
            raise PackError(f"{where}: draft config has no {field} (top level or dflash_config)")
    hidden = layer_cfg.get("hidden_size")
    if hidden is None:
        raise PackError(f"{where}: draft config has no hidden_size")
    layers = 0
    while ckpt.has(f"layers.{layers}.input_layernorm.weight"):
        layers += 1
    if layers == 0:
        raise PackError(f"{ckpt.path}: draft has no decoder layers (layers.0.input_layernorm.weight)")
    windows, causal = _layer_attention(ckpt, fmt, cfg, layer_cfg, layers)
    return {
        "target_layer_ids": [int(t) for t in taps],
        **settings,
        **_heads(ckpt, cfg, int(hidden)),
        "draft_vocab_size": cfg.get("draft_vocab_size"),
        "sample_from_anchor": _sample_from_anchor(ckpt, fmt, cfg, int(settings["block_size"])),
        "input_embedding_scale": _input_embedding_scale(ckpt, cfg),
        "hidden_size": hidden,
        "num_hidden_layers": layer_cfg.get("num_hidden_layers"),
        "vocab_size": layer_cfg.get("vocab_size"),
        "num_layers": layers,
        "sliding_windows": windows,
        "block_causal": causal,
    }


def plan_draft(ckpt: Checkpoint, quantization: str, problems: list[str] | None = None) -> Plan:
    settings = draft_settings(ckpt)
    p = Planner(ckpt, "draft", quantization, problems)
    plan = Plan("dspark-draft", "draft", ckpt.architecture, quantization)
    for name in ("embed_tokens", "lm_head", "fc"):
        if p.has_module(name):
            p.linear(name, [name], plan)
    if not p.has_module("fc"):
        raise PackError(f"{ckpt.path}: draft has no fc.weight (context projection)")
    for name in ("hidden_norm", "norm", "verifier_norm"):
        if ckpt.has(name + ".weight"):
            p.tensor(name, name + ".weight", plan, "f32", PLAIN_NORM)
    for layer in range(settings["num_layers"]):
        s = f"layers.{layer}."
        p.linear(s + "self_attn.qkv", [s + "self_attn.q_proj", s + "self_attn.k_proj", s + "self_attn.v_proj"], plan)
        p.linear(s + "self_attn.o_proj", [s + "self_attn.o_proj"], plan)
        p.linear(s + "mlp.gate_up", [s + "mlp.gate_proj", s + "mlp.up_proj"], plan)
        p.linear(s + "mlp.down_proj", [s + "mlp.down_proj"], plan)
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            p.tensor(s + norm, s + norm + ".weight", plan, "f32", PLAIN_NORM)
    for name in ("markov_head.markov_w1", "markov_head.markov_w2", "markov_head.gate_proj",
                 "markov_head.joint_proj", "confidence_head.proj"):
        if p.has_module(name):
            p.linear(name, [name], plan)
            if ckpt.has(name + ".bias"):
                p.tensor(name + ".bias", name + ".bias", plan, "f32", "bias in F32, never quantized")
    for name in ("d2t", "t2d"):
        if ckpt.has(name):
            p.tensor(name, name, plan, reason="draft-to-target vocabulary map, stored as is")
    # speculators' use_draft_vocab: a draft_vocab_size other than vocab_size is reduced and needs its d2t;
    # equal to it, the draft predicts the whole vocabulary (no lm_head, d2t or t2d of its own)
    reduced = settings["draft_vocab_size"]
    if reduced and reduced != settings["vocab_size"] and not ckpt.has("d2t"):
        raise PackError(f"{_where(ckpt)}: draft_vocab_size {reduced} is not the draft's vocab_size "
                        f"({settings['vocab_size']}), and there is no d2t tensor mapping a reduced vocabulary")
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
