"""Deterministic synthetic checkpoints with the real tensor names and config fields, in
every format the loader reads: Qwen3.5/3.6 hybrid targets (BF16, ModelOpt NVFP4 and
mixed, compressed-tensors NVFP4 and mixed) and DSpark/DFlash drafts (DeepSpec, its
NVFP4 export, speculators, z-lab DFlash), plus a small trained Qwen-style tokenizer.
`monolith.synth.published` writes the published repositories' exact file sets (nvidia's
and unsloth's targets, five drafts) at any width and depth, also as header-only
full-size skeletons.

Same arguments, same bytes. `python -m monolith.synth --help` for the command line.
"""

from .draft import DRAFT_FORMATS, write_draft
from .draft_config import DraftSizes, draft_sizes
from .presets import PRESETS, Preset
from .published import (
    DRAFT_LAYOUTS,
    TARGET_LAYOUTS,
    write_published_draft,
    write_published_pair,
    write_published_target,
)
from .target import FORMATS, write_target
from .tokenizer import write_tokenizer


def write_pair(out_dir, preset="tiny", format="bf16", draft_format="deepspec", seed=0):
    """Write a target into out_dir/target and a draft that fits it into out_dir/draft."""
    from pathlib import Path

    out = Path(out_dir)
    target = write_target(out / "target", preset=preset, format=format, seed=seed)
    draft = write_draft(out / "draft", target, format=draft_format, seed=seed)
    return target, draft


__all__ = [
    "DRAFT_FORMATS",
    "DRAFT_LAYOUTS",
    "FORMATS",
    "PRESETS",
    "DraftSizes",
    "Preset",
    "TARGET_LAYOUTS",
    "draft_sizes",
    "write_draft",
    "write_pair",
    "write_published_draft",
    "write_published_pair",
    "write_published_target",
    "write_target",
    "write_tokenizer",
]
