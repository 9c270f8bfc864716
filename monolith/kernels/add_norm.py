"""Residual add + RMSNorm (decoder layer: h = x + mixer(...), then
post_attention_layernorm(h)): h in the compute dtype, and the zero-centred RMSNorm of h
with the stored (1 + w) F32 weight, computed in F32 and cast back (layers.rms_norm).
"""

from __future__ import annotations

import mlx.core as mx

from .kernel import Launch, MetalKernel, threads_for, use_metal

KERNEL = MetalKernel("monolith_add_rms_norm", "add_rms_norm.metal", ("x", "y", "weight", "eps"), ("h", "normed"))


def _check(x, y, weight):
    if x.shape != y.shape or x.dtype != y.dtype or weight.shape != (x.shape[-1],):
        raise ValueError(f"add_rms_norm: x, y [..., H] of one dtype and weight [H] expected, got {x.shape} {x.dtype}, "
                         f"{y.shape} {y.dtype}, {weight.shape}")


def reference(x, y, weight, eps):
    _check(x, y, weight)
    h = x + y
    return h, mx.fast.rms_norm(h, weight, eps).astype(h.dtype)


def launch(x, y, weight, eps) -> Launch:
    _check(x, y, weight)
    hidden = x.shape[-1]
    threads = threads_for(hidden, 512)
    return Launch(inputs=(x, y, weight, float(eps)), grid=(threads, x.size // hidden, 1), threadgroup=(threads, 1, 1),
                  output_shapes=(x.shape, x.shape), output_dtypes=(x.dtype, x.dtype),
                  template=(("T", x.dtype), ("HID", hidden), ("TG", threads)))


def metal(x, y, weight, eps) -> tuple[mx.array, mx.array]:
    h, normed = KERNEL(launch(x, y, weight, eps))
    return h, normed


def add_rms_norm(x: mx.array, y: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """(h = x + y, rmsnorm(h) * weight) for x, y [..., H] (compute dtype), weight [H] F32 (1 + w)."""
    return metal(x, y, weight, eps) if use_metal() else reference(x, y, weight, eps)
