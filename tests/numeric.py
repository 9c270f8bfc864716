"""Numeric comparisons the tests share."""

from __future__ import annotations

import numpy as np
from scipy import stats as scipy_stats


def rel(ours, ref) -> float:
    """max |ours - ref| / max |ref| in float64 (the tests' relative error)."""
    ref = np.asarray(ref, np.float64)
    return float(np.abs(np.asarray(ours, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def sequence_distribution(next_probs, n_tokens: int) -> dict[tuple, float]:
    """Every continuation of n_tokens tokens with its exact probability, the product of
    `next_probs(prefix)` (a probability array over the vocabulary after the continuation's
    tokens so far) along it; only tokens of nonzero probability branch."""
    cells: dict[tuple, float] = {}

    def expand(seq, prob):
        if len(seq) == n_tokens:
            cells[tuple(seq)] = prob
            return
        p = next_probs(seq)
        for t in np.flatnonzero(p):
            expand(seq + [int(t)], prob * p[t])

    expand([], 1.0)
    return cells


def chi_square_ok(counts, probs, alpha=1e-3) -> float:
    """p-value of counts against probs, merging cells expected below 5 (must exceed alpha)."""
    probs = np.asarray(probs, np.float64)
    counts, expected = np.asarray(counts, np.float64), probs / probs.sum() * np.sum(counts)
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        assert counts[-1] == 0
        counts, expected = counts[:-1], expected[:-1]
    pvalue = scipy_stats.chisquare(counts, expected).pvalue
    assert pvalue > alpha, (pvalue, counts, expected)
    return pvalue
