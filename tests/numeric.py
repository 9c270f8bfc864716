"""Numeric comparisons the tests share."""

from __future__ import annotations

import numpy as np


def rel(ours, ref) -> float:
    """max |ours - ref| / max |ref| in float64 (the tests' relative error)."""
    ref = np.asarray(ref, np.float64)
    return float(np.abs(np.asarray(ours, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
