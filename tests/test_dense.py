"""Dense weights on the CPU (monolith.models.weights): every matrix dequantized into F32
once at load gives the model the pack-precision kernels give (F32 compute), and `auto`
picks dense only on the CPU and only when the dense copy fits its memory share."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from monolith.models import load_draft, load_model, weights
from monolith.models.layers import Experts, Linear
from monolith.pack import build_pack, read_manifest
from monolith.sampling import SamplingParams

PROMPT = mx.array([401, 316, 265, 198, 71, 72, 402, 17, 5], dtype=mx.int32)


def matrices(obj, seen=None):
    """Every Linear / Experts a model holds."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, mx.array):
        return []
    seen.add(id(obj))
    if isinstance(obj, (Linear, Experts)):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [m for child in obj for m in matrices(child, seen)]
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("monolith."):
        return [m for child in vars(obj).values() for m in matrices(child, seen)]
    return []


def logits(model) -> np.ndarray:
    out, _ = model(PROMPT, model.make_cache(32))
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize("format", ["modelopt-nvfp4", "modelopt-mixed", "compressed-tensors", "bf16"])
def test_dense_target_equals_the_packed_one(synth_dir, tmp_path, format):
    pack = build_pack(synth_dir("target", format), tmp_path / "pack", role="target")
    packed = load_model(pack, "float32", dense=False)
    dense = load_model(pack, "float32", dense=True)
    assert any(m.mode is not None for m in matrices(packed)) or format == "bf16"
    assert all(m.mode is None and m.weight.dtype == mx.float32 for m in matrices(dense))
    want, got = logits(packed), logits(dense)
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_dense_draft_proposes_what_the_packed_draft_proposes(synth_dir, tmp_path):
    target = load_model(build_pack(synth_dir("target", "modelopt-nvfp4"), tmp_path / "t", role="target"), "float32")
    pack = build_pack(synth_dir("draft", "deepspec", target_format="modelopt-nvfp4"), tmp_path / "d", role="draft",
                      quantization="nvfp4")
    proposals = []
    for dense in (False, True):
        draft = load_draft(pack, target, "float32", dense=dense)
        ctx = draft.make_context(64)
        draft.append_context(ctx, mx.random.normal((12, len(draft.taps) * target.args.hidden_size),
                                                   key=mx.random.key(1)))
        proposals.append(draft.propose(ctx, 7, draft.max_proposals, SamplingParams(temperature=0.0)))
    (p, d) = proposals
    assert np.array(p.tokens).tolist() == np.array(d.tokens).tolist()
    assert np.abs(np.array(p.q) - np.array(d.q)).max() <= 1e-5


def test_auto_is_dense_on_the_cpu_only_where_it_fits(synth_dir, tmp_path, monkeypatch):
    manifest = read_manifest(build_pack(synth_dir("target", "modelopt-nvfp4"), tmp_path / "pack", role="target"))
    entries = manifest["entries"]
    matrices = {n for n, e in entries.items() if e["kind"] in ("linear", "experts")}
    embeddings = {n for n in matrices if n.endswith("embed_tokens")}
    monkeypatch.setattr(weights, "DENSE_MEMORY_SHARE", 0.25)
    monkeypatch.setattr(weights, "physical_memory", lambda: 24 << 30)
    on_cpu = mx.default_device() == mx.cpu
    # a small pack is dense whole, except its embedding (a row gather gains nothing from F32)
    assert weights.dense_entries(manifest) == (matrices - embeddings if on_cpu else set())
    assert embeddings

    # where the copies do not fit, they stay within the budget: linears first, smaller first
    def added(name):
        stored = sum(math.prod(t["shape"]) * {"U32": 4, "U8": 1, "F32": 4, "BF16": 2}[t["dtype"]]
                     for n, t in manifest["tensors"].items() if n.rsplit(".", 1)[0] == name)
        return 4 * math.prod(entries[name]["shape"]) - stored

    budget = sorted(added(n) for n in matrices - embeddings if entries[n]["kind"] == "linear")[5]
    monkeypatch.setattr(weights, "DENSE_FLOOR", budget)
    monkeypatch.setattr(weights, "DENSE_PACK_SHARE", 0.0)
    chosen = weights.dense_entries(manifest)
    if on_cpu:
        assert chosen and sum(added(n) for n in chosen) <= budget
        assert all(entries[n]["kind"] == "linear" for n in chosen)
        smallest_left = min(added(n) for n in matrices - embeddings - chosen if entries[n]["kind"] == "linear")
        assert smallest_left + sum(added(n) for n in chosen) > budget  # nothing else would have fit
    monkeypatch.setattr(weights, "physical_memory", lambda: 1 << 10)  # a quarter of it, 256 bytes, is the bound
    assert sum(added(n) for n in weights.dense_entries(manifest)) <= 256
    monkeypatch.setattr(weights, "physical_memory", lambda: 24 << 30)
    monkeypatch.setattr(weights.mx, "default_device", lambda: mx.gpu)  # a Mac: weights stay packed
    assert not weights.dense_entries(manifest)
