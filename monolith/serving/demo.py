"""The embedded default: the model pair served when no --model is given.

A trained demo pair in packs/demo/{target,draft} wins when it exists. Until then the
demo pair is the deterministic synthetic pair (`monolith.synth.write_pair`), written
once into the monolith cache (`$MONOLITH_CACHE`, default ~/.cache/monolith) under a
file lock, then packed through the pack cache like any other checkpoint. A second
start finds it there and writes nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from filelock import FileLock

from ..pack.cache import cache_root

DEMO_NAME = "monolith-demo"
# Names what write_pair is called with; a change writes a new pair beside the old one.
DEMO_VERSION = "synth-pair-tiny-bf16-deepspec-seed0"
COMPLETE = "COMPLETE"


def bundled_demo() -> tuple[Path, Path] | None:
    """packs/demo/{target,draft} of a source checkout, when a trained pair is there."""
    root = Path(__file__).resolve().parents[2] / "packs" / "demo"
    target, draft = root / "target", root / "draft"
    return (target, draft) if target.is_dir() and draft.is_dir() else None


def demo_pair(log=lambda message: None) -> tuple[Path, Path]:
    """(target, draft) checkpoint or pack directories of the demo pair."""
    bundled = bundled_demo()
    if bundled is not None:
        return bundled
    root = cache_root().parent / "demo"
    out = root / DEMO_VERSION
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{DEMO_VERSION}.lock")):
        if not (out / COMPLETE).is_file():
            from ..synth import write_pair

            log(f"writing the synthetic demo pair into {out} (first start only)")
            tmp = root / f".{DEMO_VERSION}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            write_pair(tmp, preset="tiny", format="bf16", draft_format="deepspec", seed=0)
            (tmp / COMPLETE).write_text(DEMO_VERSION + "\n")
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    return out / "target", out / "draft"
