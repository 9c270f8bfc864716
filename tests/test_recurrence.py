"""monolith.kernels.recurrence: the chunked gated delta rule against
mx.fast.gated_delta_update (the independent reference): outputs, final states, dtypes and
gradients."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from monolith.kernels import gated_delta, gated_delta_rows
from monolith.kernels.recurrence import chunked

DK, DV = 16, 12


def inputs(b, t, hk, hv, seed=0, specials=True):
    """l2-normed q (scaled) and k as the model feeds them; gamma with exact 1s, 1e-30s and 0s."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, b, t, hk, DK)).astype(np.float32)
    q *= DK ** -0.5 / np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, hv, DV)).astype(np.float32)
    gamma = rng.uniform(0.3 if specials else 0.5, 1.0, (b, t, hv)).astype(np.float32)
    if specials:
        pick = rng.integers(0, 30, gamma.shape)
        gamma[pick < 3], gamma[pick == 3], gamma[pick == 4] = 1.0, 1e-30, 0.0
    beta = rng.uniform(0.0, 1.0, (b, t, hv)).astype(np.float32)
    state = rng.standard_normal((b, hv, DV, DK)).astype(np.float32)
    return [mx.array(x) for x in (q, k, v, gamma, beta, state)]


def fast(q, k, v, gamma, beta, state=None):
    return mx.fast.gated_delta_update(q, k, v, gamma, beta, initial_state=state)


def assert_close(got, want, rtol=1e-5):
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("t", [1, 2, 7, 8, 9, 63, 64, 65, 200])
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("b", [1, 2])
def test_matches_fast_op(t, ratio, b):
    args = inputs(b, t, 2 if ratio < 4 else 1, 2 * ratio if ratio < 4 else 4, seed=t * 10 + ratio)
    o, s = chunked(*args)
    o_ref, s_ref = fast(*args)
    assert o.shape == o_ref.shape and o.dtype == mx.float32 and s.dtype == mx.float32
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunk_size_is_invisible(chunk):
    args = inputs(2, 37, 2, 4, seed=chunk)
    o_ref, s_ref = fast(*args)
    o, s = chunked(*args, chunk=chunk)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("t, chunk", [(1, 64), (8, 64), (9, 4), (20, 8)])
def test_the_state_after_every_row_is_the_fast_ops_over_those_rows(t, chunk):
    """gated_delta_rows (what a CPU commit slices): the state after row r is what the
    fast op leaves after the first r rows, for every r, across chunk boundaries; the
    output and final state are gated_delta's."""
    args = inputs(2, t, 2, 4, seed=t)
    o, s, every = gated_delta_rows(*args, chunk=chunk)
    assert every.shape == (2, t, 4, DV, DK) and every.dtype == mx.float32
    o_ref, s_ref = chunked(*args, chunk=chunk)
    np.testing.assert_array_equal(np.array(o), np.array(o_ref))
    np.testing.assert_array_equal(np.array(s), np.array(s_ref))
    q, k, v, gamma, beta, state = args
    for r in range(1, t + 1):
        _, want = fast(q[:, :r], k[:, :r], v[:, :r], gamma[:, :r], beta[:, :r], state)
        assert_close(every[:, r - 1], want)


def test_zero_state_and_dtypes():
    q, k, v, gamma, beta, _ = inputs(1, 20, 2, 4)
    bf = [x.astype(mx.bfloat16) for x in (q, k, v, gamma, beta)]
    o, s = chunked(*bf)
    o_ref, s_ref = fast(*bf)
    assert o.dtype == o_ref.dtype == mx.bfloat16 and s.dtype == s_ref.dtype == mx.float32
    assert_close(o, o_ref, rtol=1e-2)
    assert_close(s, s_ref)


def test_gradients_match_fast_op():
    args = inputs(2, 20, 1, 2, seed=3, specials=False)
    rng = np.random.default_rng(4)
    wo, ws = (mx.array(rng.standard_normal(x.shape).astype(np.float32)) for x in fast(*args))

    def loss(fn):
        def f(*a):
            o, s = fn(*a)
            return (o * wo).sum() + (s * ws).sum()
        return mx.grad(f, argnums=tuple(range(6)))

    got = loss(lambda *a: chunked(*a, chunk=8))(*args)
    want = loss(fast)(*args)
    for g, w in zip(got, want):
        assert_close(g, w, rtol=2e-5)


@pytest.mark.skipif(mx.metal.is_available(), reason="on Metal gated_delta is the fast op")
def test_cpu_uses_the_chunked_form(monkeypatch):
    args = inputs(1, 9, 2, 4)
    want = fast(*args)

    def unexpected(*a, **kw):
        raise AssertionError("gated_delta called the unrolled fast op on the CPU")

    monkeypatch.setattr(mx.fast, "gated_delta_update", unexpected)
    for g, w in zip(gated_delta(*args), want):
        assert_close(g, w)
