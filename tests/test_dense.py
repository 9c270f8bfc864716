"""Dense weights on the CPU (monolith.models.loading): every matrix dequantized into F32
once at load gives the model the pack-precision kernels give (F32 compute), and `auto`
picks dense only on the CPU and only when the dense copy fits its memory share."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from monolith.models import load_model, loading
from monolith.models.dspark import load_draft
from monolith.models.layers import Experts, Linear
from monolith.pack import build_pack, read_manifest
from monolith.runtime.sampling import SamplingParams

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


def test_auto_is_dense_on_the_cpu_only_when_it_fits(synth_dir, tmp_path, monkeypatch):
    manifest = read_manifest(build_pack(synth_dir("target", "modelopt-nvfp4"), tmp_path / "pack", role="target"))
    monkeypatch.setattr(loading, "DENSE_MEMORY_SHARE", 0.25)
    monkeypatch.setattr(loading, "physical_memory", lambda: 24 << 30)
    assert loading.use_dense(manifest) == (mx.default_device() == mx.cpu)
    monkeypatch.setattr(loading, "physical_memory", lambda: 1 << 10)  # too small for the dense copy
    assert not loading.use_dense(manifest)
    monkeypatch.setattr(loading, "physical_memory", lambda: 24 << 30)
    monkeypatch.setattr(loading.mx, "default_device", lambda: mx.gpu)  # a Mac: weights stay packed
    assert not loading.use_dense(manifest)
