"""A CPU emulator for `mx.fast.metal_kernel` bodies (docs/kernels.md, "Testing Metal
source on Linux"): the exact text MLX builds, compiled as C++ against a Metal shim, with
each threadgroup's threads run as cooperative fibers that switch at barriers and SIMD
collectives, and guarded buffers that turn out-of-bounds accesses into errors."""

import sys

import pytest

from .mlx_source import ArgInfo, kernel_source
from .runner import EmulatorError, OutOfBounds, emulation_unit, run

# ucontext fibers, Linux mmap flags and ELF symbol tables (nm): Linux only. On a Mac,
# tests/test_metal_real.py runs the real kernels instead.
requires_emulator = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                       reason="the Metal emulator needs Linux (ucontext fibers, mmap, ELF); "
                                              "on a Mac tests/test_metal_real.py runs the real kernels")


def run_kernel(kernel, launch, **options):
    """Run a monolith.kernels MetalKernel on one of its Launch values; options are run()'s
    (schedule, seed, align, stack_kb)."""
    return run(kernel.name, kernel.input_names, kernel.output_names, kernel.source, header=kernel.header,
               ensure_row_contiguous=kernel.ensure_row_contiguous, atomic_outputs=kernel.atomic_outputs,
               inputs=launch.inputs, template=launch.template, grid=launch.grid, threadgroup=launch.threadgroup,
               output_shapes=launch.output_shapes, output_dtypes=launch.output_dtypes,
               init_value=launch.init_value, **options)


__all__ = ["ArgInfo", "EmulatorError", "OutOfBounds", "emulation_unit", "kernel_source", "requires_emulator", "run",
           "run_kernel"]
