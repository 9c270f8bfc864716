"""A safety net for Macs: before serving, run one short forward through the fused
kernels and the same forward through the references; if the kernels fail to build or
disagree, warn and use the references for the rest of the process (slower, correct).
On MLX's CUDA backend the kernels (Metal bodies) never run: the check says so and the
references serve."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import mlx.core as mx

from .kernel import ENV, backend, gpu_backend

log = logging.getLogger("monolith.kernels")
TOLERANCE = 2e-2  # relative to the largest reference logit: a few BF16 roundings


def check_kernels(forward: Callable[[], mx.array]) -> bool:
    """True when the kernels are in use and agree with the references on `forward()`
    (a function that runs a fresh forward and returns its logits). Off Metal it runs
    nothing; on a CUDA GPU it logs that the references stand in for the kernels."""
    if backend() != "metal":
        if gpu_backend() == "cuda":
            log.info("MLX computes on CUDA: the fused kernels are Metal, so their MLX references run "
                     "(docs/kernels.md)")
        return False
    failure = None
    try:
        got = forward()
        mx.eval(got)
    except Exception as e:  # a body Metal cannot compile, a launch it refuses
        failure = f"{type(e).__name__}: {e}"
    forced = os.environ.get(ENV)
    os.environ[ENV] = "reference"
    expected = forward()
    mx.eval(expected)
    if failure is None:
        scale = float(mx.max(mx.abs(expected)).item()) or 1.0
        error = float(mx.max(mx.abs(got.astype(mx.float32) - expected.astype(mx.float32))).item()) / scale
        if error <= TOLERANCE:
            if forced is None:
                del os.environ[ENV]
            else:
                os.environ[ENV] = forced
            return True
        failure = f"logits differ from the references by {error:.2e} (relative)"
    if forced == "metal":
        os.environ[ENV] = forced
        raise RuntimeError(f"{ENV}=metal, but the fused kernels failed their check: {failure}")
    log.warning("the fused Metal kernels failed their start-up check (%s); using the MLX references "
                "for this process. Please report this with your Mac model and macOS version.", failure)
    return False
