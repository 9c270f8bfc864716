"""Inputs for every monolith kernel, shared by the emulator tests (test_kernels.py) and
the Mac-only tests against real Metal (test_metal_real.py): random inputs, edge shapes
(one row, eight rows, odd head counts, head dims that are not a multiple of 32) and the
largest shapes of the 35B target (docs/target.md: hidden 2048; 16 q / 2 kv heads of 256,
rotary 64; GDN 16 key / 32 value heads of 128, conv_dim 8192; 256 experts top-8;
248320 vocabulary rows for the gather)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from monolith.kernels import KERNELS, replay

# 35B-A3B shapes
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, ROTARY = 2048, 16, 2, 256, 64
GDN = {"key_heads": 16, "key_dim": 128, "value_heads": 32, "value_dim": 128}
EXPERTS, TOP_K, VOCAB, CONV_K = 256, 8, 248320, 4


def f32(x) -> np.ndarray:
    return np.array(x.astype(mx.float32)) if x.dtype not in (mx.float32, mx.int32, mx.uint32) else np.array(x)


def default_tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol as a fraction of max |expected|): about one rounding in that dtype, of each
    element and of the largest one (inputs rounded one ulp apart can cancel)."""
    return {mx.bfloat16: (2 ** -7, 2 ** -7), mx.float16: (2 ** -10, 2 ** -10)}.get(dtype, (2e-5, 2e-6))


def assert_matches(actual, expected, tolerance=None, what=""):
    """Same shape and dtype; ids exactly; floats within `tolerance` (default_tolerance)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if expected.dtype in (mx.int32, mx.uint32):
        np.testing.assert_array_equal(np.array(actual), np.array(expected), err_msg=what)
        return
    a, e = f32(actual), f32(expected)
    assert np.isfinite(a).all(), f"{what}: non-finite output (an unwritten or poisoned element)"
    rtol, atol = tolerance or default_tolerance(expected.dtype)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * max(np.abs(e).max(), 1e-30), err_msg=what)


def as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def public_order(module, outputs) -> list:
    """A kernel's raw outputs in the order its public function returns them."""
    if module is replay:
        state, conv = outputs
        return [conv, state]
    return list(outputs)


def check_case(case, outputs, reference_outputs):
    for i, (a, e) in enumerate(zip(outputs, reference_outputs)):
        assert_matches(a, e.reshape(a.shape) if e.size == a.size else e, case.tolerance.get(i),
                       f"{case.id} output {i}")
    assert len(outputs) == len(reference_outputs)


@dataclass
class Case:
    kernel: str
    name: str
    make: Callable[[np.random.Generator], tuple]
    tolerance: dict = field(default_factory=dict)  # per output index: (rtol, atol relative to max |expected|)

    @property
    def module(self):
        return KERNELS[self.kernel]

    @property
    def id(self) -> str:
        return f"{self.kernel}-{self.name}"


def normal(rng, *shape, dtype=mx.float32, scale=1.0) -> mx.array:
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def uniform(rng, lo, hi, *shape) -> mx.array:
    return mx.array(rng.uniform(lo, hi, shape).astype(np.float32))


# ------------------------------------------------------------------ builders


def nvfp4_table(rng, vocab, hidden, tokens, scale_dtype=mx.float32, sparse=False):
    """An NVFP4 table; with sparse=True only the gathered rows hold data (the real vocabulary
    would take seconds to fill and the kernel only reads those rows)."""
    words = np.zeros((vocab, hidden // 8), np.uint32)
    scales = np.zeros((vocab, hidden // 16), np.uint8)
    tensor_scale = np.zeros(vocab, np.float32)
    rows = np.unique(tokens) if sparse else np.arange(vocab)
    words[rows] = rng.integers(0, 2 ** 32, (len(rows), hidden // 8), dtype=np.uint32)
    codes = rng.integers(0, 0x7F, (len(rows), hidden // 16))  # every E4M3 code but NaN, incl. subnormals
    scales[rows] = codes | (rng.integers(0, 2, codes.shape) << 7) * (rng.random(codes.shape) < 0.05)
    tensor_scale[rows] = rng.uniform(1e-3, 2.0, len(rows))
    return (mx.array(np.asarray(tokens, np.int32)), mx.array(words), mx.array(scales),
            mx.array(tensor_scale).astype(scale_dtype))


def embedding_case(vocab, hidden, tokens, dtype, scale_dtype=mx.float32, sparse=False):
    def make(rng):
        toks = tokens if not isinstance(tokens, int) else rng.integers(0, vocab, tokens)
        return (*nvfp4_table(rng, vocab, hidden, toks, scale_dtype, sparse), dtype)
    return make


def premix_case(t, hk, dk, hv, dv, k=CONV_K, dtype=mx.bfloat16):
    def make(rng):
        c = 2 * hk * dk + hv * dv
        width = c + hv * dv + 2 * hv
        proj = normal(rng, 1, t, width, dtype=dtype)
        conv_state = normal(rng, 1, k - 1, c)
        conv_weight = normal(rng, c, 1, k, scale=0.5).swapaxes(1, 2)  # the model's [C, K, 1] view
        neg_decay = -mx.exp(normal(rng, hv, scale=0.5))
        dt_bias = normal(rng, hv)
        return proj, conv_state, conv_weight, neg_decay, dt_bias, hk, dk, hv, dv
    return make


def gated_norm_case(shape, z_width=None, z_offset=0, dtype=mx.bfloat16, o_dtype=mx.float32):
    def make(rng):
        *lead, h, d = shape
        width = z_width or h * d
        o = normal(rng, *shape, dtype=o_dtype)
        z = normal(rng, *lead, width, dtype=dtype)
        weight = uniform(rng, 0.5, 1.5, d)
        return o, z, weight, 1e-6, z_offset
    return make


def router_case(t, e, k, ties=False, dtype=mx.float32, overrides=()):
    """overrides: (row, experts, value) written over the random logits (NaN, +-inf)."""
    def make(rng):
        if ties:  # few distinct values: many exact ties, including across SIMD groups
            logits = rng.choice([-1.0, 0.0, 0.5, 2.0], size=(t, e)).astype(np.float32)
            logits[0] = 0.0
        else:
            logits = (rng.standard_normal((t, e)) * 2.0).astype(np.float32)
        for row, experts, value in overrides:
            logits[row, experts] = value
        return mx.array(logits).astype(dtype), k
    return make


NAN, INF = float("nan"), float("inf")
# Rows of router logits that are not all finite (the ids must stay in [0, E) and distinct):
# whole rows of NaN / -inf / +inf, NaN among finite logits, fewer finite logits than k
# (the rest -inf, or NaN and -inf), two and one +inf among the others.
NON_FINITE = ((0, slice(None), NAN), (1, slice(None), -INF), (2, slice(None), INF),
              (3, [5, 17, 33], NAN),
              (4, slice(3, None), -INF),
              (5, slice(None, -2), NAN), (5, -1, -INF),
              (6, [9, 33], INF), (6, 1, NAN),
              (7, 3, INF), (7, 4, NAN), (7, 5, -INF))


def attention_case(t, heads, kv_heads, head_dim, rotary, offset, dtype=mx.bfloat16, theta=1e7):
    def make(rng):
        qkv = normal(rng, 1, t, (2 * heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=2.0)
        q_norm = uniform(rng, 0.5, 1.5, head_dim)  # the stored (1 + w)
        k_norm = uniform(rng, 0.5, 1.5, head_dim)
        return qkv, q_norm, k_norm, offset, heads, kv_heads, head_dim, rotary, theta, 1e-6
    return make


def combine_case(t, k, hidden, dtype=mx.bfloat16, lead=None):
    def make(rng):
        expert_out = normal(rng, t, k, hidden, dtype=dtype)
        weights = mx.softmax(normal(rng, t, k), axis=-1)
        shared_out = normal(rng, t, hidden, dtype=dtype)
        shared_gate = normal(rng, t, 1, dtype=dtype)
        residual = normal(rng, *(lead or (1, t)), hidden, dtype=dtype, scale=4.0)
        return expert_out, weights, shared_out, shared_gate, residual, uniform(rng, 0.5, 1.5, hidden), 1e-6
    return make


def add_norm_case(shape, dtype=mx.bfloat16):
    def make(rng):
        return (normal(rng, *shape, dtype=dtype, scale=4.0), normal(rng, *shape, dtype=dtype),
                uniform(rng, 0.5, 1.5, shape[-1]), 1e-6)
    return make


def replay_tape(rng, t, hk, dk, hv, dv, k=CONV_K):
    c = 2 * hk * dk + hv * dv
    window = normal(rng, 1, k - 1 + t, c)
    keys = normal(rng, 1, t, hk, dk)
    keys = keys * mx.rsqrt((keys * keys).sum(-1, keepdims=True))  # l2-normalized, as the model's
    values = normal(rng, 1, t, hv, dv)
    gamma = uniform(rng, 0.5, 1.0, 1, t, hv)
    beta = uniform(rng, 0.0, 1.0, 1, t, hv)
    state = normal(rng, 1, hv, dv, dk, scale=0.5)
    return window, keys, values, gamma, beta, state


def replay_case(t, rows, hk, dk, hv, dv):
    def make(rng):
        return (*replay_tape(rng, t, hk, dk, hv, dv), rows)
    return make


REAL_GDN = (GDN["key_heads"], GDN["key_dim"], GDN["value_heads"], GDN["value_dim"])
REAL_Z_WIDTH = 2 * 16 * 128 + 32 * 128 + 32 * 128 + 2 * 32  # the fused in_proj row: conv | z | b | a
REAL_Z_OFFSET = 2 * 16 * 128 + 32 * 128

CASES = [
    Case("embedding", "bf16", embedding_case(64, 64, 7, mx.bfloat16)),
    Case("embedding", "f32-one-row", embedding_case(64, 128, [63], mx.float32)),
    Case("embedding", "f16-bf16-scale", embedding_case(40, 96, [0, 39, 5, 5], mx.float16, mx.bfloat16)),
    Case("embedding", "real-vocab", embedding_case(VOCAB, HIDDEN, [0, VOCAB - 1, 123457, 200003, 7, 0, 248000, 9],
                                                   mx.bfloat16, sparse=True)),
    Case("premix", "one-row", premix_case(1, 2, 32, 4, 32)),
    Case("premix", "eight-rows", premix_case(8, 2, 32, 4, 32)),
    Case("premix", "odd-heads-dk48-dv16", premix_case(5, 1, 48, 3, 16)),
    Case("premix", "prefill-chunk-f32", premix_case(64, 2, 16, 2, 32, dtype=mx.float32)),
    Case("premix", "conv-k3", premix_case(3, 1, 32, 2, 32, k=3)),
    Case("premix", "real-one-row", premix_case(1, *REAL_GDN)),
    Case("premix", "real-eight-rows", premix_case(8, *REAL_GDN)),
    Case("gated_norm", "contiguous-z", gated_norm_case((1, 3, 4, 32))),
    Case("gated_norm", "odd-heads-d48-offset", gated_norm_case((1, 5, 3, 48), z_width=200, z_offset=40)),
    Case("gated_norm", "d320-f32", gated_norm_case((1, 2, 2, 320), dtype=mx.float32)),
    Case("gated_norm", "real-one-row", gated_norm_case((1, 1, 32, 128), REAL_Z_WIDTH, REAL_Z_OFFSET)),
    Case("gated_norm", "real-eight-rows", gated_norm_case((1, 8, 32, 128), REAL_Z_WIDTH, REAL_Z_OFFSET)),
    Case("router", "e64-k8", router_case(5, 64, 8)),
    Case("router", "one-row-k1", router_case(1, 40, 1)),
    Case("router", "e300-k4", router_case(3, 300, 4)),
    Case("router", "ties", router_case(8, 64, 8, ties=True)),
    Case("router", "bf16-logits", router_case(4, 96, 6, dtype=mx.bfloat16)),
    Case("router", "real-one-row", router_case(1, EXPERTS, TOP_K)),
    Case("router", "real-eight-rows", router_case(8, EXPERTS, TOP_K)),
    Case("router", "non-finite-e40", router_case(8, 40, TOP_K, overrides=NON_FINITE)),
    Case("router", "non-finite-e300-bf16", router_case(8, 300, 4, dtype=mx.bfloat16, overrides=NON_FINITE)),
    Case("router", "real-non-finite", router_case(8, EXPERTS, TOP_K, overrides=NON_FINITE)),
    Case("attention", "bf16", attention_case(5, 3, 1, 32, 8, 7)),
    Case("attention", "one-row-f32", attention_case(1, 2, 2, 64, 64, 130, dtype=mx.float32, theta=1e4)),
    Case("attention", "odd-heads-d48", attention_case(3, 5, 1, 48, 16, 0, dtype=mx.float16)),
    Case("attention", "real-one-row", attention_case(1, HEADS, KV_HEADS, HEAD_DIM, ROTARY, 4095)),
    Case("attention", "real-eight-rows", attention_case(8, HEADS, KV_HEADS, HEAD_DIM, ROTARY, 1000)),
    # far positions: theta = pos * 2^-x in F32 is itself off by ~pos * 2^-24 in any implementation
    Case("attention", "real-far-positions", attention_case(8, HEADS, KV_HEADS, HEAD_DIM, ROTARY, 200000),
         tolerance={0: (2 ** -7, 2 ** -6), 1: (2 ** -7, 2 ** -6)}),
    Case("add_norm", "bf16", add_norm_case((1, 5, 96))),
    Case("add_norm", "f32-one-row-odd", add_norm_case((1, 1, 1000), dtype=mx.float32)),
    Case("add_norm", "real-one-row", add_norm_case((1, 1, HIDDEN))),
    Case("add_norm", "real-eight-rows", add_norm_case((1, 8, HIDDEN))),
    Case("combine", "bf16", combine_case(5, 4, 48)),
    Case("combine", "f32-one-row-k1", combine_case(1, 1, 100, dtype=mx.float32, lead=(1,))),
    Case("combine", "f16-wide-k3", combine_case(3, 3, 1500, dtype=mx.float16)),
    Case("combine", "real-one-row", combine_case(1, TOP_K, HIDDEN)),
    Case("combine", "real-eight-rows", combine_case(8, TOP_K, HIDDEN)),
    Case("replay", "odd-dk48-hv3", replay_case(5, 3, 1, 48, 3, 16)),
    Case("replay", "small-none-kept", replay_case(4, 0, 2, 32, 4, 32)),
    Case("replay", "real-one-of-eight", replay_case(8, 1, *REAL_GDN)),
    Case("replay", "real-all-eight", replay_case(8, 8, *REAL_GDN)),
]
