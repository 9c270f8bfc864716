"""The gated delta rule over T rows: mx.fast.gated_delta_update on Metal (a real kernel),
else a chunked form in plain matmuls. On the CPU (and on MLX's CUDA backend, which has
no kernel for it in MLX 0.32.4) the fast op falls back to a graph unrolled over time
(~30 primitives per row, a sequential VJP); the chunked form costs ~70 primitives for an
8-row verify and ~60 per 64 rows, and differentiates with mx.grad.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .kernel import gpu_backend

TINY = float(np.finfo(np.float32).tiny)  # gamma floor: log stays finite, exp(L) of it is ~0


@mx.custom_function
def _tri_inv(m):
    """Inverse of a unit lower-triangular m (LAPACK on the CPU; stable, unlike a Neumann series)."""
    return mx.linalg.tri_inv(m, upper=False, stream=mx.cpu)


@_tri_inv.vjp
def _tri_inv_vjp(primals, cotangent, output):
    x = output.swapaxes(-1, -2)
    return (-(x @ cotangent @ x),)


def _chunk(q, k, v, lg, beta, s0, rows: bool = False):
    """One chunk of C rows, heads as batch: q, k [B, H, C, Dk], v [B, H, C, Dv], lg (log
    gamma), beta [B, H, C], s0 [B, H, Dv, Dk]. With L_t = lg_1 + .. + lg_t and
    u_t = beta_t (v_t - gamma_t S_{t-1} k_t), S_t = e^L_t S0 + sum_{i<=t} e^(L_t-L_i) u_i k_i^T, so
    u_t + sum_{i<t} beta_t e^(L_t-L_i) (k_t.k_i) u_i = beta_t (v_t - e^L_t S0 k_t): a unit
    lower-triangular system. Decays are sums over their own rows (never differences of
    cumulative sums), all <= 0: nothing overflows or cancels. With `rows`, also every
    S_t [B, H, C, Dv, Dk] (the same sum, one row of decays each)."""
    c = q.shape[2]
    lower, eye = np.tri(c, dtype=np.float32), np.eye(c, dtype=np.float32)
    strict = mx.array(lower - eye)
    decay = mx.exp(mx.cumsum(lg[..., :, None] * strict, axis=-2)) * mx.array(lower)  # [t, i]: e^(L_t-L_i), i <= t
    head = mx.exp(mx.cumsum(lg, axis=-1))[..., None]  # e^L_t
    tail = mx.exp(mx.cumsum(lg, axis=-1, reverse=True, inclusive=False))[..., None]  # e^(L_C-L_i)
    s0t, kt, beta = s0.swapaxes(-1, -2), k.swapaxes(-1, -2), beta[..., None]
    u = _tri_inv(beta * decay * (k @ kt) * strict + mx.array(eye)) @ (beta * (v - head * (k @ s0t)))
    o = head * (q @ s0t) + (decay * (q @ kt)) @ u
    final = head[:, :, -1:] * s0 + (u * tail).swapaxes(-1, -2) @ k
    if not rows:
        return o, final
    # S_t = e^L_t S0 + sum_i decay[t, i] u_i k_i^T: per t, [Dv, C] @ [C, Dk]
    weighted = (decay[..., None] * u[:, :, None]).swapaxes(-1, -2)  # [B, H, t, Dv, i]
    every = head[..., None] * s0[:, :, None] + weighted @ k[:, :, None]
    return o, final, every


def gated_delta_rows(q: mx.array, k: mx.array, v: mx.array, gamma: mx.array, beta: mx.array,
                     state: mx.array | None = None, chunk: int = 64) -> tuple[mx.array, mx.array, mx.array]:
    """gated_delta, chunked, with the state after every row too: (o, the final state,
    states [B, T, Hv, Dv, Dk], F32). A speculative commit takes the state after the kept
    rows from these (one slice) instead of replaying them (the CPU's commit: replay.py)."""
    return chunked(q, k, v, gamma, beta, state, chunk, rows=True)


def gated_delta(q: mx.array, k: mx.array, v: mx.array, gamma: mx.array, beta: mx.array,
                state: mx.array | None = None, chunk: int = 64) -> tuple[mx.array, mx.array]:
    """mx.fast.gated_delta_update(q, k, v, gamma, beta, initial_state=state): q, k
    [B, T, Hk, Dk], v [B, T, Hv, Dv], gamma (decay in (0, 1]), beta [B, T, Hv], state
    [B, Hv, Dv, Dk] (None: zeros). Value head h reads key head h // (Hv / Hk). Per head, row
    by row, in F32:
        S = gamma_t S;  S = S + beta_t (v_t - S k_t) k_t^T;  o_t = S q_t
    (o after the update; q is not scaled: callers fold in Dk^-0.5). Returns o [B, T, Hv, Dv]
    in the dtype of q and k (result_type(q, k), as the fast op) and the final state in F32.
    The fast op where it is a kernel (Metal) or for one row (its unrolled step is ~30
    primitives, a chunk ~60), else chunked()."""
    if q.shape[1] == 1 or fast_recurrence():
        return mx.fast.gated_delta_update(q, k, v, gamma, beta, initial_state=state)
    return chunked(q, k, v, gamma, beta, state, chunk)


def fast_recurrence() -> bool:
    """Is mx.fast.gated_delta_update a kernel here (Metal), rather than a graph unrolled
    over rows (the CPU, CUDA)?"""
    return gpu_backend() == "metal"


def chunked(q, k, v, gamma, beta, state=None, chunk: int = 64, rows: bool = False):
    """gated_delta in chunks of `chunk` rows (_chunk). gamma below the smallest normal F32
    counts as that (its gradient is 0 there). `rows`: gated_delta_rows."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2:]
    dtype = mx.result_type(q, k)
    state = mx.zeros((b, hv, dv, dk)) if state is None else state.astype(mx.float32)
    if hv != hk:
        q, k = mx.repeat(q, hv // hk, axis=2), mx.repeat(k, hv // hk, axis=2)
    q, k, v = (x.astype(mx.float32).transpose(0, 2, 1, 3) for x in (q, k, v))
    lg = mx.log(mx.maximum(gamma.astype(mx.float32), TINY)).transpose(0, 2, 1)
    beta = beta.astype(mx.float32).transpose(0, 2, 1)
    outs, every = [], []
    for s in range(0, t, chunk):
        part = slice(s, s + chunk)
        o, state, *states = _chunk(q[:, :, part], k[:, :, part], v[:, :, part], lg[:, :, part], beta[:, :, part],
                                   state, rows)
        outs.append(o)
        every += states
    o = (outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)).transpose(0, 2, 1, 3).astype(dtype)
    if not rows:
        return o, state
    return o, state, (every[0] if len(every) == 1 else mx.concatenate(every, axis=2)).swapaxes(1, 2)
