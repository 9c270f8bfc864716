"""Shared fixtures: synthetic checkpoints written once per test session."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network
# the one way tests share fixtures: those defined here, and the module-scoped ones of these helper
# modules (world; ckpts; server, synth_pair; browser), requested by name from any test module, never imported
pytest_plugins = ("dspark_world", "synth_helpers", "serving_rig", "web_rig")


@pytest.fixture(scope="session", autouse=True)
def packed_weights_by_default():
    """In-process loads keep weights in pack precision unless a test asks for dense=True:
    the tests exercise the quantized paths a Mac runs, not the CPU's dense F32 copies
    (monolith.models.weights, "Dense weights on the CPU"; tests/test_dense.py covers those)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("monolith.models.weights.DENSE_MEMORY_SHARE", 0.0)
        yield


@dataclass(frozen=True)
class Caches:
    private: Path  # MONOLITH_CACHE during the session
    user: Path  # the cache monolith would have used for the runner ($MONOLITH_CACHE, else XDG's)
    runner_env: str | None  # the runner's own MONOLITH_CACHE


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """MONOLITH_CACHE in a temporary directory unless a test sets its own: what the code
    keeps there (packs, .verified records, the Responses sealing key) never lands in the
    user's cache. At the end of the session the user's cache must list the same names,
    sizes and mtimes as at its start (tests/test_cache_isolation.py checks the setup)."""
    from monolith.pack.manifest import cache_root

    user = cache_root().parent
    before = _listing(user)
    caches = Caches(tmp_path_factory.mktemp("monolith-cache"), user, os.environ.get("MONOLITH_CACHE"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MONOLITH_CACHE", str(caches.private))
        yield caches
    after = _listing(user)
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    assert not changed, (f"the test session changed the user's cache {user} (or another program wrote it "
                         f"meanwhile): {', '.join(changed[:10])}" + (" ..." if len(changed) > 10 else ""))


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    """Everything under `root` (nothing when it does not exist): relative name -> (size, mtime_ns)."""
    found = {}
    if root.exists():
        found["."] = (0, root.stat().st_mtime_ns)  # an entry made and removed again changes it
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            try:
                stat = path.lstat()
            except FileNotFoundError:  # removed while listed
                continue
            found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


@pytest.fixture(scope="module", autouse=True)
def report_measured(request):
    """After a module's tests, print what it recorded in its MEASURED dict (pytest -s)."""
    yield
    for label, value in sorted(getattr(request.module, "MEASURED", {}).items()):
        print(f"{label}: {value}")


def pytest_terminal_summary(terminalreporter):
    """How many greedy comparisons passed at a near-tie (oracles.assert_same_greedy)."""
    oracles = sys.modules.get("oracles")
    if oracles is not None and oracles.NEAR_TIES:
        terminalreporter.write_line(f"greedy outputs that parted at a near-tie (passed, counted): "
                                    f"{len(oracles.NEAR_TIES)} at (token, margin) {oracles.NEAR_TIES}")


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory):
    """synth_dir(kind, format, **kw) -> path of a synthetic checkpoint, cached per session."""
    from monolith.synth import write_draft, write_target

    root = tmp_path_factory.mktemp("synth")
    made: dict = {}

    def make(kind: str = "target", format: str = "bf16", **kw):
        key = (kind, format, tuple(sorted(kw.items())))
        if key not in made:
            name = "-".join([kind, format] + [f"{k}={v}" for k, v in sorted(kw.items())])
            if kind == "target":
                made[key] = write_target(root / name, format=format, **kw)
            else:
                target = make("target", kw.pop("target_format", "bf16"))
                made[key] = write_draft(root / name, target, format=format, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_pack(tmp_path_factory):
    """The pack of the default tiny synthetic target (bf16, seed 0), built once: tests
    read it and never change it."""
    from monolith.pack import build_pack
    from monolith.synth import write_target

    root = tmp_path_factory.mktemp("tiny")
    return build_pack(write_target(root / "ckpt"), root / "pack", role="target")


@pytest.fixture(scope="session")
def other_pack(tmp_path_factory):
    """The pack of a second tiny synthetic target (seed 1: other weights, the same
    tokenizer), for servers of several models."""
    from monolith.pack import build_pack
    from monolith.synth import write_target

    root = tmp_path_factory.mktemp("other")
    return build_pack(write_target(root / "ckpt", seed=1), root / "pack", role="target")


@pytest.fixture(scope="module")
def pack(tiny_pack):
    """The tiny target's pack (tiny_pack), as the serving and speculative tests name it."""
    return tiny_pack


@pytest.fixture(scope="module")
def model(pack):
    """The tiny target, float32, loaded per module (a module may patch it)."""
    from monolith.models import load_model

    return load_model(pack, dtype="float32")


@pytest.fixture(scope="module")
def tok(pack):
    from monolith.tokenizer import load_tokenizer

    return load_tokenizer(pack)


def _loaded_pair(cache_dir, target, draft, quantization="auto"):
    """(model, drafter, tokenizer) of a target and draft, float32, packed into cache_dir."""
    from monolith.engine_setup import load_drafter, load_target
    from monolith.tokenizer import load_tokenizer

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MONOLITH_CACHE", str(cache_dir))
        model = load_target(target, dtype="float32")
        drafter = load_drafter(draft, model, dtype="float32", quantization=quantization)
        return model, drafter, load_tokenizer(target)


@pytest.fixture(scope="session")
def demo_f32(tmp_path_factory):
    """The bundled demo pair, float32: (model, drafter, tokenizer). Shared: never change it."""
    from monolith.pack.demo import demo_pair

    cache = tmp_path_factory.mktemp("demo-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MONOLITH_CACHE", str(cache))
        target, draft = demo_pair()
    return _loaded_pair(cache, target, draft)


@pytest.fixture(scope="session")
def synth_pair_f32(tmp_path_factory):
    """The default synthetic target and draft (monolith.synth.write_pair), float32, the
    draft in BF16: (model, drafter, tokenizer)."""
    from monolith.synth import write_pair

    root = tmp_path_factory.mktemp("pair")
    target, draft = write_pair(root / "pair")
    return _loaded_pair(root / "cache", target, draft, quantization="none")


@pytest.fixture(scope="session")
def xml_model(tmp_path_factory):
    """(model, tokenizer) of the tiny synthetic target with the chat template Qwen3.5
    ships (tests/data/qwen3.5): its tool calls are XML, their string inputs raw text."""
    import shutil

    from monolith.models import load_model
    from monolith.pack import build_pack
    from monolith.synth import write_target
    from monolith.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("xml")
    checkpoint = write_target(root / "ckpt")
    shutil.copyfile(Path(__file__).parent / "data" / "qwen3.5" / "chat_template.jinja",
                    checkpoint / "chat_template.jinja")
    pack = build_pack(checkpoint, root / "pack", role="target")
    return load_model(pack, dtype="float32"), load_tokenizer(pack)
