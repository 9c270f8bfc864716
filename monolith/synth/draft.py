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
from dataclasses import replace
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
from .draft_config import DraftSizes, draft_sizes, format_config, nvfp4_export_config
from .quant import modelopt_mirror
from .values import Param, bf16_bits, check_seed, generate
from .writers import Unit, write_checkpoint, write_json

DRAFT_FORMATS = ("deepspec", "deepspec-nvfp4", "speculators", "dflash")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


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
    full_vocab=False,
) -> Path:
    """Write a draft for the target at target_dir (its config.json gives the sizes; its
    embedding and lm_head are copied when it has weights). `sizes` overrides the
    derived DraftSizes; `config_overrides` are set on config.json (a None value removes
    the field). export (deepspec-nvfp4 only): "modelopt" writes hf_quant_config.json, its
    config.json mirror and `lithos_quantization`; "lithos" only `lithos_quantization`
    (LithosAI's published export). shards / naming: see writers.write_checkpoint.
    skeleton: headers only, at full file size (no values; see write_checkpoint).
    full_vocab (speculators only): the target's whole vocabulary, in the files speculators'
    save_pretrained writes: no lm_head, d2t or t2d, and `auto_map` naming config.py, its
    config module, written beside config.json with code that fails loudly if anything
    runs it (a checkpoint's code is never run)."""
    _check_options(format, markov_head_type, full_vocab)
    seed = check_seed(seed)
    target = Path(target_dir)
    target_cfg = _target_config(target)
    tc = target_cfg.get("text_config", target_cfg)
    h, vocab = tc["hidden_size"], tc["vocab_size"]
    s = sizes or draft_sizes(tc)
    if full_vocab:
        s = replace(s, draft_vocab_size=vocab)
    mask_id = _mask_id(s, tc)
    copies = {} if skeleton else _frozen_copies(target, (vocab, h))
    heads = head_params(h, vocab, s, markov_head_type) if format != "dflash" else []
    rows = draft_vocab(vocab, s.draft_vocab_size) if format == "speculators" else None

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params, extra = _format_params(format, h, vocab, s, heads, rows)
    config = format_config(format, tc, s, markov_head_type, mask_id, target_cfg)
    quantize = format == "deepspec-nvfp4"
    units = [Unit((prm,), _scheme(prm, quantize)) for prm in params]
    (out / "hf_quant_config.json").unlink(missing_ok=True)
    if quantize:
        _add_nvfp4_export(out, config, units, heads, export)
    if full_vocab:
        config["auto_map"] = {"": "config.DSparkSpeculatorConfig"}  # as speculators 0.9.0 saves it
    _apply_overrides(config, config_overrides or {})
    values_of = None if skeleton else _value_source(seed, vocab, copies, rows)
    write_checkpoint(out, units, values_of, shards=shards, extra=extra, naming=naming)
    write_json(out / "config.json", config)
    _write_config_module(out, full_vocab)
    _write_tokenizer_files(out, format)
    return out


def _check_options(format: str, markov_head_type: str, full_vocab: bool) -> None:
    _check_choice("draft format", format, DRAFT_FORMATS)
    _check_choice("markov_head_type", markov_head_type, MARKOV_HEAD_TYPES)
    if full_vocab and format != "speculators":
        raise ValueError(f"full_vocab is a speculators option; draft format {format!r} has no draft_vocab_size")


def _check_choice(label: str, value: str, known: tuple[str, ...]) -> None:
    if value not in known:
        raise ValueError(f"unknown {label} {value!r} (known: {', '.join(known)})")


def _target_config(target: Path) -> dict:
    config_path = target / "config.json"
    if not config_path.exists():
        raise ValueError(f"{target}: no config.json (write the target first)")
    return json.loads(config_path.read_text())


def _mask_id(s: DraftSizes, tc: dict) -> int:
    """The draft's mask token id, after checking the sizes fit the target."""
    vocab = tc["vocab_size"]
    if any(not 0 <= i < tc["num_hidden_layers"] for i in s.target_layer_ids):
        raise ValueError(f"draft taps {s.target_layer_ids} are not layers of the target")
    mask_id = tok.special_token_ids()[tok.MASK_TOKEN] if s.mask_token_id is None else s.mask_token_id
    if mask_id >= vocab:
        raise ValueError(f"target vocab_size {vocab} does not cover the mask token id {mask_id}")
    return mask_id


FROZEN_COPIES = (("embed_tokens.weight", "model.language_model.embed_tokens"), ("lm_head.weight", "lm_head"))


def _frozen_copies(target: Path, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """The target's embedding and lm_head as BF16 bits, by draft tensor name (none when
    the target directory has no weights)."""
    copies = {}  # BF16 bits: a [248320, 2048] copy takes 1 GB, not 2
    for name, module in FROZEN_COPIES:
        w = read_target_bf16(target, module)
        if w is not None:
            if w.shape != shape:
                raise ValueError(f"{target}: {module} has shape {w.shape}, expected {shape}")
            copies[name] = w
    return copies


def _format_params(
    format: str, h: int, vocab: int, s: DraftSizes, heads: list[Param], rows: np.ndarray | None
) -> tuple[list[Param], dict]:
    """The draft's weights in `format`, and its extra tensors (speculators' d2t / t2d)."""
    backbone = backbone_params(h, s)
    if format == "dflash":
        return backbone, {}
    if format == "speculators" and s.draft_vocab_size == vocab:
        # a full vocabulary: speculators' save_pretrained writes no lm_head (the frozen
        # verifier's), no d2t and no t2d
        return backbone + heads, {}
    if format == "speculators":
        params = backbone + [Param("lm_head.weight", (s.draft_vocab_size, h), "linear", module="lm_head")]
        params += [_draft_rows(p, s.draft_vocab_size) for p in heads]
        t2d = np.zeros(vocab, dtype=np.bool_)
        t2d[rows] = True
        return params, {"d2t": ("I64", rows - np.arange(len(rows), dtype=np.int64)), "t2d": ("BOOL", t2d)}
    embed = Param("embed_tokens.weight", (vocab, h), "embed", module="embed_tokens")
    lm_head = Param("lm_head.weight", (vocab, h), "linear", module="lm_head")
    return [embed, *backbone, lm_head, *heads], {}


def _scheme(prm: Param, quantize: bool) -> str:
    """w4a16 for the matrices an NVFP4 export quantizes, else bf16."""
    if (
        not quantize
        or prm.init in ("norm1", "bias", "markov")
        or prm.name.startswith(("confidence_head", "markov_head.gate_proj", "markov_head.joint_proj"))
    ):
        return "bf16"
    return "w4a16"


def _add_nvfp4_export(out: Path, config: dict, units: list[Unit], heads: list[Param], export: str) -> None:
    """The NVFP4 export's quantization fields on config.json (and its hf_quant_config.json)."""
    keep = ["markov_w1"] + [k for k in ("gate_proj", "joint_proj") if any(k in p.name for p in heads)]
    hf_quant, lithos = nvfp4_export_config(units, keep)
    if export == "lithos":
        config["lithos_quantization"] = {"block_size": 16, "format": "nvfp4", "keep": keep}
    elif export == "modelopt":
        config["lithos_quantization"] = lithos
        config["quantization_config"] = modelopt_mirror(hf_quant)
        write_json(out / "hf_quant_config.json", hf_quant)
    else:
        raise ValueError(f"unknown export {export!r} (known: modelopt, lithos)")


def _apply_overrides(config: dict, overrides: dict) -> None:
    for key, value in overrides.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value


def _value_source(seed: int, vocab: int, copies: dict, rows: np.ndarray | None):
    """values_of(prm) for write_checkpoint: the frozen copies, else the seeded canonical
    (DeepSpec) values; a reduced vocabulary keeps its rows of lm_head and Markov W2."""

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

    return values_of


def _write_config_module(out: Path, write: bool) -> None:
    """config.py, speculators' config module (auto_map), whose code here must never run."""
    module = out / "config.py"
    if write:
        module.write_text('raise SystemExit("executed: a checkpoint\'s config.py must never be run")\n')
    else:
        module.unlink(missing_ok=True)


def _write_tokenizer_files(out: Path, format: str) -> None:
    if format.startswith("deepspec"):
        tok.write_tokenizer(out)
    else:  # drafts in these formats ship no tokenizer
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (out / name).unlink(missing_ok=True)


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
