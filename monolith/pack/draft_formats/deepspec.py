"""DeepSpec-native DSpark drafts (`Qwen3DSparkModel`, or a `dspark_config` block) and
their NVFP4 export."""

from __future__ import annotations

from ...checkpoint import Checkpoint
from .dflash import DFlashFormat


class DeepSpecFormat(DFlashFormat):
    """DeepSpec-native DSpark: laid out as a DFlash config (its block mask read as vLLM
    reads one), but every slot predicts unless stated."""

    def unstated_sample_from_anchor(self, ckpt: Checkpoint, where: str) -> bool:
        return True
