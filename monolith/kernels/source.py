"""Where the Metal kernel bodies (.metal files) are read from.

The canonical bodies live in the repository's top-level metal/ directory; an installed
wheel has them as data files (monolith/data_files.py says where). Standard library only.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..data_files import candidates


def search_paths(filename: str) -> list[Path]:
    """Candidate locations of a body, in the order they are tried."""
    return candidates("metal", filename)


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
