"""What every fused op shares: the backend choice and one `mx.fast.metal_kernel` call.

A `MetalKernel` names a body in metal/ and its parameters; a `Launch` is one call of it
(inputs, template values, grid, threadgroup, outputs). The Metal path and the CPU
emulator (tests/metal_emulator) take the same two objects, so what the tests run is what
a Mac runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import mlx.core as mx

from .source import read_body

ENV = "MONOLITH_KERNELS"
BACKENDS = ("auto", "metal", "reference")
SIMD_WIDTH = 32


class KernelBackendError(RuntimeError):
    """MONOLITH_KERNELS asks for something this machine cannot do."""


def backend() -> str:
    """"metal" or "reference": MONOLITH_KERNELS=reference|metal forces one; unset (or
    "auto") picks Metal when MLX has it. MLX's CUDA backend runs the references: the
    kernel bodies are Metal (docs/kernels.md)."""
    choice = os.environ.get(ENV, "").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise KernelBackendError(f"{ENV} must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "reference":
        return "reference"
    if mx.metal.is_available():
        return "metal"
    if choice == "metal":
        raise KernelBackendError(f"{ENV}=metal, but Metal is not available on this machine "
                                 f"(unset it or use {ENV}=reference)")
    return "reference"


def use_metal() -> bool:
    return backend() == "metal"


def on_gpu() -> bool:
    """Does MLX compute on a GPU: Metal on a Mac, CUDA on Linux with NVIDIA? (The default
    device's type, whichever backend; the fused kernels need Metal itself: use_metal.)"""
    return mx.default_device() == mx.gpu


def gpu_backend() -> str | None:
    """"metal" or "cuda": the MLX backend the default device computes on; None on the CPU."""
    if not on_gpu():
        return None
    if mx.metal.is_available():
        return "metal"
    return "cuda" if mx.cuda.is_available() else None


def threads_for(width: int, limit: int = 256) -> int:
    """Threads of a 1-D threadgroup that covers `width` items: whole SIMD groups, at most `limit`."""
    return max(SIMD_WIDTH, min(limit, -(-width // SIMD_WIDTH) * SIMD_WIDTH))


@dataclass(frozen=True)
class Launch:
    """One call of a MetalKernel (the arguments of the callable metal_kernel returns)."""

    inputs: tuple
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple
    output_dtypes: tuple
    template: tuple = ()
    init_value: float | None = None


@dataclass
class MetalKernel:
    name: str
    filename: str  # the body, metal/<filename>
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    header: str = ""
    ensure_row_contiguous: bool = True
    atomic_outputs: bool = False
    _function: object = field(default=None, repr=False, compare=False)

    @property
    def source(self) -> str:
        return read_body(self.filename)

    def __call__(self, launch: Launch) -> list[mx.array]:
        if self._function is None:
            self._function = mx.fast.metal_kernel(
                name=self.name, input_names=list(self.input_names), output_names=list(self.output_names),
                source=self.source, header=self.header, ensure_row_contiguous=self.ensure_row_contiguous,
                atomic_outputs=self.atomic_outputs)
        kwargs = {"template": list(launch.template)} if launch.template else {}
        if launch.init_value is not None:
            kwargs["init_value"] = launch.init_value
        return self._function(inputs=list(launch.inputs), grid=launch.grid, threadgroup=launch.threadgroup,
                              output_shapes=list(launch.output_shapes), output_dtypes=list(launch.output_dtypes),
                              **kwargs)
