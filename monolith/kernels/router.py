"""MoE router (docs/target.md, MoE block): softmax (F32) over E expert logits -> top-k ->
renormalize, returned as expert ids int32 [T, k] and weights F32 [T, k].

The renormalized top-k softmax equals a softmax over the k selected logits, which both
paths compute. Order and ties: experts come largest logit first; equal logits go to the
lower expert index. The reference gets this from MLX's argsort, which is stable (tested);
the kernel compares (logit, index) pairs explicitly.

Non-finite logits (a diverged model, a bad checkpoint) never give an id outside [0, E):
NaN ranks as -inf, so once only -inf logits remain each slot takes the lowest expert not
yet taken (the tie rule). The weights are the softmax over the selected logits with each
logit equal to the largest counting exp(0) = 1, even when both are +inf or -inf (the
limit of equal logits): +inf logits share the weight, -inf ones below a larger logit get
0, an all -inf selection (a whole row of NaN or -inf) is uniform. They are always finite
and sum to 1.
"""

from __future__ import annotations

import mlx.core as mx

from .kernel import Launch, MetalKernel, threads_for, use_metal

KERNEL = MetalKernel("monolith_moe_router", "moe_router.metal", ("logits",), ("ids", "weights"))


def reference(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    logits = logits.astype(mx.float32)
    logits = mx.where(mx.isnan(logits), -mx.inf, logits)
    order = mx.argsort(-logits, axis=-1)[..., :k]
    top = mx.take_along_axis(logits, order, axis=-1)
    terms = mx.where(top == top[..., :1], 1.0, mx.exp(top - top[..., :1]))
    return order.astype(mx.int32), terms / terms.sum(axis=-1, keepdims=True)


def launch(logits: mx.array, k: int) -> Launch:
    if logits.ndim != 2 or not 0 < k <= logits.shape[1]:
        raise ValueError(f"moe_route: logits [T, E] and 0 < k <= E expected, got {logits.shape} and k={k}")
    t, e = logits.shape
    threads = threads_for(e)
    if -(-e // threads) > 32:
        raise ValueError(f"moe_route: at most {32 * threads} experts are supported")
    return Launch(inputs=(logits,), grid=(threads, t, 1), threadgroup=(threads, 1, 1),
                  output_shapes=((t, k), (t, k)), output_dtypes=(mx.int32, mx.float32),
                  template=(("E", e), ("K", k), ("TG", threads)))


def metal(logits, k) -> tuple[mx.array, mx.array]:
    ids, weights = KERNEL(launch(logits, k))
    return ids, weights


def moe_route(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Router logits [T, E] (F32) -> (expert ids int32 [T, k], weights F32 [T, k])."""
    return metal(logits, k) if use_metal() else reference(logits, k)
