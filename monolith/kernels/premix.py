"""GDN pre-mixer (docs/target.md, gated DeltaNet steps 2-5): conv window and state
update, causal depthwise conv + SiLU, q/k/v split, q/k l2-norm (q scaled by Dk^-0.5),
gates beta and gamma, for T rows (decode, verify, prefill chunks) of B sequences (a
batch: each with its own conv state; the Metal kernel runs them one by one). The outputs are what
mx.fast.gated_delta_update consumes plus the window the tape records (models/cache.py
GDNTape).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx

from .kernel import Launch, MetalKernel, threads_for, use_metal

L2_EPS = 1e-6
PER_THREAD = 8  # channels a thread keeps in registers (the .metal body's bound)
KERNEL = MetalKernel("monolith_gdn_premix", "gdn_premix.metal",
                     ("proj", "conv_state", "conv_weight", "neg_decay", "dt_bias"),
                     ("q", "k", "v", "gamma", "beta", "window"))


class Premix(NamedTuple):
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; gamma, beta [B, T, Hv]; window
    [B, K-1+T, C]: the previous conv state then the new pre-conv rows (all F32). The new
    conv state is window[:, T:]."""

    q: mx.array
    k: mx.array
    v: mx.array
    gamma: mx.array
    beta: mx.array
    window: mx.array


@mx.compile
def _silu(x):
    return x * mx.sigmoid(x)


@mx.compile
def _gates(a, b, neg_decay, dt_bias):
    a = a.astype(mx.float32) + dt_bias
    return mx.sigmoid(b.astype(mx.float32)), mx.exp(neg_decay * mx.logaddexp(a, 0.0))


@functools.cache
def _l2_weights(dk: int) -> tuple[mx.array, mx.array]:
    """l2norm(x) * s == rms_norm(x, eps / D) * s / sqrt(D): weights for q (s = Dk^-0.5) and k."""
    q, k = mx.full((dk,), 1.0 / dk, mx.float32), mx.full((dk,), dk ** -0.5, mx.float32)
    mx.eval(q, k)
    return q, k


def _dims(proj, conv_state, key_heads, key_dim, value_heads, value_dim):
    c = 2 * key_heads * key_dim + value_heads * value_dim
    width = c + value_heads * value_dim + 2 * value_heads
    if proj.ndim != 3 or proj.shape[2] != width:
        raise ValueError(f"gdn_premix: proj must be [B, T, {width}] (conv | z | b | a), got {proj.shape}")
    if conv_state.ndim != 3 or conv_state.shape[0] != proj.shape[0] or conv_state.shape[2] != c:
        raise ValueError(f"gdn_premix: conv_state must be [{proj.shape[0]}, K-1, {c}], got {conv_state.shape}")
    return c, conv_state.shape[1] + 1


def reference(proj, conv_state, conv_weight, neg_decay, dt_bias, key_heads, key_dim, value_heads,
              value_dim) -> Premix:
    c, kernel = _dims(proj, conv_state, key_heads, key_dim, value_heads, value_dim)
    b, t = proj.shape[:2]
    v_end = c + value_heads * value_dim
    window = mx.concatenate([conv_state, proj[..., :c].astype(mx.float32)], axis=1)
    weight = conv_weight if conv_weight.shape == (c, kernel, 1) else conv_weight.reshape(c, kernel, 1)
    conv = _silu(mx.conv1d(window, weight, groups=c))
    kd = key_heads * key_dim
    q = conv[..., :kd].reshape(b, t, key_heads, key_dim)
    k = conv[..., kd:2 * kd].reshape(b, t, key_heads, key_dim)
    v = conv[..., 2 * kd:].reshape(b, t, value_heads, value_dim)
    q_scale, k_scale = _l2_weights(key_dim)
    q = mx.fast.rms_norm(q, q_scale, L2_EPS / key_dim)
    k = mx.fast.rms_norm(k, k_scale, L2_EPS / key_dim)
    beta_in, a = proj[..., v_end:v_end + value_heads], proj[..., v_end + value_heads:]
    beta, gamma = _gates(a, beta_in, neg_decay, dt_bias)
    return Premix(q, k, v, gamma, beta, window)


def launch(proj, conv_state, conv_weight, neg_decay, dt_bias, key_heads, key_dim, value_heads,
           value_dim) -> Launch:
    c, kernel = _dims(proj, conv_state, key_heads, key_dim, value_heads, value_dim)
    if proj.shape[0] != 1:
        raise ValueError(f"gdn_premix: the kernel takes one sequence, got a batch of {proj.shape[0]}")
    t = proj.shape[1]
    threads = threads_for(max(key_dim, value_dim))
    if -(-max(key_dim, value_dim) // threads) > PER_THREAD:
        raise ValueError(f"gdn_premix: head dims up to {PER_THREAD * threads} are supported")
    f32 = mx.float32
    return Launch(
        inputs=(proj, conv_state, conv_weight, neg_decay, dt_bias),
        grid=(threads, 2 * key_heads + value_heads, t), threadgroup=(threads, 1, 1),
        output_shapes=((1, t, key_heads, key_dim), (1, t, key_heads, key_dim), (1, t, value_heads, value_dim),
                       (1, t, value_heads), (1, t, value_heads), (1, kernel - 1 + t, c)),
        output_dtypes=(f32,) * 6,
        template=(("HK", key_heads), ("DK", key_dim), ("HV", value_heads), ("DV", value_dim), ("K", kernel)))


def metal(proj, conv_state, *rest) -> Premix:
    """The kernel, one sequence of the batch at a time."""
    if proj.shape[0] == 1:
        return Premix(*KERNEL(launch(proj, conv_state, *rest)))
    parts = [KERNEL(launch(proj[i:i + 1], conv_state[i:i + 1], *rest)) for i in range(proj.shape[0])]
    return Premix(*(mx.concatenate(arrays) for arrays in zip(*parts)))


def gdn_premix(proj: mx.array, conv_state: mx.array, conv_weight: mx.array, neg_decay: mx.array,
               dt_bias: mx.array, key_heads: int, key_dim: int, value_heads: int, value_dim: int) -> Premix:
    """proj [B, T, W]: the fused in_proj output (conv channels | z | b | a, compute dtype)
    of B sequences; conv_state [B, K-1, C] F32; conv_weight [C, K] (any shape with that layout, e.g. the
    model's [C, K, 1]) F32; neg_decay = -exp(A_log) [Hv] F32; dt_bias [Hv] F32."""
    args = (proj, conv_state, conv_weight, neg_decay, dt_bias, key_heads, key_dim, value_heads, value_dim)
    return metal(*args) if use_metal() else reference(*args)
