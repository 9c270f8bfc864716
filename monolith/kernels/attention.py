"""Gated attention prologue (docs/target.md, gated attention mixer): split the fused q|gate
rows, zero-centred RMSNorm of q and k with the stored (1 + w) F32 weights, rotate-half
RoPE on the first rotary_dim dims at positions offset + t, and the layouts SDPA and the
KV cache take. Returns q [B, H, T, D], k, v [B, KVH, T, D] and sigmoid(gate) [B, T, H*D],
all in qkv's dtype: the mixer multiplies the attention output by that gate directly. B
sequences of a batch each start at their own offset (the Metal kernel runs them one by
one).
"""

from __future__ import annotations

import math

import mlx.core as mx

from .kernel import Launch, MetalKernel, threads_for, use_metal

KERNEL = MetalKernel("monolith_attention_prologue", "attention_prologue.metal",
                     ("qkv", "q_norm", "k_norm", "offset", "log2_base", "eps"), ("q", "k", "v", "gate"))


def _check(qkv, heads, kv_heads, head_dim, rotary_dim):
    width = (2 * heads + 2 * kv_heads) * head_dim
    if qkv.ndim != 3 or qkv.shape[2] != width:
        raise ValueError(f"attention_prologue: qkv must be [B, T, {width}], got {qkv.shape}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim or head_dim < 8:
        raise ValueError(f"attention_prologue: need an even rotary_dim <= head_dim (>= 8), got {rotary_dim}, "
                         f"{head_dim}")


def _split_norm(qkv, q_norm, k_norm, heads, kv_heads, head_dim, eps):
    """(q [B, H, T, D], k [B, KVH, T, D] normed, not rotated; v [B, T, KVH, D]; gate [B, T, H*D])."""
    b, t, _ = qkv.shape
    n, d, kv = heads, head_dim, kv_heads
    q_gate = qkv[..., :2 * n * d].reshape(b, t, n, 2 * d)
    q, gate = q_gate[..., :d], q_gate[..., d:].reshape(b, t, n * d)
    k = qkv[..., 2 * n * d:(2 * n + kv) * d].reshape(b, t, kv, d)
    v = qkv[..., (2 * n + kv) * d:].reshape(b, t, kv, d)
    q = mx.fast.rms_norm(q, q_norm, eps).astype(qkv.dtype).transpose(0, 2, 1, 3)
    k = mx.fast.rms_norm(k, k_norm, eps).astype(qkv.dtype).transpose(0, 2, 1, 3)
    return q, k, v, gate


def reference(qkv, q_norm, k_norm, offset, heads, kv_heads, head_dim, rotary_dim, rope_theta, eps):
    _check(qkv, heads, kv_heads, head_dim, rotary_dim)
    q, k, v, gate = _split_norm(qkv, q_norm, k_norm, heads, kv_heads, head_dim, eps)
    q = mx.fast.rope(q, rotary_dim, traditional=False, base=rope_theta, scale=1.0, offset=offset)
    k = mx.fast.rope(k, rotary_dim, traditional=False, base=rope_theta, scale=1.0, offset=offset)
    return q, k, v.transpose(0, 2, 1, 3), mx.sigmoid(gate)


def rotate(x: mx.array, angles: mx.array) -> mx.array:
    """Rotate-half RoPE of x [B, heads, T, D] by per-row angles [T, R / 2] on its first R
    dims, in float32, back in x's dtype."""
    return turn(x, mx.cos(angles), mx.sin(angles))


def turn(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """`rotate` by the cos and sin [T, R / 2] of the angles (computed once where several
    tensors turn by the same angles)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half].astype(mx.float32), x[..., half:2 * half].astype(mx.float32)
    turned = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return turned if 2 * half == x.shape[-1] else mx.concatenate([turned, x[..., 2 * half:]], axis=-1)


def attention_prologue_at(qkv: mx.array, q_norm: mx.array, k_norm: mx.array, angles: mx.array, heads: int,
                          kv_heads: int, head_dim: int, eps: float):
    """`attention_prologue` for one sequence (B = 1) whose rows turn by given rotary angles
    [T, rotary_dim / 2] (the multimodal positions of models/mrope.py) instead of at
    offset + t. MLX operations, not the fused kernel: it runs once per image prefill."""
    _check(qkv, heads, kv_heads, head_dim, 2 * angles.shape[-1])
    if qkv.shape[0] != 1 or angles.shape[0] != qkv.shape[1]:
        raise ValueError(f"attention_prologue_at: one sequence with one angle row per row, got qkv {qkv.shape}, "
                         f"angles {angles.shape}")
    q, k, v, gate = _split_norm(qkv, q_norm, k_norm, heads, kv_heads, head_dim, eps)
    return rotate(q, angles), rotate(k, angles), v.transpose(0, 2, 1, 3), mx.sigmoid(gate)


def launch(qkv, q_norm, k_norm, offset, heads, kv_heads, head_dim, rotary_dim, rope_theta, eps) -> Launch:
    _check(qkv, heads, kv_heads, head_dim, rotary_dim)
    if qkv.shape[0] != 1:
        raise ValueError(f"attention_prologue: the kernel takes one sequence, got a batch of {qkv.shape[0]}")
    t, dtype = qkv.shape[1], qkv.dtype
    threads = threads_for(head_dim)
    offset = offset if isinstance(offset, mx.array) else int(offset)
    return Launch(
        inputs=(qkv, q_norm, k_norm, offset, float(math.log2(rope_theta)), float(eps)),
        grid=(threads, heads + 2 * kv_heads, t), threadgroup=(threads, 1, 1),
        output_shapes=((1, heads, t, head_dim), (1, kv_heads, t, head_dim), (1, kv_heads, t, head_dim),
                       (1, t, heads * head_dim)),
        output_dtypes=(dtype,) * 4,
        template=(("T", dtype), ("H", heads), ("KVH", kv_heads), ("D", head_dim), ("R", rotary_dim),
                  ("TG", threads)))


def metal(qkv, q_norm, k_norm, offset, *rest):
    """The kernel, one sequence of the batch at a time."""
    if qkv.shape[0] == 1:
        return tuple(KERNEL(launch(qkv, q_norm, k_norm, offset, *rest)))
    parts = [KERNEL(launch(qkv[i:i + 1], q_norm, k_norm, offset[i], *rest)) for i in range(qkv.shape[0])]
    return tuple(mx.concatenate(arrays) for arrays in zip(*parts))


def attention_prologue(qkv: mx.array, q_norm: mx.array, k_norm: mx.array, offset, heads: int, kv_heads: int,
                       head_dim: int, rotary_dim: int, rope_theta: float, eps: float):
    """qkv [B, T, (2H + 2KVH) * D]: the fused q_proj (per head query | gate), k_proj and
    v_proj output of B sequences; offset: position of row 0 (int, or an int32 scalar
    array; with B > 1 an int32 array [B], one per sequence).
    Returns (q [B, H, T, D], k [B, KVH, T, D], v [B, KVH, T, D], sigmoid(gate) [B, T, H*D])."""
    args = (qkv, q_norm, k_norm, offset, heads, kv_heads, head_dim, rotary_dim, rope_theta, eps)
    return metal(*args) if use_metal() else reference(*args)
