"""What the draft tests share: a tiny BF16 target (float32 compute), its token stream,
and drafts in every format built on demand (`world`)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from dspark_reference import ReferenceDraft

from monolith.checkpoint import open_checkpoint
from monolith.engine_setup import load_target
from monolith.models import load_draft
from monolith.pack import build_pack, unpack_pack
from monolith.sampling import SamplingParams
from monolith.synth import draft_sizes, write_draft, write_target

TOL = 1e-4  # max |ours - reference| / max |reference|, F32 compute vs the float64 reference
CONTEXT = 40  # context rows; the speculators drafts' sliding window is smaller
WINDOW = 16
SPECULATORS_DATA = Path(__file__).parent / "data" / "speculators"  # tests/reference/speculators_goldens.py
GREEDY = SamplingParams()

# name -> (format, pack quantization, markov head type, DraftSizes overrides[, config.json edits[, write_draft
# options]])
DRAFTS = {
    "deepspec-bf16": ("deepspec", "none", "vanilla", {}),
    "deepspec-nvfp4-export": ("deepspec-nvfp4", "auto", "vanilla", {}),
    "deepspec-gated": ("deepspec", "none", "gated", {}),
    "deepspec-rnn": ("deepspec", "none", "rnn", {}),
    "speculators-nvfp4": ("speculators", "auto", "vanilla", {"sliding_window": WINDOW}),
    "dflash-nvfp4": ("dflash", "auto", "vanilla", {}),
    # the layer-id convention twins: same seed, same sizes, BF16 so the picked rows are exact
    "twin-deepspec": ("deepspec", "none", "vanilla", {"sliding_window": WINDOW}),
    # a bidirectional block, as the DeepSpec twin's
    "twin-speculators": ("speculators", "none", "vanilla", {"sliding_window": WINDOW},
                         {"sliding_window_non_causal": True}),
    # dflash_config.causal: every layer's block is causal
    "dflash-causal": ("dflash", "auto", "vanilla", {}, {"dflash_config": {"causal": True}}),
    # the block's input embeddings scaled; is_causal false written out
    "dflash-scaled": ("dflash", "none", "vanilla", {}, {"dflash_config": {"input_embedding_scale": 2.5},
                                                        "is_causal": False}),
    # a reduced vocabulary reaching target id 459
    "speculators-460": ("speculators", "none", "vanilla", {"draft_vocab_size": 460}),
    # the target's whole vocabulary, as speculators saves it: no lm_head, d2t or t2d, and a config.py
    "speculators-full": ("speculators", "none", "vanilla", {"sliding_window": WINDOW}, {}, {"full_vocab": True}),
}


def edit_config(src, edits: dict) -> None:
    """Set config.json fields (a dict value updates that block)."""
    config = json.loads((src / "config.json").read_text())
    for key, value in edits.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    (src / "config.json").write_text(json.dumps(config))


def np32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny BF16 target (float32 compute), its token stream, and drafts built on demand."""
    root = tmp_path_factory.mktemp("dspark")
    target_dir = write_target(root / "target", format="bf16", seed=0)
    target = load_target(target_dir, "float32", cache_dir=root / "cache")
    ckpt = open_checkpoint(target_dir)
    embed, lm_head = ckpt.dequantize("model.language_model.embed_tokens"), ckpt.dequantize("lm_head")
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, target.args.vocab_size, CONTEXT + 1)]
    made = {}

    def draft(name):
        if name not in made:
            fmt, quantization, head_type, overrides, *edits = DRAFTS[name]
            edits, options = (edits + [{}, {}])[:2]
            sizes = replace(draft_sizes(json.loads((target_dir / "config.json").read_text())["text_config"]),
                            **overrides)
            src = write_draft(root / name, target_dir, format=fmt, seed=3, markov_head_type=head_type, sizes=sizes,
                              **options)
            if edits:
                edit_config(src, edits)
            pack = build_pack(src, root / (name + ".pack"), role="draft", quantization=quantization)
            made[name] = (load_draft(pack, target, "float32"), pack)
        return made[name]

    def reference(name):
        _, pack = draft(name)
        out = root / (name + ".unpacked")
        if not out.exists():
            unpack_pack(pack, out)
        return ReferenceDraft(out, embed.astype(np.float64), lm_head.astype(np.float64))

    def features(taps, n=CONTEXT):
        cache = target.make_cache(64)
        _, hidden = target(mx.array(tokens[:n], mx.int32), cache, taps=list(taps))
        return hidden

    return {"target": target, "target_dir": target_dir, "tokens": tokens, "draft": draft, "reference": reference,
            "features": features, "root": root}


def context_of(draft, features, max_context=64):
    ctx = draft.make_context(max_context)
    draft.append_context(ctx, features)
    return ctx
