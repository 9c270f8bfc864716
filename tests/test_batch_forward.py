"""Batched forwards (Qwen3_5.forward_batch, Draft.forward_batch): several sequences'
rows packed through the linears, mixers per sequence. Each segment's logits, taps and
cache afterwards equal those of the same forward run alone; a recorded verify commits as
after a single forward; bad batches fail before any state changes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from dspark_world import GREEDY, context_of, np32
from metal_emulator import requires_emulator, run_kernel
from numeric import rel
from oracles import NEAR_TIE, STATE_TOL

from monolith.kernels import kernel as kernel_module
from monolith.models import Segment, load_model
from monolith.models.cache import CacheError, GDNState, KVCache
from monolith.pack import build_pack
from monolith.runtime.prefill import prefill
from monolith.sampling import SamplingParams
from monolith.synth import write_target

# max |batched - alone| / max |alone|, float32: packing changes only the row count of the
# matmuls. With the Linux wheel's bundled BLAS every packed row comes out bit for bit as
# alone (measured 0.0 for logits, taps, states and draft hidden states, also with the
# Metal kernels emulated); OpenBLAS (docs/performance.md) picks other kernels by row count:
# up to 1.2e-5 measured. The bound is oracles.STATE_TOL's.
TOL = STATE_TOL
MEASURED: dict[str, object] = {}  # printed after the module's tests with pytest -s
MAX_CONTEXT = 48

# per segment: (rows already in its cache, new rows, taps, logits). 34 rows in all: with
# top-2 routing the batch takes SwitchGLU's expert-sorted path (>= 64 row-experts), each
# segment alone the unsorted one
PLAN = [(5, 1, (0, 2), "all"), (17, 8, (1,), "all"), (0, 13, (), "none"), (9, 12, (3,), "last")]
# without Metal, segments of one length run the GDN and the attention prologue stacked:
# interleaved lengths (two stacked groups, gathered from around each other) and a decode
# batch (one group, contiguous: reshaped, not gathered)
STACKED = [(5, 1, (0, 2), "all"), (17, 8, (1,), "all"), (30, 1, (), "all"), (9, 8, (), "all"), (0, 1, (3,), "last")]
DECODE = [(5, 1, (1,), "all"), (17, 1, (), "all"), (30, 1, (0,), "all"), (2, 1, (), "all")]


@pytest.fixture(scope="module")
def targets(tiny_pack, tmp_path_factory):
    """{"moe": the tiny MoE target, "dense": a tiny dense one}, float32."""
    root = tmp_path_factory.mktemp("batch")
    dense = build_pack(write_target(root / "dense", dense=True, seed=2), root / "dense.pack", role="target")
    return {"moe": load_model(tiny_pack, dtype="float32"), "dense": load_model(dense, dtype="float32")}


def ids(model, n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, model.args.vocab_size, n).astype(np.int32))


def prepared(model, plan=PLAN):
    """One cache per plan entry, prefilled with its own rows, and the new rows' segments."""
    segments = []
    for i, (before, rows, taps, logits) in enumerate(plan):
        cache = model.make_cache(MAX_CONTEXT)
        if before:
            prefill(model, ids(model, before, 10 + i), cache, chunk_size=7)
        segments.append(Segment(ids(model, rows, 20 + i), cache, taps, logits))
    return segments


def cache_arrays(cache) -> list[np.ndarray]:
    """The committed KV rows and the GDN states of a cache."""
    out = []
    for layer in cache.layers:
        if isinstance(layer, KVCache):
            out += [np.array(layer.keys[:, :, :cache.offset]), np.array(layer.values[:, :, :cache.offset])]
        else:
            out += [np.array(layer.conv), np.array(layer.recurrent)]
    return out


def max_rel(pairs) -> float:
    return max((rel(a, b) for a, b in pairs), default=0.0)


@pytest.mark.parametrize("plan", [PLAN, STACKED, DECODE], ids=["lengths", "stacked", "decode"])
@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_batched_equals_one_at_a_time(targets, kind, plan):
    model = targets[kind]
    batch, alone = prepared(model, plan), prepared(model, plan)
    got = model.forward_batch(batch)
    want = [model.forward(s.tokens, s.cache, s.taps, s.logits) for s in alone]
    logit_pairs, tap_pairs, state_pairs = [], [], []
    for s, w, (g_logits, g_hidden), (w_logits, w_hidden), entry in zip(batch, alone, got, want, plan):
        _, rows, taps, mode = entry
        assert (g_logits is None) == (mode == "none") and (g_hidden is None) == (not taps)
        if g_logits is not None:
            assert g_logits.dtype == mx.float32 and g_logits.shape == w_logits.shape
            assert g_logits.shape[0] == (rows if mode == "all" else 1)
            logit_pairs.append((np.array(g_logits), np.array(w_logits)))
        if g_hidden is not None:
            assert g_hidden.shape == (rows, len(taps) * model.args.hidden_size) == w_hidden.shape
            tap_pairs.append((np.array(g_hidden), np.array(w_hidden)))
        assert s.cache.offset == w.cache.offset == entry[0] + rows
        state_pairs += zip(cache_arrays(s.cache), cache_arrays(w.cache))
    errs = {"logits": max_rel(logit_pairs), "taps": max_rel(tap_pairs), "caches": max_rel(state_pairs)}
    for what, err in errs.items():
        key = f"{kind}: batched vs alone, max rel {what}"
        MEASURED[key] = max(MEASURED.get(key, 0.0), err)
        assert err <= TOL, f"{kind} {what}: {err:.3g}"

    # greedy: every row's argmax agrees unless its top-1/top-2 margin is a near-tie
    for g, w in logit_pairs:
        top = np.sort(w, axis=-1)
        clear = top[:, -1] - top[:, -2] >= NEAR_TIE
        np.testing.assert_array_equal(g.argmax(-1)[clear], w.argmax(-1)[clear])

    # the caches go on decoding as the lone ones do
    follow = [model.forward(ids(model, 3, 40 + i), s.cache)[0] for i, s in enumerate(batch)]
    again = [model.forward(ids(model, 3, 40 + i), s.cache)[0] for i, s in enumerate(alone)]
    err = MEASURED[f"{kind}: next forward after the batch, max rel logits"] = max_rel(
        (np.array(a), np.array(b)) for a, b in zip(follow, again))
    assert err <= TOL


def test_one_segment_is_forward(targets):
    """forward is a one-segment forward_batch: the same arrays, bit for bit."""
    model = targets["moe"]
    (one,), (two,) = prepared(model, PLAN[1:2]), prepared(model, PLAN[1:2])
    (logits, hidden), = model.forward_batch([one])
    want_logits, want_hidden = model.forward(two.tokens, two.cache, list(two.taps))
    np.testing.assert_array_equal(np.array(logits), np.array(want_logits))
    np.testing.assert_array_equal(np.array(hidden), np.array(want_hidden))
    for a, b in zip(cache_arrays(one.cache), cache_arrays(two.cache)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_a_recorded_verify_commits_as_after_a_single_forward(targets, kind):
    model = targets[kind]
    plan = [(11, 8, (0, 2), "all"), (6, 1, (), "all")]
    errs = []
    for keep in (0, 1, 3, 7, 8):
        (verify, plain), (alone, _) = prepared(model, plan), prepared(model, plan)
        snap, plain_snap = verify.cache.snapshot(record=True), plain.cache.snapshot()
        model.forward_batch([verify, plain])
        want_snap = alone.cache.snapshot(record=True)
        model.forward(alone.tokens, alone.cache, alone.taps)
        gdn = [layer for layer in plain.cache.layers if isinstance(layer, GDNState)]
        assert plain.cache.tape_offset is None and all(layer.tape is None for layer in gdn)
        with pytest.raises(CacheError, match="recorded"):
            plain.cache.commit(plain_snap, 0)  # the plain segment recorded nothing
        verify.cache.commit(snap, keep)
        alone.cache.commit(want_snap, keep)
        assert verify.cache.offset == alone.cache.offset == 11 + keep
        errs.append(max_rel(zip(cache_arrays(verify.cache), cache_arrays(alone.cache))))
        nxt = ids(model, 2, 50 + keep)
        errs.append(rel(np.array(model.forward(nxt, verify.cache)[0]), np.array(model.forward(nxt, alone.cache)[0])))
    err = MEASURED[f"{kind}: commit after a batched verify, max rel states / next logits"] = max(errs)
    assert err <= TOL


@requires_emulator
def test_the_metal_kernels_take_packed_and_per_segment_rows(targets, monkeypatch):
    """With the Metal kernels emulated (as a Mac runs them: tests/test_kernels_model.py),
    the kernels take the packed rows and the per-segment slices of them, and a batch
    still gives each segment what it gets alone."""
    model = targets["moe"]
    plan = [(5, 1, (0, 2), "all"), (9, 8, (1,), "all"), (0, 3, (), "last")]
    calls = []

    def call(self, launch):
        calls.append(self.name)
        return run_kernel(self, launch)

    monkeypatch.setattr(kernel_module, "backend", lambda: "metal")
    monkeypatch.setattr(kernel_module.MetalKernel, "__call__", call)
    batch, alone = prepared(model, plan), prepared(model, plan)
    calls.clear()
    got = model.forward_batch(batch)
    mx.eval(got)
    assert {"monolith_gdn_premix", "monolith_attention_prologue", "monolith_gated_rms_norm"} <= set(calls)
    pairs = []
    for (g_logits, g_hidden), s in zip(got, alone):
        w_logits, w_hidden = model.forward(s.tokens, s.cache, s.taps, s.logits)
        pairs.append((np.array(g_logits), np.array(w_logits)))
        if g_hidden is not None:
            pairs.append((np.array(g_hidden), np.array(w_hidden)))
    for s, w in zip(batch, alone):
        pairs += zip(cache_arrays(s.cache), cache_arrays(w.cache))
    err = MEASURED["moe, emulated Metal kernels: batched vs alone, max rel"] = max_rel(pairs)
    assert err <= TOL


def test_bad_batches_change_nothing(targets):
    model = targets["moe"]
    a, b = prepared(model, PLAN[:2])
    with pytest.raises(ValueError, match="share a cache"):
        model.forward_batch([a, Segment(ids(model, 2, 60), a.cache)])
    with pytest.raises(ValueError, match="at least one"):
        model.forward_batch([])
    before = [(s.cache.offset, cache_arrays(s.cache)) for s in (a, b)]
    too_long = Segment(ids(model, MAX_CONTEXT, 61), b.cache)  # 17 + 48 rows > 48 + 8 spare
    bad_taps = Segment(ids(model, 1, 62), b.cache, taps=(9,))
    bad_mode = Segment(ids(model, 1, 62), b.cache, logits="first")
    with pytest.raises(CacheError, match="max_context"):
        model.forward_batch([a, too_long])
    with pytest.raises(ValueError, match="taps"):
        model.forward_batch([a, bad_taps])
    with pytest.raises(ValueError, match="logits"):
        model.forward_batch([a, bad_mode])
    for s, (offset, arrays) in zip((a, b), before):
        assert s.cache.offset == offset
        for x, y in zip(cache_arrays(s.cache), arrays):
            np.testing.assert_array_equal(x, y)
    model.forward_batch([a, b])  # and the caches still work
    assert a.cache.offset == 5 + 1 and b.cache.offset == 17 + 8


# ------------------------------------------------------------------ the draft


@pytest.mark.parametrize("name", ["speculators-nvfp4", "dflash-causal", "deepspec-rnn"])
def test_draft_batched_equals_one_at_a_time(world, name):  # noqa: F811 - the fixture
    """Contexts of 5, 20 and 40 rows (the speculators draft's window is 16): one packed
    forward gives each what its own forward gives; propose with that hidden state gives
    what propose gives."""
    draft, _ = world["draft"](name)
    tokens = world["tokens"]
    feats = world["features"](draft.taps)
    items = [(context_of(draft, feats[:n]), tokens[n]) for n in (5, 20, 40)]
    got = draft.forward_batch(items)
    want = [draft.forward(ctx, anchor) for ctx, anchor in items]
    assert [g.shape for g in got] == [(draft.block_size, draft.args.hidden_size)] * 3
    err = MEASURED[f"draft {name}: batched vs alone, max rel hidden"] = max_rel(
        (np32(g), np32(w)) for g, w in zip(got, want))
    assert err <= TOL
    gamma = draft.max_proposals
    for (ctx, anchor), h in zip(items, want):
        p, q = draft.propose(ctx, anchor, gamma, GREEDY, hidden=h), draft.propose(ctx, anchor, gamma, GREEDY)
        np.testing.assert_array_equal(np.array(p.tokens), np.array(q.tokens))
        np.testing.assert_array_equal(np.array(p.q), np.array(q.q))
        assert (p.confidence is None) == (q.confidence is None)
        if p.confidence is not None:
            np.testing.assert_array_equal(np.array(p.confidence), np.array(q.confidence))
        g, w = (draft.propose_guided(ctx, anchor, gamma, GREEDY, None, Unconstrained(), gamma, hidden=hidden)
                for hidden in (h, None))
        np.testing.assert_array_equal(np.array(g.tokens), np.array(w.tokens))
        np.testing.assert_array_equal(np.array(g.q), np.array(w.q))
    chained = draft.propose_batch([(anchor, g, h) for (_, anchor), h, g in zip(items, want, (gamma, 2, gamma - 1))],
                                  GREEDY)
    for (ctx, anchor), h, g, p in zip(items, want, (gamma, 2, gamma - 1), chained):  # one chain: as each alone
        q = draft.propose(ctx, anchor, g, GREEDY, hidden=h)
        assert p.tokens.shape == (g,)
        np.testing.assert_array_equal(np.array(p.tokens), np.array(q.tokens))
        err = MEASURED[f"draft {name}: chained vs alone, max rel q"] = max_rel([(np32(p.q), np32(q.q))])
        assert err <= TOL
        if p.confidence is not None:
            assert max_rel([(np32(p.confidence), np32(q.confidence))]) <= TOL
    with pytest.raises(ValueError, match="own key"):
        draft.propose_batch([(anchor, gamma, h) for (_, anchor), h in zip(items, want)], SamplingParams(temperature=1.0),
                            mx.random.key(0))
    with pytest.raises(ValueError, match="share a context"):
        draft.forward_batch([items[0], items[0]])


class Unconstrained:
    """A grammar guide (runtime/grammar.py) that allows every token."""

    ended = False

    def words(self):
        return None

    def forced(self):
        return None

    def push(self, token):
        pass


@pytest.mark.parametrize("name", ["speculators-nvfp4", "deepspec-rnn"])
def test_draft_context_append_batched_equals_one_at_a_time(world, name):  # noqa: F811 - the fixture
    """Four contexts at 3, 12, 28 and 2 rows take 1, 3, 2 and 20 more rows in one packed
    append (the short ones stacked, padded to the longest of them; the long one alone):
    each context's K/V rows are what its own append gives, and nothing past them is
    written; a batch with a row that does not fit changes no context."""
    draft, _ = world["draft"](name)
    feats = world["features"](draft.taps)
    starts, counts = (3, 12, 28, 2), (1, 3, 2, 20)
    assert max(counts[:3]) <= draft.block_size < counts[3]
    alone, packed = ([context_of(draft, feats[:n]) for n in starts] for _ in range(2))
    more = [feats[n:n + k] for n, k in zip(starts, counts)]
    for ctx, f in zip(alone, more):
        draft.append_context(ctx, f)
    scratch = [[np32(layer.keys[:, :, c.offset + k:]) for layer in c.layers] for c, k in zip(packed, counts)]
    draft.append_batch(list(zip(packed, more)))
    assert [c.offset for c in packed] == [c.offset for c in alone] == [4, 15, 30, 22]
    for c, before in zip(packed, scratch):
        for layer, rest in zip(c.layers, before):
            np.testing.assert_array_equal(np32(layer.keys[:, :, c.offset:]), rest)
    pairs = [(np32(p.keys[:, :, :c.offset]), np32(a.keys[:, :, :c.offset]))
             for pc, c in zip(packed, alone) for p, a in zip(pc.layers, c.layers)]
    pairs += [(np32(p.values[:, :, :c.offset]), np32(a.values[:, :, :c.offset]))
              for pc, c in zip(packed, alone) for p, a in zip(pc.layers, c.layers)]
    err = MEASURED[f"draft {name}: packed vs alone context append, max rel"] = max_rel(pairs)
    assert err <= TOL
    full = context_of(draft, feats[:5])
    full.max_context = 6
    with pytest.raises(CacheError):
        draft.append_batch([(packed[0], feats[:1]), (full, feats[:2])])
    assert packed[0].offset == 4 and full.offset == 5


@requires_emulator
def test_the_prologue_and_premix_take_a_batch_of_sequences(targets, monkeypatch):
    """The attention prologue and the GDN pre-mixer over a batch of three sequences (each
    at its own offset, with its own conv state) give each what it gets alone, by the MLX
    reference and by the (emulated) Metal kernels, which run the batch one by one."""
    from monolith.kernels import attention, premix

    model = targets["moe"]
    layers = [layer.mixer for layer in model.layers]
    att = next(m for m in layers if hasattr(m, "q_norm"))
    gdn = next(m for m in layers if hasattr(m, "conv_weight"))
    rng = np.random.default_rng(3)
    qkv = mx.array(rng.standard_normal((3, 2, att.qkv.out_features)).astype(np.float32))
    offsets = [4, 0, 19]
    proj = mx.array(rng.standard_normal((3, 2, gdn.in_proj.out_features)).astype(np.float32))
    conv = mx.array(rng.standard_normal((3, gdn.kernel - 1, gdn.conv_dim)).astype(np.float32))

    def prologue(fn, x, offset):
        return fn(x, att.q_norm, att.k_norm, offset, att.heads, att.kv_heads, att.head_dim, att.rotary_dim,
                  att.rope_theta, att.eps)

    def mix(fn, x, state):
        return fn(x, state, gdn.conv_weight, gdn.neg_decay, gdn.dt_bias, gdn.hk, gdn.dk, gdn.hv, gdn.dv)

    def call(self, launch):
        return run_kernel(self, launch)

    monkeypatch.setattr(kernel_module.MetalKernel, "__call__", call)
    for fn_att, fn_mix in ((attention.reference, premix.reference), (attention.metal, premix.metal)):
        got = prologue(fn_att, qkv, mx.array(offsets, mx.int32))
        want = [prologue(attention.reference, qkv[i:i + 1], o) for i, o in enumerate(offsets)]
        for g, w in zip(got, zip(*want)):
            assert rel(np.array(g), np.array(mx.concatenate(w))) <= TOL
        got = mix(fn_mix, proj, conv)
        want = [mix(premix.reference, proj[i:i + 1], conv[i:i + 1]) for i in range(3)]
        for g, w in zip(got, zip(*want)):
            assert rel(np.array(g), np.array(mx.concatenate(w))) <= TOL
    with pytest.raises(ValueError, match="one sequence"):
        premix.launch(proj, conv, gdn.conv_weight, gdn.neg_decay, gdn.dt_bias, gdn.hk, gdn.dk, gdn.hv, gdn.dv)
