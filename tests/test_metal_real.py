"""On a Mac: every real Metal kernel against its MLX reference (the emulator cannot prove
that Metal compiles a body or that its math matches; this does). Skipped elsewhere."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from metal_emulator.kernel_cases import CASES, as_list, check_case

from monolith import kernels
from monolith.kernels import KERNELS

pytestmark = pytest.mark.skipif(not mx.metal.is_available(), reason="Metal is not available on this machine")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_real_kernel_matches_reference(case):
    args = case.make(np.random.default_rng(CASES.index(case)))
    module = case.module
    got = as_list(module.metal(*args))
    mx.eval(got)
    check_case(case, got, as_list(module.reference(*args)))


def test_public_functions_pick_metal(monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels.backend() == "metal"
    monkeypatch.setenv(kernels.ENV, "metal")
    case = next(c for c in CASES if c.kernel == "router")
    args = case.make(np.random.default_rng(0))
    ids, _ = kernels.moe_route(*args)
    want_ids, _ = KERNELS["router"].reference(*args)
    assert mx.array_equal(ids, want_ids)


def test_replay_serves_every_length_without_recompiling():
    case = next(c for c in CASES if c.id == "replay-real-all-eight")
    *tape, _ = case.make(np.random.default_rng(1))
    for rows in range(9):
        got = KERNELS["replay"].metal(*tape, rows)
        check_case(case, list(got), list(KERNELS["replay"].reference(*tape, rows)))
