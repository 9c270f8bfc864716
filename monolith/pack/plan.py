"""plan_pack: pick the recipe for a checkpoint's architecture."""

from __future__ import annotations

from ..checkpoint import Checkpoint
from ..checkpoint.config import DRAFT_ARCHITECTURES, TARGET_ARCHITECTURES
from .recipe import PackError, Plan


def plan_pack(ckpt: Checkpoint, quantization: str = "auto", problems: list[str] | None = None,
              with_mtp: bool = False, with_vision: bool = True) -> Plan:
    """The plan. With `problems` (a dry run), failing steps are recorded there and
    planning goes on (a draft's config problems still raise: nothing can be planned
    without its settings). `with_mtp`: a target pack keeps its MTP head; without `with_vision`
    (--no-vision) it leaves its vision tower out (target_recipe.py)."""
    from .draft_recipe import plan_draft
    from .target_recipe import plan_target

    if ckpt.architecture in TARGET_ARCHITECTURES:
        return plan_target(ckpt, quantization, problems, with_mtp, with_vision)
    if with_mtp:
        raise PackError(f"{ckpt.path}/config.json: --with-mtp keeps a target's MTP head, but this is a "
                        f"{ckpt.architecture} draft")
    if ckpt.architecture in DRAFT_ARCHITECTURES:
        return plan_draft(ckpt, quantization, problems)
    raise PackError(f"{ckpt.path}/config.json: no pack recipe for architecture {ckpt.architecture}")
