"""The DSpark / DFlash draft (monolith.models.dspark): speculators-format heads against
goldens computed by speculators 0.9.0 itself (tests/reference/speculators_goldens.py),
the whole draft against a numpy reference written from dspark.md
(tests/dspark_reference.py), YaRN against transformers, the
layer-id conventions of speculators vs DeepSpec twins, the context cache, sampling, and
the load-time checks against the target."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from dspark_reference import ReferenceDraft
from numeric import rel

from monolith.checkpoint import open_checkpoint
from monolith.launch import load_target
from monolith.models import DraftError, Proposal, load_draft
from monolith.models.draft_args import SpeculatorsDraftArgs, yarn_parameters
from monolith.pack import PackError, build_pack, unpack_pack
from monolith.sampling import SamplingParams, filtered_probs
from monolith.synth import Preset, draft_sizes, write_draft, write_target

TOL = 1e-4  # max |ours - reference| / max |reference|, F32 compute vs the float64 reference
CONTEXT = 40  # context rows; the speculators drafts' sliding window is smaller
WINDOW = 16
GREEDY = SamplingParams()
MEASURED: dict[str, object] = {}  # printed after the module's tests with pytest -s

# name -> (format, pack quantization, markov head type, DraftSizes overrides[, config.json edits])
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
            sizes = replace(draft_sizes(json.loads((target_dir / "config.json").read_text())["text_config"]),
                            **overrides)
            src = write_draft(root / name, target_dir, format=fmt, seed=3, markov_head_type=head_type, sizes=sizes)
            if edits:
                edit_config(src, edits[0])
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


# ------------------------------------------------------------------ speculators' own goldens


SPECULATORS_DATA = Path(__file__).parent / "data" / "speculators"  # tests/reference/speculators_goldens.py
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


# ------------------------------------------------------------------ whole draft vs the numpy reference


@pytest.mark.parametrize("name", ["deepspec-bf16", "deepspec-nvfp4-export", "deepspec-gated", "deepspec-rnn",
                                  "speculators-nvfp4", "dflash-nvfp4", "dflash-causal", "dflash-scaled"])
def test_draft_matches_reference(world, name):
    draft, _ = world["draft"](name)
    ref = world["reference"](name)
    assert draft.taps == ref.taps and draft.block_size == ref.block_size
    feats = world["features"](draft.taps)
    anchor, gamma = world["tokens"][CONTEXT], draft.max_proposals
    ctx = context_of(draft, feats)
    f64 = np.array(feats, np.float64)

    h = np32(draft.forward(ctx, anchor))
    want_h = ref.hidden(f64, anchor)
    p = draft.propose(ctx, anchor, gamma, GREEDY)
    tokens = np.array(p.tokens).tolist()
    u_ref, _, tokens_ref, conf_ref = ref.propose(f64, anchor, gamma)
    # ours, teacher-forced on our own greedy tokens: U_k and the Markov-corrected logits
    first = 0 if draft.args.sample_from_anchor else 1
    h_slots = draft.forward(ctx, anchor)[first:first + gamma]
    u = np32(draft.lm_head(h_slots))
    logits = u + (0 if draft.markov is None else
                  np32(draft.markov.block_bias(mx.array([anchor] + tokens[:-1], mx.int32), h_slots)))
    _, logits_forced, _, conf_forced = ref.propose(f64, anchor, gamma, forced=tokens)
    errs = {"h": rel(h, want_h), "U": rel(u, u_ref), "logits": rel(logits, logits_forced)}
    if p.confidence is not None:
        errs["confidence"] = float(np.abs(np.array(p.confidence) - conf_forced).max())
    MEASURED[f"draft {name} vs reference"] = {k: f"{v:.1e}" for k, v in errs.items()}
    assert max(errs.values()) < TOL, errs
    assert tokens == tokens_ref, f"greedy proposals {tokens} != reference {tokens_ref}"
    assert (p.confidence is None) == (conf_ref is None)
    if conf_ref is not None:
        assert np.abs(np.array(p.confidence) - conf_ref).max() < TOL

    # the logits propose samples from (temperature 1, no filter): log q against the reference
    key = mx.random.key(5)
    s = draft.propose(ctx, anchor, gamma, SamplingParams(temperature=1.0), key)
    sampled = np.array(s.tokens).tolist()
    _, logits_s, _, _ = ref.propose(f64, anchor, gamma, forced=sampled)
    ids = np.arange(logits_s.shape[1]) if ref.d2t is None else np.arange(len(ref.d2t)) + ref.d2t
    log_q = np.log(np.array(s.q, np.float64)[:, ids])
    want_log_q = logits_s - np.log(np.exp(logits_s - logits_s.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits_s.max(-1, keepdims=True)
    assert np.abs(log_q - want_log_q).max() < 1e-3


def test_sliding_window_matters_in_the_comparison(world):
    """The speculators comparison above runs with more context rows than the window: the
    reference without the window gives other hidden states than the draft."""
    draft, _ = world["draft"]("speculators-nvfp4")
    ref = world["reference"]("speculators-nvfp4")
    assert draft.args.sliding_windows == (WINDOW,) * draft.args.num_layers and CONTEXT > WINDOW
    feats = np.array(world["features"](draft.taps), np.float64)
    anchor = world["tokens"][CONTEXT]
    h = np32(draft.forward(context_of(draft, mx.array(feats.astype(np.float32))), anchor))
    ref.windows = [None] * draft.args.num_layers
    assert rel(h, ref.hidden(feats, anchor)) > 100 * TOL


def test_yarn_matches_transformers():
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [
        {"factor": 2.0, "original_max_position_embeddings": 2048},
        {"factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {"factor": 8.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.5},
        {"factor": 3.0, "original_max_position_embeddings": 8192, "attention_factor": 1.25},
    ]
    for head_dim, theta in ((128, 1e7), (64, 1e6)):
        for rope in cases:
            params = {"rope_type": "yarn", "rope_theta": theta, **rope}
            max_positions = int(rope["factor"] * rope["original_max_position_embeddings"])
            cfg = Qwen3Config(hidden_size=256, num_attention_heads=4, head_dim=head_dim,
                              max_position_embeddings=max_positions, rope_parameters=dict(params))
            want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
            got, factor = yarn_parameters(head_dim, theta, params, max_positions)
            assert np.allclose(got, want.numpy(), rtol=1e-6, atol=0), rope
            assert factor == pytest.approx(want_factor, rel=1e-12), rope


def test_dflash_reads_yarn_and_binds_the_target_vocabulary(world):
    draft, _ = world["draft"]("dflash-nvfp4")
    target = world["target"]
    assert draft.args.rope_inv_freq is not None and draft.args.rope_attention_factor > 1
    assert draft.embed_tokens is target.embed_tokens and draft.lm_head is target.lm_head
    assert draft.block_size == 16 and draft.max_proposals == 15
    assert draft.markov is None and draft.confidence_head is None
    # the reference comparison above would have noticed plain RoPE in place of YaRN
    ref = world["reference"]("dflash-nvfp4")
    feats = np.array(world["features"](draft.taps), np.float64)
    anchor = world["tokens"][CONTEXT]
    h = np32(draft.forward(context_of(draft, mx.array(feats.astype(np.float32))), anchor))
    ref.inv_freq = 1.0 / (draft.args.rope_theta ** (np.arange(0, draft.args.head_dim, 2) / draft.args.head_dim))
    ref.rope_scaling = 1.0
    MEASURED["dflash: h vs the reference with plain RoPE (rel)"] = rel(h, ref.hidden(feats, anchor))
    assert rel(h, ref.hidden(feats, anchor)) > 100 * TOL


def test_deepspec_ignores_inherited_target_rope_fields(world):
    """The synthetic DeepSpec config inherits partial_rotary_factor 0.25 and mrope fields
    from the target (as the real ones do): the draft's RoPE stays full width."""
    draft, _ = world["draft"]("deepspec-bf16")
    config = json.loads((world["root"] / "deepspec-bf16" / "config.json").read_text())
    assert config["partial_rotary_factor"] == 0.25 and config["attn_output_gate"] is True
    assert draft.rope.dims == draft.args.head_dim and draft.args.rope_inv_freq is None


def test_bfloat16_draft_tracks_float32(world):
    draft32, pack = world["draft"]("deepspec-nvfp4-export")
    draft16 = load_draft(pack, world["target"], "bfloat16")
    feats = world["features"](draft32.taps)
    anchor = world["tokens"][CONTEXT]
    u32 = np32(draft32.lm_head(draft32.forward(context_of(draft32, feats), anchor)))
    ctx16 = context_of(draft16, feats)
    u16 = np32(draft16.lm_head(draft16.forward(ctx16, anchor)))
    MEASURED["bf16 vs f32 draft: U (rel)"] = rel(u16, u32)
    assert rel(u16, u32) < 3e-2
    p = draft16.propose(ctx16, mx.array(anchor), draft16.max_proposals, GREEDY)  # an on-device anchor works too
    assert p.tokens.shape == (draft16.max_proposals,) and p.q.dtype == mx.float32


def test_confidence_head_without_markov_input(world, tmp_path):
    """confidence_head_with_markov false: c_k = sigmoid(w . h_k + b) from a [1, H] head
    (the DeepSpec checkpoint edited to that layout)."""
    from monolith.formats import SafetensorsFile
    from monolith.formats.stfile import write_safetensors

    world["draft"]("deepspec-bf16")
    src = world["root"] / "deepspec-bf16"
    edited = tmp_path / "no-markov-confidence"
    shutil.copytree(src, edited)
    config = json.loads((src / "config.json").read_text())
    config["confidence_head_with_markov"] = False
    (edited / "config.json").write_text(json.dumps(config))
    st = SafetensorsFile(src / "model.safetensors")
    tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
    dtype, w = tensors["confidence_head.proj.weight"]
    tensors["confidence_head.proj.weight"] = (dtype, np.ascontiguousarray(w[:, :config["hidden_size"]]))
    write_safetensors(edited / "model.safetensors", tensors)
    pack = build_pack(edited, tmp_path / "pack", role="draft", quantization="none")
    draft = load_draft(pack, world["target"], "float32")
    unpack_pack(pack, tmp_path / "unpacked")
    target_ckpt = open_checkpoint(world["target_dir"])
    ref = ReferenceDraft(tmp_path / "unpacked", None, target_ckpt.dequantize("lm_head").astype(np.float64))
    feats = world["features"](draft.taps)
    anchor = world["tokens"][CONTEXT]
    p = draft.propose(context_of(draft, feats), anchor, draft.max_proposals, GREEDY)
    _, _, tokens, conf = ref.propose(np.array(feats, np.float64), anchor, draft.max_proposals)
    assert np.array(p.tokens).tolist() == tokens
    MEASURED["confidence without Markov input vs reference (max abs)"] = float(np.abs(np.array(p.confidence) - conf).max())
    assert np.abs(np.array(p.confidence) - conf).max() < 1e-5


# ------------------------------------------------------------------ layer-id conventions


def test_speculators_and_deepspec_twins_propose_the_same(world):
    spec, _ = world["draft"]("twin-speculators")
    deep, _ = world["draft"]("twin-deepspec")
    aux = json.loads((world["root"] / "twin-speculators" / "config.json").read_text())["aux_hidden_state_layer_ids"]
    assert spec.taps == deep.taps == [i - 1 for i in aux]  # aux ids = DeepSpec ids + 1
    n = WINDOW - 4  # inside the window: the twins are exact twins
    feats = world["features"](spec.taps, n)
    anchor = world["tokens"][n]
    spec_ctx, deep_ctx = context_of(spec, feats), context_of(deep, feats)
    h_spec, h_deep = spec.forward(spec_ctx, anchor), deep.forward(deep_ctx, anchor)
    assert np.abs(np32(h_spec) - np32(h_deep)).max() == 0
    ids = np.array(spec.draft_to_target)  # the reduced vocabulary, as target ids
    gamma = spec.max_proposals

    def deep_logits(prev_tokens):  # the twin's corrected logits, teacher-forced, on the reduced rows
        u = deep.lm_head(h_deep[:gamma])
        bias = deep.markov.block_bias(mx.array([anchor] + prev_tokens[:-1], mx.int32), h_deep[:gamma])
        return (u + bias)[:, mx.array(ids)]

    greedy = spec.propose(spec_ctx, anchor, gamma, GREEDY)
    tokens = np.array(greedy.tokens).tolist()
    assert tokens == ids[np.argmax(np32(deep_logits(tokens)), axis=-1)].tolist()
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    sampled = spec.propose(spec_ctx, anchor, gamma, params, mx.random.key(3))
    s_tokens = np.array(sampled.tokens).tolist()
    q_twin = np.zeros((gamma, deep.target_vocab), np.float32)
    q_twin[:, ids] = np32(filtered_probs(deep_logits(s_tokens), params))
    q_err = float(np.abs(np.array(sampled.q) - q_twin).max())
    prev = mx.array([anchor] + s_tokens[:-1], mx.int32)
    conf_deep = mx.sigmoid(deep.confidence_head.logits(h_deep[:gamma], deep.markov.w1(prev)))
    assert np.abs(np.array(sampled.confidence) - np.array(conf_deep)).max() < 1e-6
    MEASURED["twins: max |q_speculators - q_deepspec restricted|"] = q_err
    assert q_err < 1e-6

    # the wrong convention (aux ids used as DeepSpec ids) reads layers one deeper
    wrong = [i + 1 for i in spec.taps]
    assert wrong == aux and all(w - t == 1 for w, t in zip(wrong, spec.taps))
    wrong_ctx = context_of(spec, world["features"](wrong, n))
    h_wrong = spec.forward(wrong_ctx, anchor)
    wrong_tokens = np.array(spec.propose(wrong_ctx, anchor, gamma, GREEDY).tokens).tolist()
    MEASURED["twins: h with shifted taps (rel diff)"] = rel(np32(h_wrong), np32(h_spec))
    MEASURED["twins: greedy tokens right / shifted"] = (tokens, wrong_tokens)
    # the proposal distributions move (total variation per slot); this random synthetic draft's
    # greedy tokens barely depend on the context, so they may well coincide
    tv = 0.5 * np.abs(np32(mx.softmax(spec.lm_head(h_wrong), -1)) - np32(mx.softmax(spec.lm_head(h_spec), -1))).sum(-1)
    MEASURED["twins: proposal TV distance with shifted taps (max over slots)"] = float(tv.max())
    assert rel(np32(h_wrong), np32(h_spec)) > 0.1 and tv.max() > 0.05


# ------------------------------------------------------------------ context cache


def test_context_in_rounds_equals_context_at_once_and_rewinds(world):
    draft, _ = world["draft"]("deepspec-gated")
    feats = world["features"](draft.taps, 30)
    tokens = world["tokens"]
    at_once = context_of(draft, feats)
    rounds = draft.make_context(64)
    start = 0
    for n in (5, 1, 8, 7, 9):  # a proposal between appends writes the block rows to scratch only
        draft.append_context(rounds, feats[start:start + n])
        start += n
        mx.eval(draft.propose(rounds, tokens[start], draft.max_proposals, GREEDY).tokens)
    assert rounds.offset == at_once.offset == 30
    diff = max(float(mx.abs(a[:, :, :30] - b[:, :, :30]).max()) for a, b in zip(rounds.arrays(), at_once.arrays()))
    h_rounds, h_once = np32(draft.forward(rounds, tokens[30])), np32(draft.forward(at_once, tokens[30]))
    MEASURED["context: rounds vs at once (max abs)"] = (diff, float(np.abs(h_rounds - h_once).max()))
    assert diff < 1e-5 and np.abs(h_rounds - h_once).max() < 1e-5

    at_once.restore(20)
    fresh = context_of(draft, feats[:20])
    assert np.abs(np32(draft.forward(at_once, tokens[20])) - np32(draft.forward(fresh, tokens[20]))).max() < 1e-5
    draft.append_context(at_once, feats[20:])
    assert np.abs(np32(draft.forward(at_once, tokens[30])) - h_once).max() < 1e-5
    with pytest.raises(ValueError, match="restore"):
        at_once.restore(31)
    with pytest.raises(ValueError, match="max_context"):
        draft.append_context(draft.make_context(8), feats[:9])
    with pytest.raises(ValueError, match="features"):
        draft.append_context(at_once, feats[:, :-1])


# ------------------------------------------------------------------ sampling


@pytest.mark.parametrize("name", ["deepspec-rnn", "speculators-nvfp4", "dflash-nvfp4"])
def test_sampled_proposals_reproduce_and_q_is_their_distribution(world, name):
    draft, _ = world["draft"](name)
    ctx = context_of(draft, world["features"](draft.taps))
    anchor, gamma = world["tokens"][CONTEXT], draft.max_proposals - 1
    params = SamplingParams(temperature=1.5, top_k=50, top_p=0.9, min_p=0.01)
    a = draft.propose(ctx, anchor, gamma, params, mx.random.key(42))
    b = draft.propose(ctx, anchor, gamma, params, mx.random.key(42))
    assert isinstance(a, Proposal) and a.tokens.dtype == mx.int32 and a.q.dtype == mx.float32
    assert a.tokens.shape == (gamma,) and a.q.shape == (gamma, draft.target_vocab)
    assert np.array_equal(np.array(a.tokens), np.array(b.tokens)) and np.array_equal(np.array(a.q), np.array(b.q))
    q, tokens = np.array(a.q), np.array(a.tokens)
    assert np.allclose(q.sum(-1), 1, atol=1e-5)
    assert (q[np.arange(gamma), tokens] > 0).all()
    draws = {tuple(np.array(draft.propose(ctx, anchor, gamma, params, mx.random.key(k)).tokens)) for k in range(8)}
    assert len(draws) > 1  # the key matters

    g = draft.propose(ctx, anchor, gamma, GREEDY)
    one_hot = np.zeros_like(q)
    one_hot[np.arange(gamma), np.array(g.tokens)] = 1
    assert np.array_equal(np.array(g.q), one_hot)
    with pytest.raises(ValueError, match="key"):
        draft.propose(ctx, anchor, gamma, params)
    with pytest.raises(ValueError, match="gamma"):
        draft.propose(ctx, anchor, draft.max_proposals + 1, GREEDY)


# ------------------------------------------------------------------ load-time checks


def _target(world, name, preset):
    root = world["root"]
    target_dir = root / f"target-{name}"
    if not target_dir.exists():
        write_target(target_dir, preset=preset, format="bf16", seed=0)
    return load_target(target_dir, "float32", cache_dir=root / "cache")


@pytest.mark.parametrize("case, preset, draft_name, field", [
    ("shallow", Preset(num_hidden_layers=2, full_attention_interval=2), "deepspec-bf16", "target_layer_ids"),
    ("shallow", Preset(num_hidden_layers=2, full_attention_interval=2), "twin-speculators",
     "aux_hidden_state_layer_ids"),
    ("wide", Preset(hidden_size=96), "deepspec-bf16", "hidden_size"),
    ("vocab640", Preset(vocab_size=640), "deepspec-bf16", "embed_tokens"),
    ("vocab640", Preset(vocab_size=640), "twin-speculators", "markov_head.markov_w1"),
    ("vocab448", Preset(vocab_size=448), "speculators-460", "d2t"),
    ("vocab448", Preset(vocab_size=448), "dflash-nvfp4", None),  # binds the target's: fits any vocabulary
])
def test_load_draft_checks_the_draft_against_the_target(world, case, preset, draft_name, field):
    _, pack = world["draft"](draft_name)
    target = _target(world, case, preset)
    if field is None:
        assert load_draft(pack, target, "float32").draft_vocab == 448
        return
    with pytest.raises(DraftError, match=field.replace(".", r"\.")):
        load_draft(pack, target, "float32")


def test_reduced_vocabulary_without_d2t_and_missing_settings(world, tmp_path):
    _, pack = world["draft"]("twin-speculators")
    broken = tmp_path / "no-d2t"
    shutil.copytree(pack, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    del manifest["entries"]["d2t"]
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DraftError, match="without a d2t"):
        load_draft(broken, world["target"], "float32")
    settings = manifest["layout"]["draft"]
    config = json.loads((broken / "config.json").read_text())
    for field in ("mask_token_id", "block_size"):
        with pytest.raises(DraftError, match=field):
            SpeculatorsDraftArgs.from_pack(config, {**settings, field: None}, "dspark-speculators",
                                            "config.json")


# ------------------------------------------------------------------ what the pack reads from a draft's config


def settings_of(src, tmp_path, edits=None, drop=()):
    """draft_settings of a copy of the checkpoint `src` with config.json fields set
    (edit_config) and top-level fields dropped."""
    from monolith.pack.draft_recipe import draft_settings

    out = tmp_path / f"edited-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(src, out)
    edit_config(out, edits or {})
    config = json.loads((out / "config.json").read_text())
    for key in drop:
        del config[key]
    (out / "config.json").write_text(json.dumps(config))
    return draft_settings(open_checkpoint(out))


SLIDING_FULL = {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True,
                "sliding_window": 8}


@pytest.mark.parametrize("source, edits, drop, windows, causal", [
    # speculators: non_causal = sliding_window is None or sliding_window_non_causal, per layer
    ("causal-window", {}, (), [6, None], [True, False]),
    ("causal-window", {}, ("sliding_window_non_causal",), [6, None], [True, False]),  # its default: false
    ("causal-window", {"sliding_window_non_causal": True}, (), [6, None], [False, False]),
    ("causal-window", {"transformer_layer_config": {"use_sliding_window": False}}, (), [None, None], [False, False]),
    ("causal-window", {"is_causal": True}, (), "is_causal", None),
    ("causal-window", {"dflash_config": {"causal": True}}, (), "dflash_config", None),
    ("causal-window", {"sliding_window_non_causal": "no"}, (), "sliding_window_non_causal", None),
    # elsewhere (vLLM's _dflash_layer_causal): is_causal, else dflash_config.causal, else the sliding layers
    ("dflash", {}, (), [None, None], [False, False]),
    ("dflash", SLIDING_FULL, (), [8, None], [True, False]),
    ("dflash", {**SLIDING_FULL, "dflash_config": {"causal": False}}, (), [8, None], [False, False]),
    ("dflash", {**SLIDING_FULL, "dflash_config": {"causal": False}, "is_causal": True}, (), [8, None], [True, True]),
    ("dflash", {"dflash_config": {"causal": True}}, (), [None, None], [True, True]),
    ("dflash", {"sliding_window_non_causal": False}, (), "sliding_window_non_causal", None),
    ("dflash", {**SLIDING_FULL, "use_sliding_window": False}, (), "without a window", None),
    ("dflash", {"layer_types": ["full_attention"]}, (), "layer_types", None),
    ("dflash", {"dflash_config": {"causal": 1}}, (), "dflash_config.causal", None),
    ("dflash", {"dflash_config": {"use_swa": True}}, (), "dflash_config.use_swa", None),
    ("dflash", {"dflash_config": {"swa_window_size": 8}}, (), "dflash_config.swa_window_size", None),
    ("dflash", {"dflash_config": {"use_aux_hidden_state": False}}, (), "use_aux_hidden_state", None),
])
def test_block_mask_settings(world, tmp_path, source, edits, drop, windows, causal):
    """Per layer, the window and whether the block is causal, as speculators' mask
    function (speculators drafts) or vLLM's DFlash loader (the others) reads them; a
    field that would change the mask in one of them and is not read is refused."""
    if source == "dflash":
        world["draft"]("dflash-nvfp4")
        src = world["root"] / "dflash-nvfp4"
    else:
        src = SPECULATORS_DATA / source
    if causal is None:
        with pytest.raises(PackError, match=windows):
            settings_of(src, tmp_path, edits, drop)
        return
    settings = settings_of(src, tmp_path, edits, drop)
    assert (settings["sliding_windows"], settings["block_causal"]) == (windows, causal)


@pytest.mark.parametrize("source, edits, drop, want", [
    ("bonus-anchor", {}, (), False),
    # speculators_config: block_size 5 - speculative_tokens 4 = 1, the anchor is the bonus token
    ("bonus-anchor", {}, ("sample_from_anchor",), False),
    ("causal-window", {}, ("sample_from_anchor",), True),
    ("bonus-anchor", {"sample_from_anchor": True}, (),
     "sample_from_anchor True and block_size 5 - speculative_tokens 4"),
    ("bonus-anchor", {}, ("sample_from_anchor", "speculators_config"), "neither sample_from_anchor nor"),
    ("bonus-anchor", {"speculators_config": {"proposal_methods": [{"proposal_type": "greedy",
                                                                   "speculative_tokens": 2}]}}, (), "differ by"),
    ("bonus-anchor", {"speculators_config": {"default_proposal_method": "tree"}}, (), "default_proposal_method"),
    ("dflash", {}, (), False),
    ("dflash", {"dflash_config": {"sample_from_anchor": True}}, (), True),
    ("dflash", {"dspark_bonus_anchor": False}, (), True),
    ("dflash", {"dspark_bonus_anchor": True, "sample_from_anchor": True}, (), "contradict"),
    ("deepspec", {}, (), True),
    ("deepspec", {"dspark_bonus_anchor": True}, (), False),
])
def test_sample_from_anchor_settings(world, tmp_path, source, edits, drop, want):
    """Whether slot 0 predicts: every field that states it must agree (a speculators
    draft's block_size minus its default proposal method's speculative_tokens among
    them); unstated, DeepSpec's convention is true and DFlash's false, and a speculators
    draft must state it (speculators reads a missing field as true, vLLM as false)."""
    if source in ("dflash", "deepspec"):
        name = "dflash-nvfp4" if source == "dflash" else "deepspec-bf16"
        world["draft"](name)
        src = world["root"] / name
    else:
        src = SPECULATORS_DATA / source
    if isinstance(want, str):
        with pytest.raises(PackError, match=want):
            settings_of(src, tmp_path, edits, drop)
        return
    assert settings_of(src, tmp_path, edits, drop)["sample_from_anchor"] is want


def test_input_embedding_scale_settings(world, tmp_path):
    world["draft"]("dflash-nvfp4")
    src = world["root"] / "dflash-nvfp4"
    assert settings_of(src, tmp_path)["input_embedding_scale"] == 1.0
    assert settings_of(src, tmp_path, {"dflash_config": {"input_embedding_scale": 0.5}})["input_embedding_scale"] == 0.5
    for bad in (0, -1.0, float("nan"), "2", True):
        with pytest.raises(PackError, match="input_embedding_scale"):
            settings_of(src, tmp_path, {"dflash_config": {"input_embedding_scale": bad}})


def test_dflash_labelled_draft_with_markov_heads_runs_them(world, tmp_path):
    """A DSpark head whose config says DFlashDraftModel / dflash_config and omits the
    Markov fields (as a Qwen3.6-27B head does) gets its heads from its tensors: it
    proposes exactly what the same weights as a DeepSpec draft propose."""
    deep, _ = world["draft"]("deepspec-bf16")
    src = world["root"] / "deepspec-bf16"
    config = json.loads((src / "config.json").read_text())
    relabelled = tmp_path / "relabelled"
    shutil.copytree(src, relabelled)
    for key in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                "block_size", "mask_token_id", "target_layer_ids"):
        del config[key]
    config |= {"architectures": ["DFlashDraftModel"],
               "dflash_config": {"block_size": deep.block_size, "mask_token_id": deep.args.mask_token_id,
                                 "target_layer_ids": deep.taps, "sample_from_anchor": True}}
    (relabelled / "config.json").write_text(json.dumps(config))
    pack = build_pack(relabelled, tmp_path / "pack", role="draft", quantization="none")
    draft = load_draft(pack, world["target"], "float32")
    assert draft.args.architecture == "dflash" and draft.args.markov_rank == deep.args.markov_rank
    assert draft.args.confidence_head and draft.args.confidence_with_markov
    feats, anchor = world["features"](draft.taps), world["tokens"][CONTEXT]
    a = draft.propose(context_of(draft, feats), anchor, draft.max_proposals, GREEDY)
    b = deep.propose(context_of(deep, feats), anchor, deep.max_proposals, GREEDY)
    assert np.array_equal(np.array(a.tokens), np.array(b.tokens))
    assert np.array_equal(np.array(a.confidence), np.array(b.confidence))
    # unstated, sample_from_anchor follows the tensors too: a DSpark head predicts from every slot
    del config["dflash_config"]["sample_from_anchor"]
    (relabelled / "config.json").write_text(json.dumps(config))
    assert settings_of(relabelled, tmp_path)["sample_from_anchor"] is True
    # the heads' fields, when stated, must agree with the tensors
    for edits, field in (({"markov_rank": 0}, "markov_rank 0"), ({"markov_rank": 4}, "markov_rank 4"),
                         ({"markov_head_type": "gated"}, "markov_head.gate_proj"),
                         ({"enable_confidence_head": False}, "enable_confidence_head"),
                         ({"confidence_head_with_markov": False}, "confidence_head_with_markov")):
        with pytest.raises(PackError, match=field):
            settings_of(relabelled, tmp_path, {"dflash_config": edits})


def test_detect_architecture_names_the_layout():
    from monolith.checkpoint.config import detect_architecture

    assert detect_architecture({"model_type": "qwen3", "dspark_config": {"block_size": 7}}, "c") == "dspark"
    assert detect_architecture({"architectures": ["Qwen3DSparkModel"], "dflash_config": {}}, "c") == "dspark"
    assert detect_architecture({"architectures": ["DFlashDraftModel"], "dflash_config": {"markov_rank": 8}},
                               "c") == "dflash"
    assert detect_architecture({"architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark"},
                               "c") == "dspark-speculators"


def test_every_architecture_has_one_model_and_every_draft_one_pack_format():
    """The architecture names live in monolith.checkpoint.config alone: the models'
    registry covers each of them, the draft recipe's formats each draft, nothing else."""
    from monolith.checkpoint.config import ARCHITECTURE_ROLES
    from monolith.models import MODELS, Draft
    from monolith.pack.draft_recipe import DRAFT_FORMATS

    drafts = {name for name, role in ARCHITECTURE_ROLES.items() if role == "draft"}
    assert set(MODELS) == set(ARCHITECTURE_ROLES) and drafts
    assert {name for name, (model, _) in MODELS.items() if model is Draft} == drafts
    assert set(DRAFT_FORMATS) == drafts
