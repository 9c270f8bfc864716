"""Find a checkpoint (local directory or hub id), read its config and quantization
config, and read its tensors lazily, module by module."""

from .config import SUPPORTED_ARCHITECTURES
from .errors import CheckpointError
from .precision import ModuleSpec
from .reader import Checkpoint, open_checkpoint
from .resolve import resolve_checkpoint

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Checkpoint",
    "CheckpointError",
    "ModuleSpec",
    "open_checkpoint",
    "resolve_checkpoint",
]
