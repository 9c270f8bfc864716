"""MLX models read from packs: the Qwen3.5/3.6 hybrid target (dense and MoE), its own
MTP head, the DSpark / DFlash draft, and the vision tower (read from a checkpoint)."""

from .draft_args import DraftArgs, DraftError
from .dspark import Draft, Proposal
from .loading import MODELS, load_draft, load_model, load_mtp
from .mtp import MTPHead
from .qwen3_5 import Qwen3_5, Qwen3_5Moe, Segment
from .target_args import ConfigError, ModelArgs
from .vision import VisionArgs, VisionTower, load_vision_tower
from .weights import PackWeights

__all__ = [
    "MODELS",
    "ConfigError",
    "Draft",
    "DraftArgs",
    "DraftError",
    "MTPHead",
    "ModelArgs",
    "PackWeights",
    "Proposal",
    "Qwen3_5",
    "Qwen3_5Moe",
    "Segment",
    "VisionArgs",
    "VisionTower",
    "load_draft",
    "load_model",
    "load_mtp",
    "load_vision_tower",
]
