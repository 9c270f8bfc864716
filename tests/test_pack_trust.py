"""A pack is verified before it is used (issue 20): every tampering a reliability run
tried is refused at load through the functions serve uses, a verified pack is not
re-hashed on a later start until one of its files changes, `--verify-pack` always /
first / never, pack_sha256 covers every file and manifest field the runtime reads, and
the pack cache rebuilds a cached pack that fails verification."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import pytest
from pack_helpers import pack_tensor, run_cli

from monolith import chat, generate, serve
from monolith.engine_setup import (
    load_drafter,
    load_engine,
    load_target,
    resolve_sources,
)
from monolith.formats import SafetensorsFile
from monolith.model_flags import plan_model
from monolith.pack import (
    PackError,
    build_pack,
    read_manifest,
    resolve_pack,
    verify,
    verify_pack,
)
from monolith.pack import manifest as mf

SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test: its own pack cache (where verification records live) and a fresh process state."""
    monkeypatch.setenv("MONOLITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(verify, "_hashed", {})
    monkeypatch.setattr(verify, "_unchecked", set())


def new_start():
    """What a later start of the process knows: only the files on disk."""
    verify._hashed.clear()
    verify._unchecked.clear()


@pytest.fixture
def hashes(monkeypatch):
    """Every SHA-256 the pack code computes, counted."""
    calls = []
    real_bytes, real_file = mf.sha256_bytes, mf.sha256_file
    monkeypatch.setattr(mf, "sha256_bytes", lambda data: calls.append("bytes") or real_bytes(data))
    monkeypatch.setattr(mf, "sha256_file", lambda path: calls.append(str(path)) or real_file(path))
    return calls


@pytest.fixture
def pack(synth_dir, tmp_path):
    return build_pack(synth_dir("target", "bf16"), tmp_path / "pack", role="target")


@pytest.fixture
def draft_pack(synth_dir, tmp_path):
    return build_pack(synth_dir("draft", "deepspec"), tmp_path / "draft-pack", role="draft", quantization="none")


# ------------------------------------------------------------------ tampering
def flip_data_byte(pack, name):
    shard = pack / read_manifest(pack)["tensors"][name]["shard"]
    st = SafetensorsFile(shard)
    offset = st._data_start + st._entries[name][2] + 3
    st.close()
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x01
    shard.write_bytes(bytes(data))


def edit_header(pack, old: bytes, new: bytes):
    """Replace the first `old` in the shard's header by `new` (as long: the header keeps its length)."""
    assert len(old) == len(new)
    shard = pack / SHARD
    data = shard.read_bytes()
    size = int.from_bytes(data[:8], "little")
    head = data[8:8 + size]
    assert old in head, old
    shard.write_bytes(data[:8] + head.replace(old, new, 1) + data[8 + size:])


def edit_manifest(pack, change):
    path = pack / mf.MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def first_tensor(pack, dtype):
    return next(n for n, t in sorted(read_manifest(pack)["tensors"].items()) if t["dtype"] == dtype)


def change_tensor_hash(pack):
    name = first_tensor(pack, "BF16")
    edit_manifest(pack, lambda m: m["tensors"][name].update(sha256="0" * 64))


def change_pack_sha256(pack):
    edit_manifest(pack, lambda m: m.update(pack_sha256="0" * 64))


def edit_config(pack, rehash: bool):
    config = json.loads((pack / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = 0.5
    (pack / "config.json").write_text(json.dumps(config))
    if rehash:
        edit_manifest(pack, lambda m: m["aux_files"].update({"config.json": mf.sha256_file(pack / "config.json")}))


TAMPERINGS = {
    "flipped data byte": (lambda p: flip_data_byte(p, "lm_head.weight"),
                          rf"{SHARD}: tensor lm_head.weight: SHA-256 mismatch"),
    "tensor hash in the manifest": (change_tensor_hash, r"manifest.json: pack_sha256 mismatch"),
    "pack_sha256 in the manifest": (change_pack_sha256, r"manifest.json: pack_sha256 mismatch"),
    "header dtype F32 -> I32": (lambda p: edit_header(p, b'"dtype":"F32"', b'"dtype":"I32"'),
                                rf"{SHARD}: tensor \S+ is I32\[.*\], manifest says F32"),
    "header dtype BF16 -> F16": (lambda p: edit_header(p, b'"dtype":"BF16"', b'"dtype":"F16" '),
                                 rf"{SHARD}: tensor \S+ is F16\[.*\], manifest says BF16"),
    "config.json edited": (lambda p: edit_config(p, rehash=False), r"config.json: SHA-256 mismatch"),
    "config.json edited, its hash updated": (lambda p: edit_config(p, rehash=True),
                                             r"manifest.json: pack_sha256 mismatch"),
    "unlisted file": (lambda p: (p / "notes.txt").write_text("hi"), r"notes.txt: not listed in the manifest"),
}


def serve_start(*argv):
    """What `python -m monolith.serve ARGV` does before it answers: resolve and load."""
    args = serve.build_parser().parse_args([*argv, "--no-warmup", "--prompt-cache-size", "0", "--dtype", "float32"])
    engine = load_engine(args, plan_model(args), lambda message: None, max_batch=1)
    engine.close()


@pytest.mark.parametrize("tampering", list(TAMPERINGS))
def test_a_tampered_pack_is_refused_at_load(pack, tampering):
    tamper, message = TAMPERINGS[tampering]
    serve_start("--pack", str(pack), "--no-draft")  # verified and recorded as it is
    tamper(pack)
    new_start()
    with pytest.raises(PackError, match=message):
        serve_start("--pack", str(pack), "--no-draft")
    with pytest.raises(PackError, match=message):  # the library loader checks too
        load_target(pack, dtype="float32")
    assert not verify.record_path(pack).exists()  # nothing claims success
    with pytest.raises(PackError, match=message):  # the one verifier (`python -m monolith.pack verify`)
        verify_pack(pack)


def test_an_unlisted_chat_template_is_refused(synth_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(synth_dir("target", "bf16"), src)
    (src / "chat_template.jinja").unlink()  # the template is in tokenizer_config.json only
    pack = build_pack(src, tmp_path / "p", role="target")
    (pack / "chat_template.jinja").write_text("{{ 'pwned' }}")
    with pytest.raises(PackError, match="chat_template.jinja: not listed in the manifest"):
        serve_start("--pack", str(pack), "--no-draft")
    result = run_cli("verify", pack)
    assert result.returncode == 1 and "chat_template.jinja: not listed in the manifest" in result.stderr


def test_a_tampered_draft_pack_is_refused(pack, draft_pack):
    flip_data_byte(draft_pack, first_tensor(draft_pack, "BF16"))
    with pytest.raises(PackError, match=f"{draft_pack / SHARD}: tensor .* SHA-256 mismatch"):
        serve_start("--pack", str(pack), "--draft-pack", str(draft_pack))
    with pytest.raises(PackError, match="SHA-256 mismatch"):
        load_drafter(draft_pack, None, dtype="float32")  # refused before the target is even looked at


def test_a_shard_header_that_is_not_the_canonical_one_is_refused(pack):
    """The shard split is outside pack_sha256 (it does not depend on the shard size), so a
    shard's header must be exactly the one the builder writes for its tensors."""
    edit_header(pack, b'"format":"pt"', b'"format":"xx"')
    edit_manifest(pack, lambda m: m["shards"][SHARD].update(sha256=mf.sha256_file(pack / SHARD)))
    with pytest.raises(PackError, match=f"{SHARD}: the header is not the canonical one"):
        verify_pack(pack)


def test_an_old_format_pack_asks_for_a_rebuild(pack):
    edit_manifest(pack, lambda m: m.update(format_version=1))
    with pytest.raises(PackError, match="pack format version 1 is not supported.*rebuild"):
        serve_start("--pack", str(pack), "--no-draft")


# ------------------------------------------------------------------ pack_sha256 covers what the runtime reads
AUX = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
FIELDS = {
    "architecture": lambda m: m.update(architecture="qwen3_5"),
    "role": lambda m: m.update(role="draft"),
    "layout": lambda m: m["layout"].update(tied_embeddings=True),
    "entries": lambda m: next(iter(m["entries"].values())).update(shape=[1, 1]),
    "quantization": lambda m: m.update(quantization="nvfp4"),
    "tensor shape": lambda m: next(iter(m["tensors"].values())).update(shape=[1]),
}


@pytest.mark.parametrize("name", AUX)
def test_pack_sha256_covers_every_copied_file(pack, name):
    assert name in read_manifest(pack)["aux_files"]
    with open(pack / name, "a") as f:
        f.write("\n")
    edit_manifest(pack, lambda m: m["aux_files"].update({name: mf.sha256_file(pack / name)}))
    with pytest.raises(PackError, match="manifest.json: pack_sha256 mismatch"):
        verify_pack(pack)


@pytest.mark.parametrize("field", list(FIELDS))
def test_pack_sha256_covers_the_manifest_fields_the_runtime_reads(pack, field):
    edit_manifest(pack, FIELDS[field])
    with pytest.raises(PackError, match="manifest.json: pack_sha256 mismatch"):
        verify_pack(pack)


def test_pack_sha256_is_the_hash_of_the_manifest_without_the_shard_split(pack):
    """An independent statement of the definition: SHA-256 of the canonical JSON of the
    manifest minus pack_sha256, shards and each tensor's shard."""
    manifest = read_manifest(pack)
    covered = {k: v for k, v in manifest.items() if k not in ("pack_sha256", "shards")}
    covered["tensors"] = {n: {k: v for k, v in t.items() if k != "shard"} for n, t in manifest["tensors"].items()}
    text = json.dumps(covered, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    assert manifest["pack_sha256"] == hashlib.sha256(text).hexdigest()
    assert manifest["format_version"] == 2


# ------------------------------------------------------------------ when verification runs
def test_first_does_not_rehash_an_untouched_pack_on_a_later_start(pack, hashes):
    load_target(pack, dtype="float32")
    assert any(SHARD in h for h in hashes)
    assert verify.record_path(pack).is_file() and verify.record_path(pack).parent != pack
    new_start()
    hashes.clear()
    load_target(pack, dtype="float32")
    serve_start("--pack", str(pack), "--no-draft")
    assert hashes == []


def test_touching_a_file_triggers_reverification(pack, hashes):
    load_target(pack, dtype="float32")
    hashes.clear()
    stat = (pack / "tokenizer.json").stat()
    os.utime(pack / "tokenizer.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    load_target(pack, dtype="float32")
    assert any(SHARD in h for h in hashes)
    hashes.clear()
    new_start()
    load_target(pack, dtype="float32")  # verified again, recorded again
    assert hashes == []


def test_a_record_that_does_not_match_means_verify_again(pack, hashes):
    load_target(pack, dtype="float32")
    record = verify.record_path(pack)
    for forged in ("not json", json.dumps({"format": "x"}), record.read_text().replace('"pack"', '"other"')):
        record.write_text(forged)
        new_start()
        hashes.clear()
        load_target(pack, dtype="float32")
        assert any(SHARD in h for h in hashes), forged


def test_always_rehashes_on_every_start(pack, hashes):
    load_target(pack, dtype="float32")
    new_start()
    hashes.clear()
    serve_start("--pack", str(pack), "--no-draft", "--verify-pack", "always")
    assert sum(SHARD in h for h in hashes) == 1  # once per start, not once per check


def test_never_skips_and_says_so(pack, hashes, caplog):
    flip_data_byte(pack, "lm_head.weight")
    with caplog.at_level(logging.WARNING, logger="monolith.pack"):
        serve_start("--pack", str(pack), "--no-draft", "--verify-pack", "never")
    assert hashes == []
    assert any(str(pack) in r.getMessage() and "not checked" in r.getMessage() for r in caplog.records)
    assert not verify.record_path(pack).exists()


@pytest.mark.parametrize("module", [serve, chat, generate])
def test_every_command_takes_verify_pack(module):
    parser = module.build_parser()
    base = ["--model", "M", "--prompt-ids", "1"] if module is generate else []
    assert parser.parse_args(base).verify_pack == "first"
    assert parser.parse_args([*base, "--verify-pack", "never"]).verify_pack == "never"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--verify-pack", "sometimes"])


def test_generate_checks_the_pack_before_reading_it(pack, capsys):
    loads = []

    def load(pack_dir, dtype, verify):
        loads.append(verify)
        raise RuntimeError("loaded")

    flip_data_byte(pack, "lm_head.weight")
    assert generate.main(["--model", str(pack), "--chat", "hi"], load=load) == 1
    assert loads == [] and f"{SHARD}: tensor lm_head.weight: SHA-256 mismatch" in capsys.readouterr().err
    assert generate.main(["--model", str(pack), "--chat", "hi", "--verify-pack", "never"], load=load) == 1
    assert loads == ["never"] and "RuntimeError: loaded" in capsys.readouterr().err


# ------------------------------------------------------------------ the pack cache
def test_the_cache_rebuilds_a_cached_pack_that_fails_verification(synth_dir, tmp_path, caplog):
    src = synth_dir("target", "bf16")
    cached = resolve_pack(src, role="target")
    want = pack_tensor(cached, "lm_head.weight").tobytes()
    flip_data_byte(cached, "lm_head.weight")
    new_start()
    with caplog.at_level(logging.WARNING, logger="monolith.pack"):
        assert resolve_pack(src, role="target") == cached
    assert any("lm_head.weight" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records)
    assert pack_tensor(cached, "lm_head.weight").tobytes() == want
    edit_manifest(cached, lambda m: m.update(format_version=1))  # an old cached pack: rebuilt too
    new_start()
    assert read_manifest(resolve_pack(src, role="target"))["format_version"] == mf.PACK_FORMAT_VERSION
    assert verify_pack(cached) and sorted(p.name for p in cached.iterdir() if p.name.startswith(".")) == []


def test_the_demo_pack_with_lm_head_overwritten_is_rebuilt(caplog):
    """serve with no flags: the cached demo target's lm_head overwritten (it answered
    "!!!!!!!!") is found at the next start and the pack rebuilt from the bundle."""
    args = serve.build_parser().parse_args(["--no-draft"])
    plan = plan_model(args)
    target = resolve_sources(args, plan, lambda message: None).target_pack
    want = pack_tensor(target, "lm_head.weight").tobytes()
    shard = target / read_manifest(target)["tensors"]["lm_head.weight"]["shard"]
    st = SafetensorsFile(shard)
    _, _, begin, end = st._entries["lm_head.weight"]
    start = st._data_start
    st.close()
    with open(shard, "r+b") as f:
        f.seek(start + begin)
        f.write(b"!" * (end - begin))
    new_start()
    with caplog.at_level(logging.WARNING, logger="monolith.pack"):
        assert resolve_sources(args, plan, lambda message: None).target_pack == target
    assert any("lm_head.weight: SHA-256 mismatch" in r.getMessage() for r in caplog.records)
    assert pack_tensor(target, "lm_head.weight").tobytes() == want
    load_target(target, dtype="float32")
