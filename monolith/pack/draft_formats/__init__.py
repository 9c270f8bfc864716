"""The draft formats: one DraftFormat per draft architecture, the one place that knows
where each format's config.json keeps the taps and the layer fields, how it states the
block mask, and what it means by an unstated sample_from_anchor. The pack's draft recipe
(pack/draft_recipe.py) reads a checkpoint through it, and the draft's arguments
(models/draft_args.py) read the pack's copy of config.json through it. Adding a format:
docs/drafts.md, "Adding a draft format"."""

from __future__ import annotations

from ...checkpoint.config import DFLASH, DSPARK, DSPARK_SPECULATORS
from .base import NESTS, DraftFormat, config_field
from .deepspec import DeepSpecFormat
from .dflash import DFlashFormat
from .speculators import SpeculatorsFormat

# the registry: draft architecture (monolith.checkpoint.config) -> its format
DRAFT_FORMATS: dict[str, DraftFormat] = {
    DSPARK: DeepSpecFormat(),
    DSPARK_SPECULATORS: SpeculatorsFormat(),
    DFLASH: DFlashFormat(),
}

__all__ = ["DRAFT_FORMATS", "NESTS", "DFlashFormat", "DeepSpecFormat", "DraftFormat", "SpeculatorsFormat",
           "config_field"]
