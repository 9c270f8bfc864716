"""Where the Metal kernel bodies (.metal files) are read from.

The canonical bodies live in the repository's top-level metal/ directory. A checkout or
an editable install reads them there; a wheel installs them as data files under
`<prefix>/share/monolith/metal/` (pyproject: [tool.setuptools.data-files]), found
through the installed distribution's file list. Standard library only.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sysconfig
from pathlib import Path

DATA_SUBDIR = ("share", "monolith", "metal")


def _checkout_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "metal"


def _installed_file(filename: str) -> Path | None:
    try:
        dist = importlib.metadata.distribution("monolith")
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in dist.files or ():
        if entry.parts[-4:] == (*DATA_SUBDIR, filename):
            path = Path(dist.locate_file(entry)).resolve()
            if path.is_file():
                return path
    return None


def search_paths(filename: str) -> list[Path]:
    """Candidate locations of a body, in the order they are tried."""
    paths = [_checkout_dir() / filename]
    installed = _installed_file(filename)
    if installed is not None:
        paths.append(installed)
    paths.append(Path(sysconfig.get_path("data")).joinpath(*DATA_SUBDIR, filename))
    return paths


@functools.cache
def find_body(filename: str) -> Path:
    for path in search_paths(filename):
        if path.is_file():
            return path
    tried = ", ".join(str(p) for p in search_paths(filename))
    raise FileNotFoundError(f"Metal kernel body {filename} not found (tried {tried}); reinstall monolith")


@functools.cache
def read_body(filename: str) -> str:
    """The text of metal/<filename>, as passed to mx.fast.metal_kernel(source=...)."""
    return find_body(filename).read_text(encoding="utf-8")
