"""GDN state commit by tape replay (docs/drafts.md 4.5): from the pre-round F32 state and a
verify pass's tape (models/cache.py GDNTape: window [1, K-1+T, C], k [1, T, Hk, Dk],
v [1, T, Hv, Dv], gamma, beta [1, T, Hv]), the conv and recurrent states after exactly
the first `rows` rows. `rows` is a runtime value in the kernel: one compiled kernel
serves every accepted length. q is not needed: it only shapes the outputs.
"""

from __future__ import annotations

import mlx.core as mx

from .kernel import Launch, MetalKernel, use_metal
from .recurrence import gated_delta

ROWS_PER_THREADGROUP = 8  # SIMD groups (state rows) per threadgroup
KERNEL = MetalKernel("monolith_gdn_replay", "gdn_replay.metal",
                     ("window", "k", "v", "gamma", "beta", "state", "rows"), ("state_out", "conv_out"))


def _check(window, k, v, gamma, beta, state, rows, conv_rows):
    _, t, hk, dk = k.shape
    _, hv, dv, dk2 = state.shape
    c = 2 * hk * dk + hv * dv
    conv_rows = window.shape[1] - t if conv_rows is None else conv_rows
    if (dk2 != dk or v.shape != (1, t, hv, dv) or gamma.shape != (1, t, hv) or beta.shape != (1, t, hv)
            or window.shape != (1, conv_rows + t, c) or hv % hk):
        raise ValueError(f"gdn_replay: inconsistent tape: window {window.shape}, k {k.shape}, v {v.shape}, "
                         f"gamma {gamma.shape}, beta {beta.shape}, state {state.shape}")
    if not 0 <= rows <= t:
        raise ValueError(f"gdn_replay: cannot keep {rows} rows of a {t}-row tape")
    return hk, dk, hv, dv, conv_rows


def reference(window, k, v, gamma, beta, state, rows: int, conv_rows: int | None = None):
    *_, conv_rows = _check(window, k, v, gamma, beta, state, rows, conv_rows)
    conv = window[:, rows:rows + conv_rows]
    if rows == 0:
        return conv, state
    ks = k[:, :rows]  # q only shapes the discarded output: pass k
    _, new_state = gated_delta(ks, ks, v[:, :rows], gamma[:, :rows], beta[:, :rows], state)
    return conv, new_state


def launch(window, k, v, gamma, beta, state, rows: int, conv_rows: int | None = None) -> Launch:
    hk, dk, hv, dv, conv_rows = _check(window, k, v, gamma, beta, state, rows, conv_rows)
    tgy = min(dv, ROWS_PER_THREADGROUP)
    return Launch(inputs=(window, k, v, gamma, beta, state, int(rows)), grid=(32, dv, hv), threadgroup=(32, tgy, 1),
                  output_shapes=(state.shape, (1, conv_rows, window.shape[2])),
                  output_dtypes=(mx.float32, mx.float32),
                  template=(("HK", hk), ("DK", dk), ("HV", hv), ("DV", dv), ("KM1", conv_rows),
                            ("PER_LANE", -(-dk // 32))))


def metal(*args):
    state, conv = KERNEL(launch(*args))
    return conv, state


def gdn_replay(window: mx.array, k: mx.array, v: mx.array, gamma: mx.array, beta: mx.array, state: mx.array,
               rows: int, conv_rows: int | None = None) -> tuple[mx.array, mx.array]:
    """(conv [1, K-1, C], recurrent [1, Hv, Dv, Dk]) after the first `rows` tape rows,
    from the recurrent `state` before them (GDNTape.replay's contract)."""
    args = (window, k, v, gamma, beta, state, rows, conv_rows)
    return metal(*args) if use_metal() else reference(*args)
