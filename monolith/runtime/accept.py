"""Acceptance of a verified block (docs/drafts.md 4.4): greedy (the longest prefix the target's
argmax agrees with) and rejection sampling (the emitted tokens follow the target's
filtered distribution exactly, whatever the draft proposed)."""

from __future__ import annotations

import mlx.core as mx


def accept_greedy(proposed: mx.array, logits: mx.array) -> mx.array:
    """[a, bonus] (int32, lazy) for proposals [l] against the verify logits [l + 1, V]:
    a = the longest prefix with x_k == argmax(row k-1), bonus = argmax of row a."""
    target = mx.argmax(logits, axis=-1).astype(mx.int32)
    accepted = mx.sum(mx.cumprod((proposed == target[:-1]).astype(mx.int32)))
    return mx.stack([accepted, mx.take(target, accepted)]).astype(mx.int32)


def accept_sampled(proposed: mx.array, p: mx.array, q: mx.array, key: mx.array) -> mx.array:
    """[a, bonus] (int32, lazy) by rejection sampling: x_k (k = 1..l) is accepted with
    probability min(1, p(x_k) / q(x_k)), p = the target's filtered rows [l + 1, V], q =
    the draft's [l, V]; the bonus is drawn from normalize(max(p - q, 0)) at the first
    rejection (from p when that is empty) or from p's last row when all were accepted.
    The emitted tokens are then distributed exactly as sampling from p row by row."""
    l = proposed.shape[0]
    accept_key, bonus_key = mx.random.split(key)
    rows = mx.arange(l)
    p_x, q_x = p[rows, proposed], q[rows, proposed]
    u = mx.random.uniform(shape=(l,), key=accept_key)
    accepted = mx.sum(mx.cumprod((u * q_x < p_x).astype(mx.int32)))  # u < p/q, exactly, for q > 0
    p_a = mx.take(p, accepted, axis=0)
    q_a = mx.take(mx.concatenate([q, mx.zeros((1, q.shape[1]), q.dtype)]), accepted, axis=0)
    residual = mx.maximum(p_a - q_a, 0.0)
    residual = mx.where(mx.sum(residual) > 0, residual, p_a)
    bonus = mx.random.categorical(mx.log(residual), key=bonus_key)
    return mx.stack([accepted.astype(mx.int32), bonus.astype(mx.int32)])
