"""Decisions that depend on where MLX computes (the CPU, Metal, or MLX's CUDA backend),
driven by stand-in backend probes: on CUDA the references run in place of the Metal
kernels, the GPU choices hold (compute dtype, no dense copies, one graph per forward), and
free memory is bounded by the GPU's own."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

import monolith.runtime.prompt_cache as prompt_cache
from monolith import kernels
from monolith.kernels import ENV, recurrence
from monolith.models import layers, weights


def probes(monkeypatch, metal: bool, cuda: bool) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx.metal, "is_available", lambda: metal)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)


def test_cpu_is_no_gpu():
    assert mx.default_device() == mx.gpu or (not kernels.on_gpu() and kernels.gpu_backend() is None)


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_gpu_choices_hold_on_either_backend(monkeypatch, backend):
    probes(monkeypatch, metal=backend == "metal", cuda=backend == "cuda")
    assert kernels.on_gpu() and kernels.gpu_backend() == backend
    assert kernels.backend() == ("metal" if backend == "metal" else "reference")
    assert weights.compute_dtype(None) == mx.bfloat16
    assert weights.dense_entries({"tensors": {}, "entries": {}}) == set()
    assert not layers.fast_exp()
    calls = []
    monkeypatch.setattr(mx.fast, "gated_delta_update", lambda *a, **kw: calls.append(a[0].shape) or ("o", "s"))
    for rows in (1, 5):
        q = mx.zeros((1, rows, 2, 4))
        recurrence.gated_delta(q, q, q, mx.ones((1, rows, 2)), mx.ones((1, rows, 2)))
    # one row: the fast op; several: the fast op where it is a kernel (Metal), else the chunked form
    assert calls == ([(1, 1, 2, 4), (1, 5, 2, 4)] if backend == "metal" else [(1, 1, 2, 4)])


def test_cuda_runs_the_references_and_says_so(monkeypatch, caplog):
    probes(monkeypatch, metal=False, cuda=True)
    monkeypatch.setenv(ENV, "metal")
    with pytest.raises(kernels.KernelBackendError, match="Metal is not available"):
        kernels.backend()
    monkeypatch.delenv(ENV)
    forwards = []
    with caplog.at_level(logging.INFO, logger="monolith.kernels"):
        assert not kernels.check_kernels(lambda: forwards.append(1))
    assert forwards == [] and "CUDA" in caplog.text and "references" in caplog.text


@pytest.mark.parametrize("backend", ["cpu", "metal", "cuda"])
def test_free_memory_is_bounded_by_the_gpus_own(monkeypatch, backend):
    if backend != "cpu":
        probes(monkeypatch, metal=backend == "metal", cuda=backend == "cuda")
    host = 100 * 2**30
    monkeypatch.setattr(prompt_cache, "host_memory", lambda: host)
    monkeypatch.setattr(mx, "get_memory_limit", lambda: 80 * 2**30)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 30 * 2**30)
    want = 50 * 2**30 if backend == "cuda" else host  # Metal and the CPU share the host's memory
    assert prompt_cache.available_memory() == want
    assert prompt_cache.default_budget() == int(prompt_cache.DEFAULT_MEMORY_SHARE * want)
