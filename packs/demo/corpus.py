"""The demo corpus: the top-level modules of the running Python's standard library
(sources with their docstrings; PSF-2.0 license, present on every machine that runs
monolith). The chat transcripts about the same files are assistant_data.py's.
Deterministic: files sorted by name; every HELDOUT_EVERY-th file is held out (never
trained on, nor are the transcripts about its functions; its text gives the evaluation
prompts).

Note: the text depends on the Python version (3.11.7 when the recipe was first run);
the recipe records the version and the corpus SHA-256 in its manifest.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from pathlib import Path

HELDOUT_EVERY = 16
DOC_SEPARATOR = "\n<|endoftext|>\n"
MAX_ANSWER = 1200  # characters: longer sources are not asked for (assistant_data.py)


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def load(max_bytes: int | None = None) -> tuple[list[str], list[str], dict]:
    """(train documents, held-out documents, info): each file's source."""
    train, held = [], []
    size = 0
    for i, path in enumerate(stdlib_files()):
        text = path.read_text(encoding="utf-8", errors="replace")
        (held if held_out(i) else train).append(text)
        size += len(text)
        if max_bytes and size >= max_bytes:
            break
    h = hashlib.sha256()
    for doc in train + held:
        h.update(doc.encode())
    info = {"source": "python stdlib top-level modules", "root": sysconfig.get_paths()["stdlib"],
            "train_docs": len(train), "heldout_docs": len(held), "chars": size, "sha256": h.hexdigest()}
    return train, held, info


def held_out(index: int) -> bool:
    """Whether the index-th file of a sorted list is held out."""
    return index % HELDOUT_EVERY == HELDOUT_EVERY - 1


def segment(lines: list[str], node: ast.AST) -> str:
    """ast.get_source_segment(source, node) from the source's lines (ends kept, split at
    \n, \r and \r\n as it splits them); the column offsets count UTF-8 bytes."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset:node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset:].decode()
    tail = lines[last].encode()[:node.end_col_offset].decode()
    return head + "".join(lines[first + 1:last]) + tail

