"""Speculators-format draft heads against goldens computed by speculators 0.9.0 itself
(tests/reference/speculators_goldens.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from dspark_world import (
    GREEDY,
    SPECULATORS_DATA,
    context_of,
    np32,
)
from numeric import rel

from monolith.checkpoint import open_checkpoint
from monolith.engine_setup import load_target
from monolith.models import load_draft
from monolith.pack import build_pack
from monolith.synth import write_target

MEASURED: dict[str, object] = {}  # printed after the module's tests with pytest -s

# ------------------------------------------------------------------ speculators' own goldens


GOLDEN_CASES = ("causal-window", "noncausal-window", "bonus-anchor", "reduced-vocab")
GOLDEN_TOL = 1e-5  # max |ours - speculators| / max |speculators|: both F32 on the same bf16 weights (measured <= 7e-7)


@pytest.fixture(scope="module")
def golden_world(tmp_path_factory):
    """The synthetic tiny target (hidden 64, vocab 512) with the goldens' verifier embedding
    and lm_head put in, and the speculators checkpoints packed and loaded against it."""
    from monolith.formats import SafetensorsFile
    from monolith.formats.stfile import write_safetensors

    root = tmp_path_factory.mktemp("goldens")
    target_dir = write_target(root / "target", format="bf16", seed=0)
    verifier = SafetensorsFile(SPECULATORS_DATA / "verifier.safetensors")
    ckpt = open_checkpoint(target_dir)
    swaps = {"model.language_model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}
    for path in {ckpt.file_of(name) for name in swaps}:
        st = SafetensorsFile(path)
        tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
        for name, source in swaps.items():
            if name in tensors:
                assert tensors[name][0] == verifier.dtype(source) and tensors[name][1].shape == verifier.shape(source)
                tensors[name] = (verifier.dtype(source), np.array(verifier.read(source)))
        del st
        write_safetensors(path, tensors)
    target = load_target(target_dir, "float32", cache_dir=root / "cache")
    drafts = {}
    for case in GOLDEN_CASES:
        pack = build_pack(SPECULATORS_DATA / case, root / case, role="draft", quantization="none")
        drafts[case] = load_draft(pack, target, "float32")
    return target, drafts


def golden(case: str) -> dict:
    with np.load(SPECULATORS_DATA / f"{case}.npz") as data:
        return {k: data[k] for k in data.files}


def golden_errors(draft, want: dict) -> dict:
    """Our draft on the goldens' context and anchor, teacher-forced on their block tokens
    (the previous token of proposal j is block token j: the anchor, then x_1, ...), vs
    speculators' final-normed hidden states, corrected logits and confidence logits of
    the proposing slots."""
    ctx = context_of(draft, mx.array(want["features"]))
    tokens = want["block_tokens"]
    h = draft.forward(ctx, int(tokens[0]))
    first, gamma = (0 if draft.args.sample_from_anchor else 1), draft.max_proposals
    slots = h[first:first + gamma]
    prev = mx.array(tokens[:gamma].astype(np.int32))
    logits = draft.lm_head(slots).astype(mx.float32) + draft.markov.block_bias(prev, slots)
    confidence = draft.confidence_head.logits(slots, draft.markov.w1(prev))
    return {"h": rel(np32(h), want["hidden"]), "logits": rel(np32(logits), want["logits"][first:]),
            "confidence": rel(np32(confidence), want["confidence_logits"][first:])}


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_draft_matches_speculators_goldens(golden_world, case):
    """Packed from speculators' own save_pretrained checkpoints, our draft matches
    speculators' own forward (its anchor-block mask, decoder layers, Markov and
    confidence heads): a causal window with a full-attention layer, a non-causal
    window, sample_from_anchor false, a reduced vocabulary."""
    target, drafts = golden_world
    draft, want = drafts[case], golden(case)
    assert draft.args.sliding_windows[0] == 6 and len(want["features"]) == 16  # context longer than the window
    errs = golden_errors(draft, want)
    MEASURED[f"{case} vs speculators goldens (rel)"] = {k: f"{v:.1e}" for k, v in errs.items()}
    assert max(errs.values()) < GOLDEN_TOL, errs
    # propose itself: its first proposal conditions on the anchor only, as the golden's first slot
    first = 0 if draft.args.sample_from_anchor else 1
    p = draft.propose(context_of(draft, mx.array(want["features"])), int(want["block_tokens"][0]), 2, GREEDY)
    ids = np.arange(want["logits"].shape[1]) if draft.draft_to_target is None else np.array(draft.draft_to_target)
    assert int(np.array(p.tokens)[0]) == ids[int(np.argmax(want["logits"][first]))]
    assert abs(float(np.array(p.confidence)[0]) - 1 / (1 + np.exp(-want["confidence_logits"][first]))) < 1e-5


def test_speculators_goldens_see_the_mask_window_and_layout(golden_world):
    """The comparison above would notice a bidirectional block where speculators' is
    causal (and the reverse), a missing window, and the wrong slot layout."""
    _, drafts = golden_world
    causal, bidirectional, bonus = drafts["causal-window"], drafts["noncausal-window"], drafts["bonus-anchor"]
    assert causal.args.block_causal == (True, False)  # the full-attention layer is never causal
    assert bidirectional.args.block_causal == (False, False)
    assert causal.args.sample_from_anchor and not bonus.args.sample_from_anchor and bonus.max_proposals == 4
    flips = [(causal, "causal-window", lambda d: setattr(d.layers[0], "block_mask", None)),
             (bidirectional, "noncausal-window", lambda d: setattr(d.layers[0], "block_mask", "causal")),
             (causal, "causal-window", lambda d: setattr(d.layers[0], "window", None))]
    for draft, case, flip in flips:
        layer = draft.layers[0]
        saved = (layer.block_mask, layer.window)
        flip(draft)
        try:
            assert golden_errors(draft, golden(case))["logits"] > 100 * GOLDEN_TOL
        finally:
            layer.block_mask, layer.window = saved
    wrong = golden("bonus-anchor")
    wrong["logits"], wrong["confidence_logits"] = wrong["logits"][:-1], wrong["confidence_logits"][:-1]
    wrong["logits"] = np.concatenate([wrong["logits"][:1], wrong["logits"]])  # slot k against slot k - 1
    wrong["confidence_logits"] = np.concatenate([wrong["confidence_logits"][:1], wrong["confidence_logits"]])
    assert golden_errors(bonus, wrong)["logits"] > 100 * GOLDEN_TOL
