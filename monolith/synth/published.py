"""The published repositories' exact file sets, at any width and depth.

Targets:
  nvidia-35b      nvidia/Qwen3.6-35B-A3B-NVFP4: ModelOpt MIXED_PRECISION (experts, shared
                  experts and lm_head NVFP4 with input scales, stored per expert; GDN and
                  attention projections FP8; FP8 KV cache; experts listed by container
                  in quantized_layers), BF16 vision and MTP (the MTP
                  layer's experts fused), 3 shards `model-0000i-of-00003.safetensors`.
  unsloth-27b     unsloth/Qwen3.6-27B-NVFP4: compressed-tensors "Dynamic NVFP4"
                  mixed-precision (quant.unsloth_dynamic_config), BF16 vision, the 15 BF16
                  MTP tensors in model_mtp.safetensors.
Drafts (each fits one target layout):
  koopah-dspark   Koopah Qwen3.6-35B-A3B DSPARK v2 (DeepSpec, BF16).
  lithos-dspark   LithosAI/Qwen3.6-35B-A3B-DSpark-NVFP4 (DeepSpec NVFP4 export,
                  `lithos_quantization` only, shards `model-0000i.safetensors`).
  redhat-dspark   RedHatAI's speculators DSpark head for the 35B (reduced vocabulary,
                  sliding-window layers).
  zlab-dflash     z-lab's DFlash for the 35B.
  speculators-27b a speculators-layout DSpark head for the 27B (full vocabulary).

Widths: preset "tiny" (the tiny test widths with the real 27-block vision tower),
"full" (the published widths and depth), any PRESETS name or a Preset; `layers` sets the
depth. Draft widths follow the target's: the published numbers at the published hidden
size, scaled otherwise; taps are the published ones at the published depth, spread over
the target's layers otherwise. skeleton=True writes every file at its full size with
only its header (sparse: no disk, no values), for header-only tools such as
`pack build --dry-run`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from .draft import write_draft
from .draft_config import DraftSizes
from .presets import PRESETS, Preset, resolve_preset
from .quant import (
    MODELOPT_PRODUCER,
    ct_scheme,
    modelopt_mirror,
    modelopt_mixed_config,
    modelopt_scheme,
    unsloth_dynamic_config,
)
from .target import (
    LM,
    check_vocab,
    kv_cache_scales,
    plan_units,
    target_config,
    target_params,
    write_target_files,
)
from .values import check_seed, generate
from .writers import write_checkpoint

REAL_VOCAB = 248320


@dataclass(frozen=True)
class TargetLayout:
    full_preset: str
    dense: bool


@dataclass(frozen=True)
class DraftLayout:
    target: str  # the target layout it fits
    format: str  # a synth.draft format
    real: DraftSizes  # at the published widths
    overrides: dict = field(default_factory=dict)  # config.json fields set (None: removed)
    export: str = "modelopt"
    shards: int = 1
    naming: str = "of"


TARGET_LAYOUTS = {
    "nvidia-35b": TargetLayout("qwen3.6-35b-a3b", dense=False),
    "unsloth-27b": TargetLayout("qwen3.6-27b", dense=True),
}

_DSPARK_35B = DraftSizes(
    num_layers=6,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=6144,
    target_layer_ids=(1, 6, 11, 16, 22, 27, 32, 37),
    markov_rank=256,
    draft_vocab_size=REAL_VOCAB,
    sliding_window=None,
)
# DSPARK v2: plain default RoPE (rope_theta 1e7); the target's partial rotary and mRoPE
# fields are not inherited.
_DEEPSPEC_FIELDS = {"num_anchors": 512, "partial_rotary_factor": None, "mrope_section": None, "mrope_interleaved": None}

DRAFT_LAYOUTS = {
    "koopah-dspark": DraftLayout("nvidia-35b", "deepspec", _DSPARK_35B, _DEEPSPEC_FIELDS),
    "lithos-dspark": DraftLayout(
        "nvidia-35b", "deepspec-nvfp4", _DSPARK_35B, _DEEPSPEC_FIELDS, export="lithos", shards=2, naming="numbered"
    ),
    "redhat-dspark": DraftLayout(
        "nvidia-35b",
        "speculators",
        DraftSizes(
            num_layers=5,
            num_heads=16,
            num_kv_heads=2,
            head_dim=256,
            intermediate_size=6144,
            target_layer_ids=(1, 9, 19, 29, 36),  # aux_hidden_state_layer_ids [2, 10, 20, 30, 37]
            markov_rank=256,
            draft_vocab_size=32000,
            sliding_window=2048,
            mask_token_id=248077,
        ),
    ),
    "zlab-dflash": DraftLayout(
        "nvidia-35b",
        "dflash",
        DraftSizes(
            num_layers=8,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            intermediate_size=6144,
            target_layer_ids=(1, 10, 19, 28, 37),
            markov_rank=0,
            draft_vocab_size=REAL_VOCAB,
            sliding_window=None,
            mask_token_id=248070,
        ),
    ),
    "speculators-27b": DraftLayout(
        "unsloth-27b",
        "speculators",
        DraftSizes(
            num_layers=5,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=17408,
            target_layer_ids=(1, 16, 31, 46, 61),
            markov_rank=256,
            draft_vocab_size=REAL_VOCAB,
            sliding_window=None,
            block_size=16,
        ),
    ),
}
LAYOUTS = (*TARGET_LAYOUTS, *DRAFT_LAYOUTS)


def layout_preset(layout: str, preset="tiny", layers=None) -> Preset:
    """The Preset a target layout is written with (see the module docstring)."""
    t = _target_layout(layout)
    if preset == "full":
        p = PRESETS[t.full_preset]
    elif preset == "tiny":
        p = replace(PRESETS["tiny"], vision_depth=PRESETS[t.full_preset].vision_depth)
    else:
        p = resolve_preset(preset)
    return p if layers is None else replace(p, num_hidden_layers=layers)


def write_published_target(out_dir, layout: str, preset="tiny", layers=None, seed=0, skeleton=False) -> Path:
    """Write target `layout` (TARGET_LAYOUTS) into out_dir and return its path."""
    t = _target_layout(layout)
    p = layout_preset(layout, preset, layers)
    check_vocab(p)
    seed = check_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    values_of = None if skeleton else (lambda prm: generate(seed, prm))
    params = target_params(p, t.dense)
    config = target_config(p, t.dense)
    if layout == "nvidia-35b":
        q = modelopt_mixed_config(params, t.dense, nvfp4_algo="NVFP4", experts_listed="container")
        hf_quant = {"producer": MODELOPT_PRODUCER, "quantization": q}
        config["quantization_config"] = modelopt_mirror(hf_quant)
        units = plan_units(
            params, lambda m: modelopt_scheme(m, q), share_scales=True, fuse_experts=lambda e: e.startswith("mtp.")
        )
        write_checkpoint(out, units, values_of, shards=3, extra=kv_cache_scales(params, "modelopt"))
    else:  # unsloth-27b
        n = p.num_hidden_layers
        last = range(n - math.ceil(n / 8), n)  # layers 56-63 of 64
        qc = unsloth_dynamic_config([f"{LM}.layers.{i}.mlp.{x}_proj" for i in last for x in ("gate", "up", "down")])
        config["quantization_config"] = qc
        hf_quant = None

        def scheme_of(module):
            scheme = ct_scheme(module, qc)
            return "ct-fp8-channel-bf16" if scheme == "ct-fp8-channel" else scheme

        main = [prm for prm in params if not prm.name.startswith("mtp.")]
        mtp = [prm for prm in params if prm.name.startswith("mtp.")]
        units = plan_units(main, scheme_of, share_scales=False, fuse_experts=False)
        mtp_units = plan_units(mtp, lambda m: "bf16", share_scales=False, fuse_experts=False)
        write_checkpoint(
            out,
            units,
            values_of,
            shards=4,
            extra=kv_cache_scales(params, "compressed-tensors"),
            separate={"model_mtp.safetensors": mtp_units},
        )
    write_target_files(out, config, hf_quant)
    return out


def write_published_draft(out_dir, layout: str, target_dir, seed=0, skeleton=False, sizes=None) -> Path:
    """Write draft `layout` (DRAFT_LAYOUTS) for the target at target_dir (written with
    the layout's target layout, at any width and depth). `sizes` overrides the
    layout's DraftSizes for that target (draft_layout_sizes)."""
    d = _draft_layout(layout)
    path = Path(target_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{target_dir}: no config.json (write the target first)")
    cfg = json.loads(path.read_text())
    want = target_config(PRESETS["tiny"], TARGET_LAYOUTS[d.target].dense)["architectures"]
    if cfg.get("architectures") != want:
        raise ValueError(
            f"draft layout {layout} fits a {d.target} target ({want[0]}); {target_dir} is {cfg.get('architectures')}"
        )
    tc = cfg["text_config"]
    return write_draft(
        out_dir,
        target_dir,
        d.format,
        seed,
        sizes=sizes or draft_layout_sizes(layout, tc),
        config_overrides=d.overrides,
        export=d.export,
        shards=d.shards,
        naming=d.naming,
        skeleton=skeleton,
    )


def write_published_pair(out_dir, layout: str, preset="tiny", layers=None, seed=0, skeleton=False):
    """Draft `layout` and the target layout it fits: out_dir/target, out_dir/draft."""
    out = Path(out_dir)
    target = write_published_target(out / "target", _draft_layout(layout).target, preset, layers, seed, skeleton)
    return target, write_published_draft(out / "draft", layout, target, seed, skeleton)


def draft_layout_sizes(layout: str, text_config: dict) -> DraftSizes:
    """The draft's sizes for a target with this text config (see the module docstring)."""
    d = _draft_layout(layout)
    r = d.real
    full = PRESETS[TARGET_LAYOUTS[d.target].full_preset]
    h, depth, vocab = text_config["hidden_size"], text_config["num_hidden_layers"], text_config["vocab_size"]
    sizes = {}
    if h != full.hidden_size:  # keep the published ratios to the hidden size
        head_dim = 32 if h < 256 else r.head_dim
        heads = max(2, r.num_heads * r.head_dim * h // (full.hidden_size * head_dim))
        kv = max(1, heads * r.num_kv_heads // r.num_heads)
        while heads % kv:
            kv -= 1
        sizes = dict(
            head_dim=head_dim,
            num_heads=heads,
            num_kv_heads=kv,
            intermediate_size=max(32, r.intermediate_size * h // full.hidden_size // 32 * 32),
            markov_rank=0 if r.markov_rank == 0 else max(16, r.markov_rank * h // full.hidden_size // 16 * 16),
            sliding_window=None if r.sliding_window is None else 128,
        )
    if depth != full.num_hidden_layers:
        last = full.num_hidden_layers - 1
        sizes["target_layer_ids"] = tuple(sorted({round(t * (depth - 1) / last) for t in r.target_layer_ids}))
    if vocab != REAL_VOCAB:
        reduced = r.draft_vocab_size != REAL_VOCAB
        sizes["draft_vocab_size"] = vocab // 2 if reduced else vocab
        sizes["mask_token_id"] = None
    return replace(r, **sizes)


def _target_layout(layout: str) -> TargetLayout:
    if layout not in TARGET_LAYOUTS:
        raise ValueError(f"unknown target layout {layout!r} (known: {', '.join(TARGET_LAYOUTS)})")
    return TARGET_LAYOUTS[layout]


def _draft_layout(layout: str) -> DraftLayout:
    if layout not in DRAFT_LAYOUTS:
        raise ValueError(f"unknown draft layout {layout!r} (known: {', '.join(DRAFT_LAYOUTS)})")
    return DRAFT_LAYOUTS[layout]
