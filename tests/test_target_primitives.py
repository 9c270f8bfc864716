"""The target's primitives against independent definitions: the NVFP4 embedding gather
against formats' dequantization, mx.fast.gated_delta_update against the recurrence of
docs/target.md in float64, the CPU's attention against MLX's scaled_dot_product_attention,
and swiglu against silu(gate) * up."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from numeric import rel

from monolith import formats
from monolith.models.layers import Embedding, Linear


def test_nvfp4_embedding_gather_applies_row_tensor_scale():
    rng = np.random.default_rng(3)
    table = rng.standard_normal((40, 64)).astype(np.float32)
    q = formats.quantize_nvfp4(table)
    expected = formats.dequantize_nvfp4(q.packed, q.scales, q.tensor_scale)
    words = mx.array(formats.mlx_layout.nvfp4_to_words(np.asarray(q.packed)))
    scale = mx.full((40,), float(q.tensor_scale), mx.float32)
    embed = Embedding(Linear(words, "nvfp4", scales=mx.array(np.asarray(q.scales)), tensor_scale=scale,
                             shape=(40, 64)), mx.float32)
    ids = mx.array([5, 0, 39, 5], dtype=mx.int32)
    np.testing.assert_allclose(np.array(embed(ids)), expected[[5, 0, 39, 5]], rtol=1e-6, atol=1e-7)


def gdn_loop(q, k, v, gamma, beta, state):
    """docs/target.md, gated DeltaNet steps 6-7, in float64; state [Hv, Dk, Dv] (Hugging
    Face's layout)."""
    t_len, hk, _ = q.shape
    hv = v.shape[1]
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape)
    for t in range(t_len):
        for h in range(hv):
            kh = h // (hv // hk)
            s[h] = gamma[t, h] * s[h]
            d = beta[t, h] * (v[t, h] - s[h].T @ k[t, kh])
            s[h] = s[h] + np.outer(k[t, kh], d)
            out[t, h] = s[h].T @ q[t, kh]
    return out, s


@pytest.mark.parametrize("t, hk, hv, dk, dv, decay", [
    (5, 2, 2, 16, 16, (0.3, 1.0)),
    (9, 2, 4, 16, 8, (0.3, 1.0)),
    (70, 1, 4, 32, 16, (0.3, 1.0)),
    (1, 2, 8, 8, 32, (0.3, 1.0)),
    (40, 2, 4, 16, 16, (1e-6, 1e-2)),  # strong decay: no exp(-cumsum) blow-up
])
def test_gated_delta_update_is_the_target_recurrence(t, hk, hv, dk, dv, decay):
    rng = np.random.default_rng(t + hv)
    q = rng.standard_normal((t, hk, dk)).astype(np.float32)  # not normalized: the op must not care
    k = rng.standard_normal((t, hk, dk)).astype(np.float32) / np.sqrt(dk)
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    gamma = rng.uniform(*decay, (t, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (t, hv)).astype(np.float32)
    state = (0.1 * rng.standard_normal((hv, dk, dv))).astype(np.float32)
    want, want_state = gdn_loop(q, k, v, gamma, beta, state)
    y, final = mx.fast.gated_delta_update(
        *(mx.array(a[None]) for a in (q, k, v, gamma, beta)),
        initial_state=mx.array(state.transpose(0, 2, 1)[None]),  # MLX holds [Hv, Dv, Dk]
    )
    assert y.shape == (1, t, hv, dv) and final.shape == (1, hv, dv, dk) and final.dtype == mx.float32
    assert rel(np.array(y)[0], want) < 1e-5
    assert rel(np.array(final)[0].transpose(0, 2, 1), want_state) < 1e-5


@pytest.mark.parametrize("heads,kv_heads,t,length,mask", [
    (4, 2, 8, 300, "causal"), (4, 2, 1, 57, None), (4, 4, 8, 8, None), (8, 2, 8, 40, "causal"), (2, 1, 5, 5, "causal"),
])
def test_attention_matches_mlx_fast_sdpa(heads, kv_heads, t, length, mask):
    """The CPU's attention (matmuls and a softmax through pow) against MLX's own
    scaled_dot_product_attention: grouped heads, the causal mask aligned to the last keys,
    and keys that are a prefix of a larger cache buffer."""
    from monolith.models.layers import attention, fast_exp

    k1, k2 = mx.random.split(mx.random.key(heads * 100 + t))
    q = mx.random.normal((1, heads, t, 64), key=k1) * 2
    buffer = mx.random.normal((2, 1, kv_heads, length + 16, 64), key=k2) * 2
    keys, values = buffer[0, :, :, :length], buffer[1, :, :, :length]
    ours = attention(q, keys, values, 0.125, mask)
    reference = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)
    assert ours.shape == reference.shape
    assert rel(np.array(ours), np.array(reference)) < 1e-6
    if fast_exp():
        with pytest.raises(ValueError, match="mask"):
            attention(q, keys, values, 0.125, "sliding")


def test_swiglu_matches_silu_times_up():
    """swiglu (on the CPU through pow) against silu(gate) * up in float64."""
    from monolith.models.layers import swiglu

    x = mx.random.normal((32, 2 * 96), key=mx.random.key(3)) * 6
    gate, up = np.array(x[:, :96], dtype=np.float64), np.array(x[:, 96:], dtype=np.float64)
    expected = gate / (1 + np.exp(-gate)) * up
    assert np.abs(np.array(swiglu(x)) - expected).max() < 1e-5 * np.abs(expected).max()
