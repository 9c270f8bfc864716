"""The demo corpus: the top-level modules of the running Python's standard library
(sources with their docstrings; PSF-2.0 license, present on every machine that runs
monolith), plus chat-formatted questions and answers drawn from the same files, so the
demo target also answers in the chat template (`conversations`). Deterministic: files
sorted by name; every HELDOUT_EVERY-th file is held out with its conversations (never
trained on; its text gives the evaluation prompts).

Note: the text depends on the Python version (3.11.7 when the recipe was first run);
the recipe records the version and the corpus SHA-256 in its manifest.
"""

from __future__ import annotations

import ast
import hashlib
import io
import sysconfig
from pathlib import Path

HELDOUT_EVERY = 16
DOC_SEPARATOR = "\n<|endoftext|>\n"
TURNS = 2  # question/answer exchanges per conversation
MAX_ANSWER = 1200  # characters: longer sources are not asked for


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def load(max_bytes: int | None = None) -> tuple[list[str], list[str], dict]:
    """(train documents, held-out documents, info): each file's source, then its
    conversations."""
    train, held = [], []
    size = 0
    for i, path in enumerate(stdlib_files()):
        text = path.read_text(encoding="utf-8", errors="replace")
        docs = [text] + conversations(path.stem, text)
        (held if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 else train).extend(docs)
        size += sum(len(d) for d in docs)
        if max_bytes and size >= max_bytes:
            break
    h = hashlib.sha256()
    for doc in train + held:
        h.update(doc.encode())
    info = {"source": "python stdlib top-level modules + conversations about them", "root": sysconfig.get_paths()["stdlib"],
            "train_docs": len(train), "heldout_docs": len(held), "chars": size, "sha256": h.hexdigest()}
    return train, held, info


def conversations(module: str, source: str) -> list[str]:
    """Chat-template conversations (the demo's Qwen-style template) about a module: what
    it is for (its docstring), what each public documented function or class does (the
    docstring's first paragraph) and its source when short, TURNS exchanges each."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    pairs = []
    lines = io.StringIO(source, newline="").readlines()  # split once: ast.get_source_segment splits per call
    doc = ast.get_docstring(tree)
    if doc:
        pairs.append((f"What is the `{module}` module for?", _first_paragraph(doc)))
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        name, kind = f"{module}.{node.name}", "class" if isinstance(node, ast.ClassDef) else "function"
        pairs.append((f"What does the {kind} `{name}` do?", _first_paragraph(doc)))
        code = _segment(lines, node)
        if code and len(code) <= MAX_ANSWER:
            pairs.append((f"Show me the source of `{name}`.", f"```python\n{code}\n```"))
    return ["".join(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"
                    for q, a in pairs[i:i + TURNS]) for i in range(0, len(pairs), TURNS)]


def _segment(lines: list[str], node: ast.AST) -> str:
    """ast.get_source_segment(source, node) from the source's lines (ends kept, split at
    \n, \r and \r\n as it splits them); the column offsets count UTF-8 bytes."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset:node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset:].decode()
    tail = lines[last].encode()[:node.end_col_offset].decode()
    return head + "".join(lines[first + 1:last]) + tail


def _first_paragraph(doc: str) -> str:
    return doc.strip().split("\n\n")[0][:MAX_ANSWER]
