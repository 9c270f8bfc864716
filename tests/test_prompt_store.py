"""--prompt-cache-dir: saved states written as hashed safetensors survive a restart, and a
corrupt, truncated or foreign file is never loaded. References: a cold run (a fresh
Session, no prompt cache) for outputs; the directory's bytes for the bound."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from monolith.formats.stfile import SafetensorsFile
from monolith.runtime import state_file
from monolith.runtime.state_file import identity
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.events import GenerationRequest
from monolith.runtime.prompt_cache import PromptCache
from monolith.runtime.prompt_store import PromptStore

SYSTEM = "You are a careful agent. " * 12


def prompt(tok, question):
    ids = tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return ids, tuple(tok.message_ends(ids))


def ask(engine, ids, boundaries, max_tokens=6):
    _, finished = engine.run_request(GenerationRequest(tuple(ids), max_tokens, boundaries=boundaries))
    return finished


def ask_once(engine, ids, boundaries, max_tokens=6):
    """One request on a new engine, closed after it (which writes what is queued for the
    disk); (Finished, the prompt cache's stats)."""
    try:
        return ask(engine, ids, boundaries, max_tokens), engine.prompt_cache and engine.prompt_cache.stats
    finally:
        engine.close()


def cold(model, tok, ids):
    return ask_once(Engine(model, tok, Limits(max_context=512)), ids, ())[0].token_ids


def server(model, tok, directory, max_bytes=1 << 30, every=32):
    """An engine as serve makes it with --prompt-cache-dir (a fresh process as far as
    caches go: nothing in memory)."""
    store = PromptStore(directory, max_bytes, identity(model))
    return Engine(model, tok, Limits(max_context=512), prompt_cache=PromptCache(1 << 30, every, store))


def test_saved_states_survive_a_restart(model, tok, tmp_path):
    first, first_ends = prompt(tok, "List the files.")
    assert ask_once(server(model, tok, tmp_path), first, first_ends)[0].usage.cached_tokens == 0
    files = sorted(tmp_path.glob("*.safetensors"))
    assert files and not list(tmp_path.glob(".tmp-*"))
    second, ends = prompt(tok, "Now read the first one.")
    finished, stats = ask_once(server(model, tok, tmp_path), second, ends)
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    # the deepest state the first request saved before the prompts part: a message end or a multiple of 32
    deepest = max([e for e in first_ends if e <= common] + [common // 32 * 32])
    assert finished.usage.cached_tokens == deepest > 0 and stats.disk_hits == 1
    assert finished.token_ids == cold(model, tok, second)


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "corrupt":
        path.write_bytes(data[:-9] + bytes([data[-9] ^ 0x40]) + data[-8:])
    elif how == "truncated":
        path.write_bytes(data[: len(data) * 2 // 3])
    else:  # computed with another pack: the same file with another pack_sha256 in its identity
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        ident = json.loads(header["__metadata__"]["identity"])
        ident["pack_sha256"] = "f" * 64
        header["__metadata__"]["identity"] = json.dumps(ident, sort_keys=True)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])


@pytest.mark.parametrize("how", ["corrupt", "truncated", "foreign"])
def test_a_bad_file_is_ignored_with_a_warning(model, tok, tmp_path, caplog, how):
    ask_once(server(model, tok, tmp_path), *prompt(tok, "List the files."))
    for path in tmp_path.glob("*.safetensors"):  # every saved state: nothing valid is left
        damage(path, how)
    second, second_ends = prompt(tok, "Now read the first one.")
    with caplog.at_level(logging.WARNING, logger="monolith.prompt_cache"):
        finished, stats = ask_once(server(model, tok, tmp_path), second, second_ends)
    assert finished.usage.cached_tokens == 0 and stats.disk_hits == 0
    assert finished.token_ids == cold(model, tok, second)
    if how != "foreign":  # a foreign file is another model's: not this server's to read or warn about
        assert any("ignoring prompt-cache file" in r.getMessage() and str(tmp_path) in r.getMessage()
                   for r in caplog.records)


def test_a_write_that_fails_leaves_nothing(model, tok, tmp_path, monkeypatch):
    def fail(path, tensors, metadata=None):
        Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(state_file, "write_safetensors", fail)
    ask_once(server(model, tok, tmp_path), *prompt(tok, "List the files."))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / ".tmp-abc.safetensors").write_bytes(b"a write that died")  # a crash before the rename
    PromptStore(tmp_path, 1 << 20, identity(model)).close()
    assert list(tmp_path.iterdir()) == []


def test_the_directory_keeps_its_bound(model, tok, tmp_path):
    ask_once(server(model, tok, tmp_path, max_bytes=1 << 40), *prompt(tok, "List the files."))
    one = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    bound = one * 3 // 2
    (tmp_path / "bounded").mkdir()
    theirs = tmp_path / "bounded" / "weights.safetensors"  # not a state file: never counted or deleted
    theirs.write_bytes(b"x" * 10)
    for directory in (tmp_path / "bounded",):
        engine = server(model, tok, directory, max_bytes=bound)
        try:
            for question in ("List the files.", "Read a.py.", "Read b.py.", "Run the tests."):
                ask(engine, *prompt(tok, question))
                engine.prompt_cache.store.flush()
                held = sum(p.stat().st_size for p in directory.glob("*.safetensors") if p != theirs)
                assert held <= bound and held == engine.prompt_cache.store.nbytes
        finally:
            engine.close()
    assert theirs.read_bytes() == b"x" * 10
    # what is left loads: every file's chain of earlier files is still there
    store = PromptStore(tmp_path / "bounded", bound, identity(model))
    try:
        for entry in store._entries.values():
            assert entry.start == 0 or entry.base in store._entries
    finally:
        store.close()


def test_a_drafting_server_keeps_the_draft_context_across_a_restart(tmp_path, synth_pair_f32):
    from monolith.runtime.decoder import Decoder

    model, drafter, tok = synth_pair_f32
    directory = tmp_path / "saved-states"

    def engine(cache: bool):
        prompt_cache = None
        if cache:
            prompt_cache = PromptCache(1 << 30, 32, PromptStore(directory, 1 << 30, identity(model, drafter)))
        return Engine(model, tok, Limits(max_context=512), decoder=Decoder(model, drafter, 512),
                      prompt_cache=prompt_cache)

    first, first_ends = prompt(tok, "List the files.")
    second, ends = prompt(tok, "Now read the first one.")
    ask_once(engine(True), first, first_ends, max_tokens=12)
    restarted, _ = ask_once(engine(True), second, ends, max_tokens=12)
    cold_run, _ = ask_once(engine(False), second, (), max_tokens=12)
    assert restarted.usage.cached_tokens > 0 and restarted.token_ids == cold_run.token_ids
    # the draft proposed from the stored context as from its own: the same rounds, the same acceptance
    assert restarted.spec.drafts == cold_run.spec.drafts and restarted.spec.accepted_tokens == cold_run.spec.accepted_tokens
    names = {json.loads(SafetensorsFile(p).metadata["identity"])["draft_sha256"] for p in directory.glob("*.safetensors")}
    assert names == {drafter.draft.pack_sha256}
