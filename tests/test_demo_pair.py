"""The bundled demo pair (packs/demo, the embedded default): the bundle is what
expected.json records, its packs rebuild to the recorded pack_sha256s, the default path
builds and checks them once and refuses a pack that does not match, and the trained
draft is really bound to its target (greedy speculative == plain, tau above a floor)."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from monolith.pack import build_pack, resolve_pack, verify_pack
from monolith.pack.manifest import sha256_file
from decoding import plain
from monolith.sampling import SamplingParams
from monolith.runtime.scheduler import make_scheduler
from decoding import speculate
from monolith.pack import demo
from monolith.pack.demo import DEMO_PACKS, MTP_RECORD, DemoError, bundle_dir, demo_pair
from monolith.models import load_model, load_mtp
from monolith.runtime.mtp_drafter import MTPDrafter

BUNDLE = bundle_dir()
EXPECTED = json.loads((BUNDLE / demo.EXPECTED).read_text())

# Held-out-style prompts: Python source written here, not taken from the standard
# library the pair was trained on.
PROMPTS = [
    ('class LRUCache:\n    """A fixed-size cache that evicts the least recently used entry."""\n\n'
     "    def __init__(self, capacity):\n        self.capacity = capacity\n        self.entries = {}\n\n"
     "    def get(self, key):\n"),
    ('def parse_header(line):\n    """Split an HTTP header line into a (name, value) pair."""\n'
     '    name, sep, value = line.partition(":")\n    if not sep:\n'
     '        raise ValueError("malformed header: %r" % (line,))\n'),
    ("import os\nimport sys\n\n\ndef main(argv=None):\n"
     '    """Print every file under the given directory, sorted by size."""\n'
     "    if argv is None:\n        argv = sys.argv[1:]\n"),
    ("    def __repr__(self):\n"
     '        return "%s(%r, %r)" % (self.__class__.__name__, self.name, self.value)\n\n'
     "    def __eq__(self, other):\n        if not isinstance(other, Token):\n"),
]
GAMMA = 7
NEW_TOKENS = 64
# Pooled tau (accepted + 1 per round) on PROMPTS at gamma 7, greedy, float32, measured on
# the pair bundled with this test (issue 53's assistant recipe, Linux CPU): 3.65; with the
# target features zeroed (a draft not bound to its target) 1.26 (the pair before it: 3.45
# and 1.42). For the first bundled pair, broken bindings measured 1.5-2.0 (an NVFP4
# global scale dropped from one projection, features zeroed); tap ids shifted by one
# barely moved tau (tests/test_dspark.py checks the id convention). The floor sits well
# below 3.65 and above the broken cases.
TAU_FLOOR = 2.2
# The same for the target's trained MTP head (--with-mtp pack, NVFP4 as served, fed the
# post-final-norm hidden state): 2.31 measured on PROMPTS at gamma 7 (issue 53's pair).
# For the head bundled before it (2.57): fed the row's own token embedding as its hidden
# state (a head not bound to the target) 1.78, fed layer 2's output 2.38, the pre-norm
# last layer output 2.65 (the target's final norm scales every dimension by 1.12-1.33,
# which the head's own norm nearly undoes). The floor sits below 2.31 and above the
# unbound head.
MTP_TAU_FLOOR = 2.0


def test_the_bundle_is_what_expected_json_records():
    files = {f"{role}/{p.name}": p for role in DEMO_PACKS for p in sorted((BUNDLE / role).iterdir())}
    assert sorted(files) == sorted(EXPECTED["files"])
    for name, path in files.items():
        record = EXPECTED["files"][name]
        assert path.stat().st_size == record["bytes"], name
        assert sha256_file(path) == record["sha256"], name
    assert sum(f["bytes"] for f in EXPECTED["files"].values()) < 25 * 2**20  # well under the 50 MB budget


@pytest.mark.parametrize("record, role, with_mtp", [*((r, r, False) for r in DEMO_PACKS), (MTP_RECORD, "target", True)])
def test_the_bundled_packs_rebuild_to_the_recorded_hashes(record, role, with_mtp, tmp_path):
    pack = build_pack(BUNDLE / role, tmp_path / role, role=role, quantization=DEMO_PACKS[role], with_mtp=with_mtp)
    assert verify_pack(pack)["pack_sha256"] == EXPECTED["packs"][record]["pack_sha256"]


def test_the_default_pair_is_built_checked_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MONOLITH_CACHE", str(tmp_path / "cache"))
    logs: list[str] = []
    assert demo_pair(logs.append) == (BUNDLE / "target", BUNDLE / "draft")
    assert [m.split(" pack ")[0] for m in logs] == ["built the demo target", "built the demo draft"]
    packs = {role: resolve_pack(BUNDLE / role, role=role, quantization=q) for role, q in DEMO_PACKS.items()}
    stamps = {}
    for role, pack in packs.items():
        assert pack.parent == tmp_path / "cache" / "packs"
        assert verify_pack(pack)["pack_sha256"] == EXPECTED["packs"][role]["pack_sha256"]
        stamps[role] = (pack / "manifest.json").stat().st_mtime_ns
    logs.clear()
    demo_pair(logs.append)  # a later start: found in the cache, nothing rebuilt
    assert logs == [] and all((p / "manifest.json").stat().st_mtime_ns == stamps[r] for r, p in packs.items())


def copy_bundle(tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(BUNDLE, copy, ignore=shutil.ignore_patterns("*.py", "*.md", "*.sh", "__pycache__"))
    return copy


def cached_packs(tmp_path):
    return sorted(p.name for p in (tmp_path / "cache" / "packs").iterdir() if not p.name.startswith("."))


def test_a_wrong_recorded_hash_fails_and_leaves_no_pack(tmp_path, monkeypatch):
    monkeypatch.setenv("MONOLITH_CACHE", str(tmp_path / "cache"))
    bundle = copy_bundle(tmp_path)
    record = json.loads((bundle / demo.EXPECTED).read_text())
    real = record["packs"]["draft"]["pack_sha256"]
    record["packs"]["draft"]["pack_sha256"] = "0" * 64
    (bundle / demo.EXPECTED).write_text(json.dumps(record))
    with pytest.raises(DemoError, match=f"demo draft pack .*expected pack_sha256 {'0' * 64}, got {real}"):
        demo_pair(bundle=bundle)
    assert len(cached_packs(tmp_path)) == 1  # the target's; the draft's was removed
    with pytest.raises(DemoError, match="demo draft pack"):  # a second start does not trust anything
        demo_pair(bundle=bundle)


def flip_tensor_byte(path, name_part):
    """Invert the first byte of the first tensor whose name contains `name_part`."""
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    name = next(n for n in sorted(header) if name_part in n)
    data[8 + size + header[name]["data_offsets"][0]] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("role, file", [("target", "model.safetensors"), ("draft", "model.safetensors"),
                                        ("target", "tokenizer.json")])
def test_a_tampered_bundled_file_is_refused(role, file, tmp_path, monkeypatch):
    monkeypatch.setenv("MONOLITH_CACHE", str(tmp_path / "cache"))
    bundle = copy_bundle(tmp_path)
    path = bundle / role / file
    if file.endswith(".safetensors"):
        flip_tensor_byte(path, "layers.0.")
    else:
        path.write_text(path.read_text().replace('"<|im_end|>"', '"<|im_stop|>"', 1))
    with pytest.raises(DemoError, match=f"demo {role} pack .* differ from the record: {file}"):
        demo_pair(bundle=bundle)
    assert not [name for name in cached_packs(tmp_path) if f".{role}." in name]


def test_an_unrecorded_mtp_pack_is_refused_before_any_build(tmp_path, monkeypatch):
    monkeypatch.setenv("MONOLITH_CACHE", str(tmp_path / "cache"))
    bundle = copy_bundle(tmp_path)
    record = json.loads((bundle / demo.EXPECTED).read_text())
    del record["packs"][MTP_RECORD]
    (bundle / demo.EXPECTED).write_text(json.dumps(record))
    with pytest.raises(DemoError, match="no target pack with its MTP head recorded"):
        demo_pair(bundle=bundle, with_mtp=True)
    assert not (tmp_path / "cache").exists()


def test_a_missing_bundle_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "search_paths", lambda: [tmp_path / "nowhere"])
    with pytest.raises(DemoError, match="the bundled demo pair is missing .*reinstall monolith or give --model"):
        demo_pair()
    bundle = copy_bundle(tmp_path)
    shutil.rmtree(bundle / "draft")
    with pytest.raises(DemoError, match="the bundled demo draft is missing"):
        demo_pair(bundle=bundle)


@pytest.fixture(scope="module")
def loaded(demo_f32):
    return demo_f32


@pytest.fixture(scope="module")
def demo_mtp(tmp_path_factory):
    """The demo target from its --with-mtp pack, float32, and the drafter over its trained
    MTP head, as demo_pair(with_mtp=True) builds and checks them: (model, drafter)."""
    cache = tmp_path_factory.mktemp("demo-mtp-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MONOLITH_CACHE", str(cache))
        logs: list[str] = []
        target, _ = demo_pair(logs.append, with_mtp=True)
        assert logs[0].startswith("built the demo target pack with its MTP head")
        pack = resolve_pack(target, role="target", with_mtp=True)
    model = load_model(pack, dtype="float32")
    return model, MTPDrafter(load_mtp(pack, model))


def greedy_tau(model, drafter, tokenizer) -> float:
    """Pooled greedy tau of `drafter` on PROMPTS at GAMMA; every output equals plain greedy."""
    greedy = SamplingParams(temperature=0.0)
    accepted = rounds = 0
    for text in PROMPTS:
        prompt = tokenizer.encode(text, add_special_tokens=False)
        max_context = len(prompt) + NEW_TOKENS + GAMMA + 1
        plain_out = plain(model, prompt, NEW_TOKENS, greedy, [], max_context)
        spec = speculate(model, drafter, prompt, NEW_TOKENS, greedy, [], max_context, block_size=GAMMA,
                                    scheduler=make_scheduler("fixed"))
        assert spec.token_ids == plain_out.token_ids and len(plain_out.token_ids) == NEW_TOKENS
        accepted += sum(spec.speculative.accepted_per_round)
        rounds += spec.speculative.rounds
    return (accepted + rounds) / rounds


def test_greedy_speculative_equals_plain_with_tau_above_the_floor(loaded):
    tau = greedy_tau(*loaded)
    assert tau > TAU_FLOOR, f"tau {tau:.2f} on the demo prompts: is the draft bound to its target?"


def test_the_mtp_head_speculates_losslessly_with_tau_above_its_floor(demo_mtp, loaded):
    tau = greedy_tau(*demo_mtp, loaded[2])
    assert tau > MTP_TAU_FLOOR, f"MTP tau {tau:.2f} on the demo prompts: is the head trained and fed as served?"

