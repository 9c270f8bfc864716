"""The demo pair's recipe stages (packs/demo/*.py) imported as the recipe runs them, for
the tests of its pieces."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "packs" / "demo"
RECIPE_MODULES = ("draft", "draft_mirror", "model", "train", "corpus", "tokenizer", "mtp", "mtp_mirror",
                  "assistant_data", "tools_data", "agent_prompts", "target_files")


def import_stage(stage: str):
    """packs/demo/<stage>.py, imported as the recipe runs it (its directory on sys.path),
    then its top-level module names taken back out of sys.modules."""
    saved = {name: sys.modules.pop(name) for name in RECIPE_MODULES if name in sys.modules}
    sys.path.insert(0, str(DEMO))
    try:
        return importlib.import_module(stage)
    finally:
        sys.path.remove(str(DEMO))
        for name in RECIPE_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
