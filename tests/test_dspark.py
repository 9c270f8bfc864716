"""The DSpark / DFlash draft (monolith.models.dspark): the whole draft against a numpy
reference written from docs/drafts.md (tests/dspark_reference.py), YaRN against
transformers, the layer-id conventions of speculators vs DeepSpec twins, the context
cache and sampling."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from dspark_reference import ReferenceDraft
from dspark_world import (
    CONTEXT,
    GREEDY,
    TOL,
    WINDOW,
    context_of,
    np32,
)
from numeric import rel

from monolith.checkpoint import open_checkpoint
from monolith.models import Proposal, load_draft
from monolith.models.draft_args import yarn_parameters
from monolith.pack import build_pack, unpack_pack
from monolith.sampling import SamplingParams, filtered_probs

MEASURED: dict[str, object] = {}  # printed after the module's tests with pytest -s

# ------------------------------------------------------------------ whole draft vs the numpy reference


@pytest.mark.parametrize("name", ["deepspec-bf16", "deepspec-nvfp4-export", "deepspec-gated", "deepspec-rnn",
                                  "speculators-nvfp4", "speculators-full", "dflash-nvfp4", "dflash-causal",
                                  "dflash-scaled"])
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


# ------------------------------------------------------------------ a full-vocabulary speculators draft


def test_full_vocabulary_speculators_draft_packs_loads_and_speculates(world, tmp_path):
    """speculators over the target's whole vocabulary (draft_vocab_size = the target's, no
    lm_head, d2t or t2d, and config.py, whose code raises SystemExit, beside config.json):
    it packs reproducibly without config.py, binds the target's lm_head and embedding,
    never runs config.py, and greedy speculative output equals plain greedy output."""
    import sys

    from decoding import plain, speculate
    from oracles import assert_same_greedy

    from monolith.runtime.draft_model import DraftModelDrafter

    draft, pack = world["draft"]("speculators-full")
    src, target = world["root"] / "speculators-full", world["target"]
    config = json.loads((src / "config.json").read_text())
    assert (src / "config.py").is_file() and config["draft_vocab_size"] == target.args.vocab_size
    ckpt = open_checkpoint(src)
    assert not [n for n in ("lm_head.weight", "embed_tokens.weight", "d2t", "t2d") if ckpt.has(n)]
    again = build_pack(src, tmp_path / "again", role="draft", quantization="none")
    manifests = [json.loads((p / "manifest.json").read_text()) for p in (pack, again)]
    assert manifests[0]["pack_sha256"] == manifests[1]["pack_sha256"]
    assert not (pack / "config.py").exists() and "config.py" not in (pack / "conversion.json").read_text()
    assert draft.lm_head is target.lm_head and draft.embed_tokens is target.embed_tokens
    assert draft.draft_vocab == target.args.vocab_size and draft.draft_to_target is None
    assert not any(str(src) in str(getattr(m, "__file__", None) or "") for m in list(sys.modules.values()))

    prompt = world["tokens"][:12]
    want = plain(target, prompt, 24).token_ids
    got = speculate(target, DraftModelDrafter(draft), prompt, 24)
    assert got.speculative.rounds >= 1
    assert_same_greedy(target, prompt, got.token_ids, want)


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
