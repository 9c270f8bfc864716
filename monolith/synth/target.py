"""Synthetic Qwen3.5/3.6 hybrid targets (MoE and dense) in every checkpoint format.

The tensor names, shapes and config fields are those of the real releases (checked
against transformers' Qwen3_5Moe* / Qwen3_5* classes by the tests). Which linears a
format quantizes is read back from the quantization config the format writes, with the
same rules a loader applies, so config and tensors agree by construction.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from . import tokenizer as tok
from .presets import Preset, resolve_preset
from .quant import (
    MODELOPT_PRODUCER,
    compressed_tensors_config,
    ct_scheme,
    modelopt_mirror,
    modelopt_mixed_config,
    modelopt_nvfp4_config,
    modelopt_scheme,
)
from .values import Param, bf16_bits, check_seed, generate
from .writers import Unit, default_shards, write_checkpoint, write_json

FORMATS = ("bf16", "modelopt-nvfp4", "modelopt-mixed", "compressed-tensors", "compressed-tensors-mixed")
EXPERT_LAYOUTS = ("fused", "per-expert")
LM = "model.language_model"


# ----------------------------------------------------------------------------- config


def text_config(p: Preset, dense: bool) -> dict:
    ids = tok.special_token_ids()
    cfg = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": ids[tok.PAD_TOKEN],
        "dtype": "bfloat16",
        "eos_token_id": ids[tok.EOS_TOKEN],
        "full_attention_interval": p.full_attention_interval,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "initializer_range": 0.02,
        "layer_types": p.layer_types,
        "linear_conv_kernel_dim": p.linear_conv_kernel_dim,
        "linear_key_head_dim": p.linear_key_head_dim,
        "linear_num_key_heads": p.linear_num_key_heads,
        "linear_num_value_heads": p.linear_num_value_heads,
        "linear_value_head_dim": p.linear_value_head_dim,
        "max_position_embeddings": p.max_position_embeddings,
        "model_type": "qwen3_5_text" if dense else "qwen3_5_moe_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": p.num_attention_heads,
        "num_hidden_layers": p.num_hidden_layers,
        "num_key_value_heads": p.num_key_value_heads,
        "rms_norm_eps": p.rms_norm_eps,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": p.mrope_section,
            "partial_rotary_factor": p.partial_rotary_factor,
            "rope_theta": p.rope_theta,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": p.vocab_size,
    }
    if dense:
        cfg["intermediate_size"] = p.intermediate_size
    else:
        cfg.update(
            moe_intermediate_size=p.moe_intermediate_size,
            num_experts=p.num_experts,
            num_experts_per_tok=p.num_experts_per_tok,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
            shared_expert_intermediate_size=p.shared_expert_intermediate_size,
        )
    return cfg


def vision_config(p: Preset, dense: bool) -> dict:
    return {
        "depth": p.vision_depth,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": p.vision_hidden_size,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": p.vision_intermediate_size,
        "model_type": "qwen3_5_vision" if dense else "qwen3_5_moe_vision",
        "num_heads": p.vision_num_heads,
        "num_position_embeddings": p.vision_num_position_embeddings,
        "out_hidden_size": p.hidden_size,
        "patch_size": p.vision_patch_size,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }


def target_config(p: Preset, dense: bool) -> dict:
    v = p.vocab_size
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration" if dense else "Qwen3_5MoeForConditionalGeneration"],
        "dtype": "bfloat16",
        "image_token_id": v - 2,
        "model_type": "qwen3_5" if dense else "qwen3_5_moe",
        "text_config": text_config(p, dense),
        "tie_word_embeddings": False,
        "video_token_id": v - 1,
        "vision_config": vision_config(p, dense),
        "vision_end_token_id": v - 3,
        "vision_start_token_id": v - 4,
    }


# ---------------------------------------------------------------------------- tensors


def _linear(module: str, out: int, inp: int, **kw) -> Param:
    return Param(f"{module}.weight", (out, inp), "linear", module=module, **kw)


def decoder_layer(prefix: str, kind: str, p: Preset, dense: bool) -> list[Param]:
    h = p.hidden_size
    params = [Param(f"{prefix}.input_layernorm.weight", (h,), "norm0")]
    if kind == "linear_attention":
        la = f"{prefix}.linear_attn"
        key_dim = p.linear_num_key_heads * p.linear_key_head_dim
        value_dim = p.linear_num_value_heads * p.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        hv = p.linear_num_value_heads
        params += [
            _linear(f"{la}.in_proj_qkv", conv_dim, h),
            _linear(f"{la}.in_proj_z", value_dim, h),
            _linear(f"{la}.in_proj_b", hv, h),
            _linear(f"{la}.in_proj_a", hv, h),
            Param(f"{la}.conv1d.weight", (conv_dim, 1, p.linear_conv_kernel_dim), "linear"),
            Param(f"{la}.dt_bias", (hv,), "dt_bias"),
            Param(f"{la}.A_log", (hv,), "a_log"),
            Param(f"{la}.norm.weight", (p.linear_value_head_dim,), "norm1"),
            _linear(f"{la}.out_proj", h, value_dim),
        ]
    else:
        sa = f"{prefix}.self_attn"
        q_dim = p.num_attention_heads * p.head_dim
        kv_dim = p.num_key_value_heads * p.head_dim
        params += [
            _linear(f"{sa}.q_proj", 2 * q_dim, h),  # per head: query then gate
            _linear(f"{sa}.k_proj", kv_dim, h),
            _linear(f"{sa}.v_proj", kv_dim, h),
            _linear(f"{sa}.o_proj", h, q_dim),
            Param(f"{sa}.q_norm.weight", (p.head_dim,), "norm0"),
            Param(f"{sa}.k_norm.weight", (p.head_dim,), "norm0"),
        ]
    params.append(Param(f"{prefix}.post_attention_layernorm.weight", (h,), "norm0"))
    mlp = f"{prefix}.mlp"
    if dense:
        i = p.intermediate_size
        params += [
            _linear(f"{mlp}.gate_proj", i, h),
            _linear(f"{mlp}.up_proj", i, h),
            _linear(f"{mlp}.down_proj", h, i),
        ]
        return params
    i, s = p.moe_intermediate_size, p.shared_expert_intermediate_size
    params.append(_linear(f"{mlp}.gate", p.num_experts, h))
    for e in range(p.num_experts):
        ex = f"{mlp}.experts.{e}"
        params += [_linear(f"{ex}.gate_proj", i, h), _linear(f"{ex}.up_proj", i, h), _linear(f"{ex}.down_proj", h, i)]
    se = f"{mlp}.shared_expert"
    params += [
        _linear(f"{se}.gate_proj", s, h),
        _linear(f"{se}.up_proj", s, h),
        _linear(f"{se}.down_proj", h, s),
        _linear(f"{mlp}.shared_expert_gate", 1, h),
    ]
    return params


def vision_params(p: Preset) -> list[Param]:
    d, iv, t, ps = p.vision_hidden_size, p.vision_intermediate_size, 2, p.vision_patch_size
    merged = 4 * d  # spatial_merge_size ** 2
    v = "model.visual"

    def linear_with_bias(m, out, inp):
        return [_linear(m, out, inp), Param(f"{m}.bias", (out,), "bias")]

    def layer_norm(m, dim):
        return [Param(f"{m}.weight", (dim,), "norm1"), Param(f"{m}.bias", (dim,), "bias")]

    params = [
        Param(f"{v}.patch_embed.proj.weight", (d, 3, t, ps, ps), "linear", gain=(3 * t * ps) ** -0.5),
        Param(f"{v}.patch_embed.proj.bias", (d,), "bias"),
        Param(f"{v}.pos_embed.weight", (p.vision_num_position_embeddings, d), "embed"),
    ]
    for b in range(p.vision_depth):
        blk = f"{v}.blocks.{b}"
        params += layer_norm(f"{blk}.norm1", d) + layer_norm(f"{blk}.norm2", d)
        params += linear_with_bias(f"{blk}.attn.qkv", 3 * d, d) + linear_with_bias(f"{blk}.attn.proj", d, d)
        params += linear_with_bias(f"{blk}.mlp.linear_fc1", iv, d) + linear_with_bias(f"{blk}.mlp.linear_fc2", d, iv)
    params += layer_norm(f"{v}.merger.norm", d)
    params += linear_with_bias(f"{v}.merger.linear_fc1", merged, merged)
    params += linear_with_bias(f"{v}.merger.linear_fc2", p.hidden_size, merged)
    return params


def mtp_params(p: Preset, dense: bool) -> list[Param]:
    h = p.hidden_size
    return [
        _linear("mtp.fc", h, 2 * h),
        Param("mtp.pre_fc_norm_embedding.weight", (h,), "norm0"),
        Param("mtp.pre_fc_norm_hidden.weight", (h,), "norm0"),
        *decoder_layer("mtp.layers.0", "full_attention", p, dense),
        Param("mtp.norm.weight", (h,), "norm0"),
    ]


def target_params(p: Preset, dense: bool) -> list[Param]:
    params = [Param(f"{LM}.embed_tokens.weight", (p.vocab_size, p.hidden_size), "embed")]
    for i, kind in enumerate(p.layer_types):
        params += decoder_layer(f"{LM}.layers.{i}", kind, p, dense)
    params.append(Param(f"{LM}.norm.weight", (p.hidden_size,), "norm0"))
    params.append(_linear("lm_head", p.vocab_size, p.hidden_size, gain=p.lm_head_gain))
    return params + vision_params(p) + mtp_params(p, dense)


# linears that read the same input get one ModelOpt tensor scale
_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
_SHARED_INPUT.update({f"in_proj_{x}": "in_proj" for x in ("qkv", "z", "b", "a")})


def _shares_input(last: Unit, prm: Param, scheme: str) -> bool:
    """Does prm read the same input as the linears of `last` (same parent, one group)?"""
    prev = last.params[-1].module
    if last.scheme != scheme or last.fused or prev is None:
        return False
    parent, _, leaf = prm.module.rpartition(".")
    prev_parent, _, prev_leaf = prev.rpartition(".")
    group = _SHARED_INPUT.get(leaf)
    return parent == prev_parent and group is not None and group == _SHARED_INPUT.get(prev_leaf)


def plan_units(params: list[Param], scheme_of, share_scales: bool, fuse_experts) -> list[Unit]:
    """fuse_experts: True/False, or a predicate on a layer's `...mlp.experts` prefix (the
    nvidia export keeps its MTP layer's experts fused and the others per expert)."""
    fuse = fuse_experts if callable(fuse_experts) else (lambda prefix: bool(fuse_experts))
    units: list[Unit] = []
    pending: list[Param] = []  # per-expert params of one layer, when fusing
    for prm in params:
        expert = re.match(r"(.*\.mlp\.experts)\.\d+\.", prm.name)
        if expert and fuse(expert.group(1)):
            pending.append(prm)
            if len(pending) > 1 and not pending[-2].name.startswith(expert.group(1) + "."):
                raise AssertionError("synth: experts of two layers interleaved")
            continue
        if pending:
            units.append(Unit(tuple(pending), fused=re.match(r"(.*\.mlp\.experts)\.", pending[0].name).group(1)))
            pending = []
        scheme = scheme_of(prm.module) if prm.module else "bf16"
        if scheme != "bf16" and share_scales and units and _shares_input(units[-1], prm, scheme):
            units[-1] = Unit(units[-1].params + (prm,), scheme)
            continue
        units.append(Unit((prm,), scheme))
    if pending:
        units.append(Unit(tuple(pending), fused=re.match(r"(.*\.mlp\.experts)\.", pending[0].name).group(1)))
    return units


# ---------------------------------------------------------------------------- writing


def write_target(
    out_dir,
    preset="tiny",
    format="bf16",
    dense=None,
    expert_layout=None,
    seed=0,
    shards=None,
) -> Path:
    """Write a synthetic target checkpoint into out_dir and return its path.

    dense: None means MoE, except for "compressed-tensors-mixed" whose default is the
    dense model (like the 27B "Dynamic NVFP4" export). expert_layout: "fused" (official
    BF16 release) or "per-expert" (quantized exports; the only layout they use).
    shards: number of safetensors files (default 1 for compressed-tensors formats, 2
    otherwise, more when a shard would exceed 256 MiB)."""
    if format not in FORMATS:
        raise ValueError(f"unknown target format {format!r} (known: {', '.join(FORMATS)})")
    p = resolve_preset(preset)
    seed = check_seed(seed)
    dense = (format == "compressed-tensors-mixed") if dense is None else bool(dense)
    check_vocab(p)
    if dense and expert_layout is not None:
        raise ValueError("expert_layout applies to MoE targets only")
    layout = expert_layout or ("fused" if format == "bf16" else "per-expert")
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"unknown expert layout {layout!r} (known: {', '.join(EXPERT_LAYOUTS)})")
    if layout == "fused" and format != "bf16":
        raise ValueError(f"{format} checkpoints store experts per expert; the fused layout exists only in BF16")
    if shards is not None and (not isinstance(shards, int) or shards < 1):
        raise ValueError(f"shards must be a positive integer, got {shards!r}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = target_params(p, dense)
    config = target_config(p, dense)
    extra = {}
    hf_quant = None
    if format == "bf16":
        scheme_of, share = (lambda m: "bf16"), False
    elif format.startswith("modelopt"):
        q = modelopt_nvfp4_config(dense) if format == "modelopt-nvfp4" else modelopt_mixed_config(params, dense)
        hf_quant = {"producer": MODELOPT_PRODUCER, "quantization": q}
        config["quantization_config"] = modelopt_mirror(hf_quant)
        scheme_of, share = (lambda m: modelopt_scheme(m, q)), True
        if format == "modelopt-mixed":
            extra = kv_cache_scales(params, "modelopt")
    else:
        qc = compressed_tensors_config(mixed=format == "compressed-tensors-mixed")
        config["quantization_config"] = qc
        scheme_of, share = (lambda m: ct_scheme(m, qc)), False
    units = plan_units(params, scheme_of, share_scales=share, fuse_experts=layout == "fused" and not dense)
    if shards is None:
        shards = default_shards(units, 1 if format.startswith("compressed") else 2)
    write_checkpoint(out, units, lambda prm: generate(seed, prm), shards, extra=extra)
    write_target_files(out, config, hf_quant)
    return out


def check_vocab(p: Preset) -> None:
    if p.vocab_size < tok.tokenizer_size() + 4:  # + the four vision token ids at the top
        raise ValueError(
            f"preset vocab_size {p.vocab_size} leaves no room above the tokenizer's {tok.tokenizer_size()}"
        )


def preprocessor_config(vision: dict) -> dict:
    """Qwen3.6's preprocessor_config.json for the tower's patch size, with pixel bounds
    kept small (from 8 x 8 up to 32 x 32 merged patches)."""
    factor = vision["patch_size"] * vision["spatial_merge_size"]
    return {
        "size": {"shortest_edge": (8 * factor) ** 2, "longest_edge": (32 * factor) ** 2},
        "patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"], "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }


def write_target_files(out: Path, config: dict, hf_quant: dict | None) -> None:
    """config.json, hf_quant_config.json (removed when None), generation_config.json,
    the image processor's preprocessor_config.json and the tokenizer."""
    write_json(out / "config.json", config)
    write_json(out / "preprocessor_config.json", preprocessor_config(config["vision_config"]))
    stale = out / "hf_quant_config.json"
    if hf_quant:
        write_json(stale, hf_quant)
    elif stale.exists():
        stale.unlink()
    write_json(out / "generation_config.json", tok.generation_config())
    tok.write_tokenizer(out)


def kv_cache_scales(params: list[Param], style: str) -> dict:
    """FP8 KV-cache calibration scales of the language model's attention layers:
    "modelopt" writes `self_attn.k_proj.k_scale` / `v_proj.v_scale` F32 scalars,
    "compressed-tensors" `self_attn.k_scale` / `v_scale` BF16 [1]."""
    out = {}
    for prm in params:
        m = prm.module or ""
        if m.startswith(LM) and m.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            value = np.array(0.05 + 0.01 * (len(out) % 5), dtype=np.float32)
            if style == "modelopt":
                out[f"{m}.{m[-6]}_scale"] = ("F32", value)
            else:
                out[f"{m[: -len('.k_proj')]}.{m[-6]}_scale"] = ("BF16", bf16_bits(value.reshape(1)))
    return out
