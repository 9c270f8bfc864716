"""The start-up check that keeps a Mac serving (on the references) when a fused kernel
fails to build or disagrees. Driven here with stand-in forwards and a forced backend."""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import pytest

import monolith.kernels.check as check
from monolith.kernels import ENV

LOGITS = mx.array([1.0, -2.0, 3.0])


@pytest.fixture
def on_metal(monkeypatch):
    monkeypatch.setenv(ENV, "auto")  # registered, so teardown removes what the check sets
    monkeypatch.setattr(check, "backend", lambda: "reference" if os.environ.get(ENV) == "reference" else "metal")


def forward_with(kernel_result):
    """A forward whose kernel path returns or raises `kernel_result`; the reference path is exact."""
    def forward():
        if os.environ.get(ENV) == "reference":
            return LOGITS
        if isinstance(kernel_result, Exception):
            raise kernel_result
        return kernel_result
    return forward


def test_agreeing_kernels_stay_on(on_metal):
    assert check.check_kernels(forward_with(LOGITS * (1 + 1e-3)))
    assert os.environ[ENV] == "auto"


@pytest.mark.parametrize("kernel_result", [RuntimeError("[metal::Device] Unable to build metal library"),
                                           LOGITS + 1.0])
def test_failing_kernels_fall_back_to_references(on_metal, caplog, kernel_result):
    with caplog.at_level(logging.WARNING, logger="monolith.kernels"):
        assert not check.check_kernels(forward_with(kernel_result))
    assert os.environ[ENV] == "reference"
    assert "failed their start-up check" in caplog.text


def test_forced_metal_fails_loudly(on_metal, monkeypatch):
    monkeypatch.setenv(ENV, "metal")
    with pytest.raises(RuntimeError, match="MONOLITH_KERNELS=metal"):
        check.check_kernels(forward_with(RuntimeError("no library")))


def test_off_metal_the_check_does_nothing(monkeypatch):
    monkeypatch.setenv(ENV, "reference")
    calls = []
    assert not check.check_kernels(lambda: calls.append(1))
    assert calls == []
