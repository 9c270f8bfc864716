"""MLX models read from packs: the Qwen3.5/3.6 hybrid target (dense and MoE) and the
DSpark / DFlash draft."""

from .dspark import Draft, DraftError, Proposal, load_draft
from .loading import MODELS, PackWeights, load_model
from .qwen3_5 import ConfigError, ModelArgs, Qwen3_5, Qwen3_5Moe

__all__ = [
    "MODELS",
    "ConfigError",
    "Draft",
    "DraftError",
    "ModelArgs",
    "PackWeights",
    "Proposal",
    "Qwen3_5",
    "Qwen3_5Moe",
    "load_draft",
    "load_model",
]
