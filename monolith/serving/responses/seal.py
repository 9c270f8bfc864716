"""Encrypted reasoning for the Responses API (`include: ["reasoning.encrypted_content"]`):
a reasoning item's text sealed with Fernet (the `cryptography` package: AES-128-CBC with
an HMAC-SHA256 tag), so that a client that keeps no server-side state (`store: false`,
as Codex sends) can hand the reasoning back on its next turn without reading or
altering it. The key is this server's own: `responses.key` in the cache directory
($MONOLITH_CACHE, else $XDG_CACHE_HOME/monolith), created once, atomically, readable by
its owner only. A blob that does not open under it (tampered, or sealed by another
server) is a 400 naming the item."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

from ...pack.manifest import cache_root
from ..errors import bad

KEY_FILE = "responses.key"


def key_path() -> Path:
    return cache_root().parent / KEY_FILE


def _key() -> bytes:
    """The key, made on first use: written to a private temporary file, then linked into
    place (a second server that races us keeps whichever key was linked first)."""
    path = key_path()
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{KEY_FILE}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(Fernet.generate_key())
        try:
            os.link(temporary, path)  # fails if another process linked its key first
        except FileExistsError:
            pass
    finally:
        temporary.unlink()
    return path.read_bytes().strip()


class Sealer:
    """seal(text) -> token; open(token, param) -> text, or a 400 naming `param`."""

    def __init__(self):
        self._keys: dict[Path, Fernet] = {}  # by key file: the cache directory is read per use

    def _get(self) -> Fernet:
        path = key_path()
        if path not in self._keys:
            self._keys[path] = Fernet(_key())
        return self._keys[path]

    def seal(self, text: str) -> str:
        return self._get().encrypt(text.encode("utf-8")).decode("ascii")

    def open(self, token, param: str) -> str:
        if not isinstance(token, str):
            raise bad(f"{param} must be a string", param)
        try:
            return self._get().decrypt(token.encode("ascii")).decode("utf-8")
        except (InvalidToken, UnicodeError):
            raise bad(f"{param} does not open: it was not sealed by this server, or it was altered", param) \
                from None


SEALER = Sealer()


SUMMARY_HEAD = "A summary of our conversation so far:\n\n"  # how a compaction item is shown to the model


def seal_summary(text: str) -> str:
    return SEALER.seal(json.dumps({"compaction": text}))


def open_summary(token, param: str) -> str:
    """The summary a compaction item holds; a 400 naming `param` unless this server sealed it."""
    try:
        summary = json.loads(SEALER.open(token, param)).get("compaction")
    except (json.JSONDecodeError, AttributeError):
        summary = None
    if not isinstance(summary, str):
        raise bad(f"{param} is not a compaction this server made (it holds something else)", param)
    return summary
