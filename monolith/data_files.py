"""Where the files monolith ships beside its code are found: the Metal kernel bodies
(`metal/*.metal`) and the bundled demo pair (`packs/demo/`).

A checkout or an editable install reads them in the repository's top-level directories;
a wheel installs them as data files under `<prefix>/share/monolith/` (pyproject.toml,
[tool.setuptools.data-files]), found through the installed distribution's file list,
else under the interpreter's data prefix. Standard library only (a leaf).
"""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path

INSTALLED_UNDER = ("share", "monolith")


def candidates(*parts: str) -> list[Path]:
    """Where the shipped file `parts` (e.g. "metal", "premix.metal") may be, in the order
    to try: the checkout, the installed distribution's file list, the data prefix."""
    paths = [Path(__file__).resolve().parents[1].joinpath(*parts)]
    installed = _installed(parts)
    if installed is not None:
        paths.append(installed)
    paths.append(Path(sysconfig.get_path("data")).joinpath(*INSTALLED_UNDER, *parts))
    return list(dict.fromkeys(paths))


def _installed(parts: tuple[str, ...]) -> Path | None:
    try:
        dist = importlib.metadata.distribution("monolith")
    except importlib.metadata.PackageNotFoundError:
        return None
    want = (*INSTALLED_UNDER, *parts)
    for entry in dist.files or ():
        if entry.parts[-len(want):] == want:
            return Path(dist.locate_file(entry)).resolve()
    return None
