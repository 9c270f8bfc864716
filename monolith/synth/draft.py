"""Synthetic DSpark / DFlash drafts that fit a target, in the four formats the loader reads.

All formats draw their weights from the same canonical (DeepSpec) names, so with one
seed a speculators draft is the exact twin of the DeepSpec draft: the same backbone,
heads and Markov W1; its lm_head and Markov W2 are the DeepSpec rows of its reduced
vocabulary (`d2t`), and its `aux_hidden_state_layer_ids` are the DeepSpec taps + 1.
(With the sliding window: identical while the context fits in the window.)
The embedding and lm_head are frozen copies of the target's (read from the target
directory), as in the real drafts.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from monolith.formats import (
    SafetensorsFile,
    bf16_bits_to_f32,
    dequantize_fp8,
    dequantize_nvfp4,
    tensor_scale_from_global,
)

from . import tokenizer as tok
from .quant import MODELOPT_PRODUCER, modelopt_mirror
from .values import Param, bf16_bits, check_seed, generate
from .writers import Unit, write_checkpoint, write_json

DRAFT_FORMATS = ("deepspec", "deepspec-nvfp4", "speculators", "dflash")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
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


# ---------------------------------------------------------------------------- tensors


def _linear(module: str, out: int, inp: int) -> Param:
    return Param(f"{module}.weight", (out, inp), "linear", module=module)


def backbone_params(h: int, s: DraftSizes) -> list[Param]:
    """Qwen3 decoder layers with KV injection, fc over the taps, hidden_norm, norm."""
    params = [_linear("fc", h, len(s.target_layer_ids) * h), Param("hidden_norm.weight", (h,), "norm1")]
    q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    for i in range(s.num_layers):
        ly = f"layers.{i}"
        params += [
            Param(f"{ly}.input_layernorm.weight", (h,), "norm1"),
            _linear(f"{ly}.self_attn.q_proj", q_dim, h),
            _linear(f"{ly}.self_attn.k_proj", kv_dim, h),
            _linear(f"{ly}.self_attn.v_proj", kv_dim, h),
            _linear(f"{ly}.self_attn.o_proj", h, q_dim),
            Param(f"{ly}.self_attn.q_norm.weight", (s.head_dim,), "norm1"),
            Param(f"{ly}.self_attn.k_norm.weight", (s.head_dim,), "norm1"),
            Param(f"{ly}.post_attention_layernorm.weight", (h,), "norm1"),
            _linear(f"{ly}.mlp.gate_proj", s.intermediate_size, h),
            _linear(f"{ly}.mlp.up_proj", s.intermediate_size, h),
            _linear(f"{ly}.mlp.down_proj", h, s.intermediate_size),
        ]
    return params + [Param("norm.weight", (h,), "norm1")]


def head_params(h: int, vocab: int, s: DraftSizes, head_type: str) -> list[Param]:
    """Markov head (W1 over the target vocabulary, W2 over the draft's) and the
    confidence head over [h ; W1[prev]] (shapes as in speculators' MarkovHead)."""
    r = s.markov_rank
    params = [
        Param("markov_head.markov_w1.weight", (vocab, r), "markov"),
        _linear("markov_head.markov_w2", vocab, r),
    ]
    if head_type == "gated":
        params += [_linear("markov_head.gate_proj", r, h + r), Param("markov_head.gate_proj.bias", (r,), "bias")]
    elif head_type == "rnn":
        params += [
            _linear("markov_head.joint_proj", 3 * r, 2 * r + h),
            Param("markov_head.joint_proj.bias", (3 * r,), "bias"),
        ]
    return params + [
        _linear("confidence_head.proj", 1, h + r),
        Param("confidence_head.proj.bias", (1,), "bias"),
    ]


# ----------------------------------------------------------------- reading the target


def _target_files(target: Path) -> dict[str, Path]:
    index = target / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target / f for name, f in weight_map.items()}
    single = target / "model.safetensors"
    if single.exists():
        return {name: single for name in SafetensorsFile(single).names()}
    return {}


ROW_CHUNK = 4096  # rows dequantized at a time (a 248,320-row lm_head never exists in F32)


def read_target_bf16(target: Path, module: str) -> np.ndarray | None:
    """A target matrix (BF16, ModelOpt NVFP4/FP8 or compressed-tensors) as BF16 bits
    (uint16), dequantized in row chunks; None when the target directory has no weights."""
    files = _target_files(target)

    def read(name):
        return SafetensorsFile(files[name]).read(name)

    ct_nvfp4 = f"{module}.weight_packed" in files
    if ct_nvfp4 or f"{module}.weight_scale_2" in files:
        packed = read(f"{module}.weight_packed" if ct_nvfp4 else f"{module}.weight")
        scales = read(f"{module}.weight_scale")
        if ct_nvfp4:
            scale = tensor_scale_from_global(read(f"{module}.weight_global_scale"), module)
        else:
            scale = read(f"{module}.weight_scale_2")
        shape = (packed.shape[0], 2 * packed.shape[1])

        def rows(a, b):
            return dequantize_nvfp4(packed[a:b], scales[a:b], scale, module)
    elif f"{module}.weight_scale" in files:
        codes, scale = read(f"{module}.weight"), read(f"{module}.weight_scale")
        if scale.dtype == np.uint16:  # BF16 scales (llm-compressor)
            scale = bf16_bits_to_f32(scale)
        shape = codes.shape

        def rows(a, b):
            return dequantize_fp8(codes[a:b], scale if scale.size == 1 else scale[a:b], module)
    elif f"{module}.weight" in files:
        return np.array(read(f"{module}.weight"))
    elif files:
        raise ValueError(f"{target}: no tensor for {module}")
    else:
        return None
    out = np.empty(shape, dtype=np.uint16)
    for a in range(0, shape[0], ROW_CHUNK):
        b = min(shape[0], a + ROW_CHUNK)
        out[a:b] = bf16_bits(rows(a, b))
    return out


def draft_vocab(vocab: int, size: int) -> np.ndarray:
    """The reduced vocabulary (sorted target ids): special tokens, then the tokens most
    frequent in the tokenizer's corpus, then the lowest remaining ids."""
    from tokenizers import Tokenizer

    special = sorted(tok.special_token_ids().values())
    tokenizer = Tokenizer.from_str(tok.tokenizer_json())
    counts = Counter(tokenizer.encode(tok.corpus_text()).ids)
    ranked = special + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    ranked += list(range(vocab))
    chosen: list[int] = []
    seen: set[int] = set()
    for t in ranked:
        if t not in seen and t < vocab:
            seen.add(t)
            chosen.append(t)
        if len(chosen) == size:
            break
    return np.array(sorted(chosen), dtype=np.int64)


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


# ---------------------------------------------------------------------------- writing


def write_draft(
    out_dir,
    target_dir,
    format="deepspec",
    seed=0,
    markov_head_type="vanilla",
    sizes=None,
    config_overrides=None,
    export="modelopt",
    shards=1,
    naming="of",
    skeleton=False,
) -> Path:
    """Write a draft for the target at target_dir (its config.json gives the sizes; its
    embedding and lm_head are copied when it has weights). `sizes` overrides the
    derived DraftSizes; `config_overrides` are set on config.json (a None value removes
    the field). export (deepspec-nvfp4 only): "modelopt" writes hf_quant_config.json, its
    config.json mirror and `lithos_quantization`; "lithos" only `lithos_quantization`
    (LithosAI's published export). shards / naming: see writers.write_checkpoint.
    skeleton: headers only, at full file size (no values; see write_checkpoint)."""
    if format not in DRAFT_FORMATS:
        raise ValueError(f"unknown draft format {format!r} (known: {', '.join(DRAFT_FORMATS)})")
    if markov_head_type not in MARKOV_HEAD_TYPES:
        raise ValueError(f"unknown markov_head_type {markov_head_type!r} (known: {', '.join(MARKOV_HEAD_TYPES)})")
    seed = check_seed(seed)
    target = Path(target_dir)
    config_path = target / "config.json"
    if not config_path.exists():
        raise ValueError(f"{target}: no config.json (write the target first)")
    target_cfg = json.loads(config_path.read_text())
    tc = target_cfg.get("text_config", target_cfg)
    s = sizes or draft_sizes(tc)
    h, vocab = tc["hidden_size"], tc["vocab_size"]
    if any(not 0 <= i < tc["num_hidden_layers"] for i in s.target_layer_ids):
        raise ValueError(f"draft taps {s.target_layer_ids} are not layers of the target")
    mask_id = tok.special_token_ids()[tok.MASK_TOKEN] if s.mask_token_id is None else s.mask_token_id
    if mask_id >= vocab:
        raise ValueError(f"target vocab_size {vocab} does not cover the mask token id {mask_id}")

    embed = Param("embed_tokens.weight", (vocab, h), "embed", module="embed_tokens")
    lm_head = Param("lm_head.weight", (vocab, h), "linear", module="lm_head")
    copies = {}  # BF16 bits: a [248320, 2048] copy takes 1 GB, not 2
    for prm, module in ((embed, "model.language_model.embed_tokens"), (lm_head, "lm_head")):
        w = None if skeleton else read_target_bf16(target, module)
        if w is not None:
            if w.shape != prm.shape:
                raise ValueError(f"{target}: {module} has shape {w.shape}, expected {prm.shape}")
            copies[prm.name] = w
    backbone = backbone_params(h, s)
    heads = head_params(h, vocab, s, markov_head_type) if format != "dflash" else []
    rows = None
    if format == "speculators":
        rows = draft_vocab(vocab, s.draft_vocab_size)

    def values_of(prm: Param) -> np.ndarray:
        canonical = prm.name
        w = (
            bf16_bits_to_f32(copies[canonical])
            if canonical in copies
            else generate(seed, Param(canonical, _canonical_shape(prm, vocab), prm.init, prm.module))
        )
        if rows is not None and canonical in ("lm_head.weight", "markov_head.markov_w2.weight"):
            w = w[rows]
        return w

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    extra = {}
    if format == "dflash":
        params, config = backbone, dflash_config(tc, s, mask_id)
    elif format == "speculators" and s.draft_vocab_size == vocab:
        # a full vocabulary: speculators' save_pretrained writes no lm_head (the frozen
        # verifier's), no d2t and no t2d
        params = backbone + heads
        config = speculators_config(tc, s, markov_head_type, mask_id, target_cfg)
    elif format == "speculators":
        params = backbone + [Param("lm_head.weight", (s.draft_vocab_size, h), "linear", module="lm_head")]
        params += [_draft_rows(p, s.draft_vocab_size) for p in heads]
        t2d = np.zeros(vocab, dtype=np.bool_)
        t2d[rows] = True
        extra = {"d2t": ("I64", rows - np.arange(len(rows), dtype=np.int64)), "t2d": ("BOOL", t2d)}
        config = speculators_config(tc, s, markov_head_type, mask_id, target_cfg)
    else:
        params = [embed, *backbone, lm_head, *heads]
        config = deepspec_config(tc, s, markov_head_type, mask_id)

    quantize = format == "deepspec-nvfp4"
    keep = ["markov_w1"] + [k for k in ("gate_proj", "joint_proj") if any(k in p.name for p in heads)]

    def scheme_of(prm: Param) -> str:
        if (
            not quantize
            or prm.init in ("norm1", "bias", "markov")
            or prm.name.startswith(("confidence_head", "markov_head.gate_proj", "markov_head.joint_proj"))
        ):
            return "bf16"
        return "w4a16"

    units = [Unit((prm,), scheme_of(prm)) for prm in params]
    (out / "hf_quant_config.json").unlink(missing_ok=True)
    if quantize:
        hf_quant, lithos = nvfp4_export_config(units, keep)
        if export == "lithos":
            config["lithos_quantization"] = {"block_size": 16, "format": "nvfp4", "keep": keep}
        elif export == "modelopt":
            config["lithos_quantization"] = lithos
            config["quantization_config"] = modelopt_mirror(hf_quant)
            write_json(out / "hf_quant_config.json", hf_quant)
        else:
            raise ValueError(f"unknown export {export!r} (known: modelopt, lithos)")
    for key, value in (config_overrides or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    write_checkpoint(out, units, None if skeleton else values_of, shards=shards, extra=extra, naming=naming)
    write_json(out / "config.json", config)
    if format.startswith("deepspec"):
        tok.write_tokenizer(out)
    else:  # drafts in these formats ship no tokenizer
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (out / name).unlink(missing_ok=True)
    return out


def _draft_rows(prm: Param, draft_vocab_size: int) -> Param:
    """Markov W2 of a reduced-vocabulary draft has one row per draft token."""
    if prm.name != "markov_head.markov_w2.weight":
        return prm
    return Param(prm.name, (draft_vocab_size, prm.shape[1]), prm.init, prm.module)


def _canonical_shape(prm: Param, vocab: int) -> tuple[int, ...]:
    """Speculators rows are selected after generation: draw the full DeepSpec matrix."""
    if prm.name in ("lm_head.weight", "markov_head.markov_w2.weight"):
        return (vocab, prm.shape[1])
    return prm.shape
