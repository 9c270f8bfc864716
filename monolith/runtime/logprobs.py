"""Logprobs of the emitted tokens, under the raw distribution of the target's rows that
chose them (before any grammar mask or sampling filter): a plain step's row, or a
verify's rows for accepted, corrected and bonus tokens. The arrays stay lazy until the
round's host sync reads them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .events import TokenLogprob


def logprob_arrays(row: mx.array, token: mx.array, k: int | None) -> tuple:
    """(the sampled token's logprob, and with k the k likeliest ids and their logprobs),
    lazy, under `row`'s raw distribution; () without logprobs (k None)."""
    if k is None:
        return ()
    logprobs = row - mx.logsumexp(row, keepdims=True)
    chosen = logprobs[token]
    if not k:
        return (chosen,)
    top = mx.argpartition(-logprobs, k - 1)[:k]
    return chosen, top, logprobs[top]


def read_logprob(pending: tuple) -> TokenLogprob | None:
    """The TokenLogprob of (token, *logprob_arrays(...)), or None without logprobs."""
    if len(pending) == 1:
        return None
    token_id, chosen = int(pending[0].item()), float(pending[1].item())
    top = ()
    if len(pending) == 4:
        top = tuple(sorted(zip(pending[2].tolist(), pending[3].tolist()), key=lambda p: -p[1]))
    return TokenLogprob(token_id, chosen, top)


def verify_logprobs(logits: mx.array, proposed: mx.array, bonus: mx.array, k: int) -> tuple:
    """Lazy, per verify row i (l + 1 rows): the logprob of proposal i + 1 (rows 0..l-1),
    of the bonus, and with k > 0 the k likeliest ids and their logprobs; under the raw
    distribution of the target's rows, as plain decoding reports them."""
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    l = proposed.shape[0]
    chosen = mx.take_along_axis(lp[:l], proposed.astype(mx.int32)[:, None], axis=-1)[:, 0] if l \
        else mx.zeros((0,), lp.dtype)
    arrays = (chosen, lp[:, bonus])
    if k:
        top = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
        arrays += (top, mx.take_along_axis(lp, top, axis=-1))
    return arrays


def read_verify_logprobs(arrays: tuple, tokens: list[int]) -> list[TokenLogprob]:
    """The TokenLogprobs of a round's emitted tokens (the accepted proposals, then the
    bonus from the row after them), from verify_logprobs' evaluated arrays."""
    chosen, bonus = np.array(arrays[0]), np.array(arrays[1])
    top = [np.array(a) for a in arrays[2:]]
    out = []
    for row, token in enumerate(tokens):
        value = float(bonus[row] if row == len(tokens) - 1 else chosen[row])
        pairs = sorted(zip(top[0][row].tolist(), top[1][row].tolist()), key=lambda p: -p[1]) if top else []
        out.append(TokenLogprob(token, value, tuple(pairs)))
    return out
