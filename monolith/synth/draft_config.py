"""A synthetic draft's sizes and its config.json in each format (DeepSpec, speculators,
z-lab DFlash), plus the quantization config of its NVFP4 export."""

from __future__ import annotations

from dataclasses import dataclass

from .quant import MODELOPT_PRODUCER
from .writers import Unit

SPECULATORS_VERSION = "0.9.0"


@dataclass(frozen=True)
class DraftSizes:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]  # DeepSpec convention: output of decoder layer i
    markov_rank: int
    draft_vocab_size: int  # speculators' vocabulary (the target's: no lm_head, d2t or t2d, as speculators saves it)
    sliding_window: int | None  # speculators' sliding-window attention (None: full attention)
    block_size: int = 8
    dflash_block_size: int = 16
    mask_token_id: int | None = None  # None: the synthetic tokenizer's <|mask|>


def draft_sizes(text_config: dict) -> DraftSizes:
    """Draft sizes from the target's text config: heads x head_dim = 2 x hidden (like the
    real 35B drafts: 32 x 128 = 2 x 2048), intermediate 3 x hidden, taps spread over the
    target's layers, Markov rank hidden / 8 (at least 16)."""
    h, n_layers, vocab = text_config["hidden_size"], text_config["num_hidden_layers"], text_config["vocab_size"]
    head_dim = 32 if h < 256 else 128
    heads = 2 * h // head_dim
    n_taps = min(n_layers, 2 if n_layers <= 4 else 5)
    last = max(n_layers - 2, 0)
    taps = [last // 2] if n_taps == 1 else [round(i * last / (n_taps - 1)) for i in range(n_taps)]
    return DraftSizes(
        num_layers=2,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2 if heads < 8 else heads // 4),
        head_dim=head_dim,
        intermediate_size=3 * h,
        target_layer_ids=tuple(taps),
        markov_rank=max(16, (h // 8) // 16 * 16),
        draft_vocab_size=vocab // 2 if vocab <= 1024 else vocab // 4,
        sliding_window=128 if h < 256 else 2048,
    )



# ---------------------------------------------------------------------------- configs


def _qwen3_fields(tc: dict, s: DraftSizes) -> dict:
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": tc["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size,
        "max_position_embeddings": tc["max_position_embeddings"],
        "max_window_layers": s.num_layers,
        "model_type": "qwen3",
        "num_attention_heads": s.num_heads,
        "num_hidden_layers": s.num_layers,
        "num_key_value_heads": s.num_kv_heads,
        "rms_norm_eps": tc["rms_norm_eps"],
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": tc["vocab_size"],
    }


def deepspec_config(tc: dict, s: DraftSizes, head_type: str, mask_id: int) -> dict:
    rope = tc["rope_parameters"]
    cfg = {
        **_qwen3_fields(tc, s),
        "architectures": ["Qwen3DSparkModel"],
        "block_size": s.block_size,
        "bos_token_id": tc.get("bos_token_id"),
        "confidence_head_with_markov": True,
        "enable_confidence_head": True,
        "eos_token_id": tc.get("eos_token_id"),
        "markov_head_type": head_type,
        "markov_rank": s.markov_rank,
        "mask_token_id": mask_id,
        "num_target_layers": tc["num_hidden_layers"],
        "rope_scaling": None,
        "rope_theta": rope["rope_theta"],
        "sliding_window": None,
        "target_layer_ids": list(s.target_layer_ids),
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
    }
    # Inherited from the target's config by the training script; a qwen3 draft must
    # ignore them (full-width RoPE, no output gate, no linear attention).
    for key in (
        "attn_output_gate",
        "full_attention_interval",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_value_head_dim",
    ):
        cfg[key] = tc[key]
    cfg["partial_rotary_factor"] = rope["partial_rotary_factor"]
    cfg["mrope_section"] = rope["mrope_section"]
    cfg["mrope_interleaved"] = rope["mrope_interleaved"]
    return cfg


def speculators_config(tc: dict, s: DraftSizes, head_type: str, mask_id: int, target_cfg: dict) -> dict:
    sliding = s.sliding_window is not None
    layer = {
        **_qwen3_fields(tc, s),
        "layer_types": ["sliding_attention" if sliding else "full_attention"] * s.num_layers,
        "rope_parameters": {"rope_theta": tc["rope_parameters"]["rope_theta"], "rope_type": "default"},
        "sliding_window": s.sliding_window,
        "use_sliding_window": sliding,
    }
    return {
        "architectures": ["Qwen3DSparkModel"],
        "aux_hidden_state_layer_ids": [i + 1 for i in s.target_layer_ids],  # = DeepSpec id + 1
        "block_size": s.block_size,
        "confidence_head_with_markov": True,
        "draft_vocab_size": s.draft_vocab_size,
        "dtype": "bfloat16",
        "enable_confidence_head": True,
        "markov_head_type": head_type,
        "markov_rank": s.markov_rank,
        "mask_token_id": mask_id,
        "sample_from_anchor": True,
        "sliding_window_non_causal": False,
        "speculators_config": {
            "algorithm": "dspark",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": s.block_size, "verifier_accept_k": 1}
            ],
            "verifier": {"architectures": target_cfg["architectures"], "name_or_path": "synthetic/target"},
        },
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "transformer_layer_config": layer,
    }


def dflash_config(tc: dict, s: DraftSizes, mask_id: int) -> dict:
    max_pos = tc["max_position_embeddings"]
    return {
        **_qwen3_fields(tc, s),
        "architectures": ["DFlashDraftModel"],
        "block_size": s.dflash_block_size,
        "dflash_config": {
            "block_size": s.dflash_block_size,
            "mask_token_id": mask_id,
            "target_layer_ids": list(s.target_layer_ids),
        },
        "dtype": "bfloat16",
        "layer_types": ["full_attention"] * s.num_layers,
        "num_target_layers": tc["num_hidden_layers"],
        "rope_parameters": {
            "factor": 2.0,
            "original_max_position_embeddings": max_pos // 2,
            "rope_theta": tc["rope_parameters"]["rope_theta"],
            "rope_type": "yarn",
        },
        "sliding_window": None,
        "use_sliding_window": False,
    }


def format_config(format: str, tc: dict, s: DraftSizes, head_type: str, mask_id: int, target_cfg: dict) -> dict:
    """config.json of a draft in `format` for the target whose text config is `tc`."""
    if format == "dflash":
        return dflash_config(tc, s, mask_id)
    if format == "speculators":
        return speculators_config(tc, s, head_type, mask_id, target_cfg)
    return deepspec_config(tc, s, head_type, mask_id)


def nvfp4_export_config(units: list[Unit], keep: list[str]) -> tuple[dict, dict]:
    """The LithosAI-style export as a ModelOpt MIXED_PRECISION config listing every
    quantized matrix (weight-only NVFP4: no input scales)."""
    layers = {
        p.module: {"group_size": 16, "quant_algo": "W4A16_NVFP4"} for u in units if u.scheme != "bf16" for p in u.params
    }
    quant = {
        "exclude_modules": [
            "markov_head.markov_w1",
            "markov_head.gate_proj",
            "markov_head.joint_proj",
            "confidence_head*",
        ],
        "kv_cache_quant_algo": None,
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": dict(sorted(layers.items())),
    }
    lithos = {"format": "nvfp4", "group_size": 16, "keep": keep, "scale_format": "modelopt"}
    return {"producer": MODELOPT_PRODUCER, "quantization": quant}, lithos

