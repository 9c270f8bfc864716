"""Scoring a token sequence: the log-probability the target gives each of its tokens
after the ones before it (the completions API's `echo` with `logprobs`, which lm-eval's
loglikelihood and perplexity tasks read).

One forward of the target over the sequence on a cache of its own (never a session's,
never the prompt cache's), in chunks of SCORE_CHUNK rows, reading the logits of every
row: row i's log-softmax (float32) gives token i + 1's logprob and, with k, the k likeliest
ids. Run it on the engine's worker thread (`Engine.call`), which owns the MLX state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .events import RequestError, TokenLogprob

SCORE_CHUNK = 128  # rows per forward: their logits are rows x vocab float32


@dataclass(frozen=True)
class Scores:
    """The logprobs of tokens 1.. of a sequence (token 0 has none), and `after`: the
    likeliest of the `after` candidates under the row past the last token, or None."""

    tokens: list[TokenLogprob]
    after: TokenLogprob | None = None


def check_scored(ids: Sequence[int], vocab_size: int, max_context: int) -> list[int]:
    """The sequence as ints; RequestError naming "prompt" if it is empty, holds an id
    outside the vocabulary, or is longer than the context."""
    ids = [int(t) for t in ids]
    if not ids:
        raise RequestError("prompt", "the prompt is empty: at least one token is needed")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError("prompt", f"prompt token id {bad} is out of range for a vocabulary of {vocab_size}")
    if len(ids) > max_context:
        raise RequestError("prompt", f"prompt is {len(ids)} tokens but max_context is {max_context}")
    return ids


def score(model, ids: Sequence[int], k: int = 0, after: Sequence[int] = ()) -> Scores:
    """The logprob of each of ids[1:] under the target's rows before it, with the k
    likeliest ids of each row (k = 0: none); with `after`, the likeliest of those ids
    under the last row (which token a generation that stopped there chose, under greedy)."""
    ids = list(ids)
    cache = model.make_cache(len(ids))
    tokens = mx.array(ids, dtype=mx.int32)
    out: list[TokenLogprob] = []
    last = None
    for start in range(0, len(ids), SCORE_CHUNK):
        end = min(start + SCORE_CHUNK, len(ids))
        logits, _ = model.forward(tokens[start:end], cache, logits="all")
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        following = ids[start + 1:end + 1]  # the tokens these rows predict (the last row's is past the end)
        out += _read(logprobs[:len(following)], following, k)
        last = logprobs[-1]
        mx.eval(cache.arrays())
    found = None
    if after:
        row = np.array(last)
        best = max(after, key=lambda t: row[t])
        found = _read(last[None], [best], k)[0]
    return Scores(out, found)


def _read(logprobs: mx.array, following: list[int], k: int) -> list[TokenLogprob]:
    """The TokenLogprobs of `following` under rows `logprobs` [n, vocab]."""
    if not following:
        return []
    chosen = mx.take_along_axis(logprobs, mx.array(following, dtype=mx.int32)[:, None], axis=-1)[:, 0]
    arrays = [chosen]
    if k:
        top = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
        arrays += [top, mx.take_along_axis(logprobs, top, axis=-1)]
    mx.eval(*arrays)
    values = np.array(arrays[0]).tolist()
    tops = [[]] * len(following)
    if k:
        ids, lps = np.array(arrays[1]).tolist(), np.array(arrays[2]).tolist()
        tops = [sorted(zip(i, v), key=lambda p: -p[1]) for i, v in zip(ids, lps)]
    return [TokenLogprob(t, v, tuple(top)) for t, v, top in zip(following, values, tops)]
