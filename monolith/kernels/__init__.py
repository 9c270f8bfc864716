"""Fused ops for the decode and verify paths (docs/kernels.md). Each op has a plain MLX
reference and a Metal kernel (body in metal/) with the same inputs and outputs; the
public functions pick the kernel when Metal is available, else the reference (the CPU,
and MLX's CUDA backend).
MONOLITH_KERNELS=reference|metal forces one (metal without Metal raises).

`KERNELS` is the one list of the fused ops, by short name: each a module with `KERNEL`
(its MetalKernel), `launch`, `metal` and `reference`. The CPU emulator's cases
(tests/metal_emulator/), tests/test_kernels.py and bench/primitives.py read it."""

from . import add_norm, attention, combine, embedding, gated_norm, premix, replay, router
from .add_norm import add_rms_norm
from .attention import attention_prologue, attention_prologue_at
from .check import check_kernels
from .combine import moe_combine
from .embedding import nvfp4_embedding
from .gated_norm import gated_rms_norm
from .kernel import ENV, KernelBackendError, Launch, MetalKernel, backend, gpu_backend, on_gpu, use_metal
from .premix import Premix, gdn_premix
from .recurrence import gated_delta, gated_delta_rows
from .replay import gdn_replay
from .router import moe_route

KERNELS = {"embedding": embedding, "premix": premix, "gated_norm": gated_norm, "router": router,
           "attention": attention, "add_norm": add_norm, "combine": combine, "replay": replay}

__all__ = [
    "ENV", "KERNELS", "KernelBackendError", "Launch", "MetalKernel", "Premix", "add_rms_norm", "attention_prologue",
    "attention_prologue_at", "backend",
    "check_kernels", "gated_delta", "gated_delta_rows", "gated_rms_norm", "gdn_premix", "gdn_replay", "gpu_backend",
    "moe_combine", "moe_route", "nvfp4_embedding", "on_gpu", "use_metal",
]
