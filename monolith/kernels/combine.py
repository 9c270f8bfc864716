"""MoE combine and the RMSNorm after it: h = residual + sum_k w_k * expert_out_k +
sigmoid(shared_gate) * shared_out (decoder layer, step 2), and rmsnorm(h) with the next
norm's stored (1 + w) F32 weight (the next layer's input_layernorm, or model.norm after
the last layer): every MoE block output goes straight into a norm.

The reference is the model's op sequence in the compute dtype; the kernel accumulates in
F32 and rounds h once, so in BF16 they agree to a few BF16 ulps, in F32 to rounding.
"""

from __future__ import annotations

import mlx.core as mx

from .kernel import Launch, MetalKernel, threads_for, use_metal

KERNEL = MetalKernel("monolith_moe_combine", "moe_combine.metal",
                     ("expert_out", "weights", "shared_out", "shared_gate", "residual", "norm_weight", "eps"),
                     ("h", "normed"))


def _check(expert_out, weights, shared_out, shared_gate, residual, norm_weight):
    t, k, hidden = expert_out.shape
    if (weights.shape != (t, k) or shared_out.shape != (t, hidden) or shared_gate.shape != (t, 1)
            or residual.size != t * hidden or residual.shape[-1] != hidden or norm_weight.shape != (hidden,)):
        raise ValueError(f"moe_combine: expert_out [T, k, H], weights [T, k], shared_out [T, H], shared_gate [T, 1], "
                         f"residual [..., H], norm_weight [H] expected, got {expert_out.shape}, {weights.shape}, "
                         f"{shared_out.shape}, {shared_gate.shape}, {residual.shape}, {norm_weight.shape}")
    return t, k, hidden


def reference(expert_out, weights, shared_out, shared_gate, residual, norm_weight, eps):
    _check(expert_out, weights, shared_out, shared_gate, residual, norm_weight)
    routed = (expert_out * weights.astype(expert_out.dtype)[..., None]).sum(axis=1)
    shared = shared_out * mx.sigmoid(shared_gate)
    h = residual + (routed + shared).reshape(residual.shape)
    return h, mx.fast.rms_norm(h, norm_weight, eps).astype(h.dtype)


def launch(expert_out, weights, shared_out, shared_gate, residual, norm_weight, eps) -> Launch:
    t, k, hidden = _check(expert_out, weights, shared_out, shared_gate, residual, norm_weight)
    threads = threads_for(hidden, 512)
    return Launch(inputs=(expert_out, weights, shared_out, shared_gate, residual, norm_weight, float(eps)),
                  grid=(threads, t, 1), threadgroup=(threads, 1, 1), output_shapes=(residual.shape,) * 2,
                  output_dtypes=(residual.dtype,) * 2,
                  template=(("T", residual.dtype), ("K", k), ("HID", hidden), ("TG", threads)))


def metal(*args) -> tuple[mx.array, mx.array]:
    h, normed = KERNEL(launch(*args))
    return h, normed


def moe_combine(expert_out: mx.array, weights: mx.array, shared_out: mx.array, shared_gate: mx.array,
                residual: mx.array, norm_weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """expert_out [T, k, H] (SwitchGLU), weights [T, k] F32 (router), shared_out [T, H],
    shared_gate [T, 1] (the logit), residual [..., H], norm_weight [H] F32 (1 + w) ->
    (h, rmsnorm(h)), both [..., H] in residual's dtype."""
    args = (expert_out, weights, shared_out, shared_gate, residual, norm_weight, eps)
    return metal(*args) if use_metal() else reference(*args)
