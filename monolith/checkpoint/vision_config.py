"""A checkpoint's `vision_config` (the Qwen3.5/3.6 vision tower's widths) and the tensors
it implies: read here, below the pack layer, so that packing checks the tower's tensors
and the model (models/vision.py) runs them from the same arguments."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import CheckpointError


@dataclass(frozen=True)
class VisionArgs:
    """The fields of a checkpoint's `vision_config` the tower reads."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int
    in_channels: int = 3
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0

    @classmethod
    def from_config(cls, vision_config: dict, where: str = "vision_config") -> VisionArgs:
        act = vision_config.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise CheckpointError(f"{where}: hidden_act {act!r} is not supported (only gelu_pytorch_tanh)")
        rope = vision_config.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise CheckpointError(f"{where}: rope_type {rope['rope_type']!r} is not supported (only axial)")
        try:
            args = cls(**{f: vision_config[f] for f in cls.__dataclass_fields__ if f in vision_config},
                       rope_theta=float(rope.get("rope_theta", 10000.0)))
        except TypeError as e:
            raise CheckpointError(f"{where}: {e}") from None
        if args.hidden_size % args.num_heads or (args.hidden_size // args.num_heads) % 4:
            raise CheckpointError(f"{where}: head dim must be a multiple of 4 (hidden_size / num_heads)")
        if math.isqrt(args.num_position_embeddings) ** 2 != args.num_position_embeddings:
            raise CheckpointError(f"{where}: num_position_embeddings must be a square")
        return args

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def expected_shapes(args: VisionArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower (names after the `model.visual.` prefix) and its shape."""
    d, i, m = args.hidden_size, args.intermediate_size, args.hidden_size * args.spatial_merge_size ** 2
    patch = (args.in_channels, args.temporal_patch_size, args.patch_size, args.patch_size)
    shapes = {
        "patch_embed.proj.weight": (d, *patch), "patch_embed.proj.bias": (d,),
        "pos_embed.weight": (args.num_position_embeddings, d),
        "merger.norm.weight": (d,), "merger.norm.bias": (d,), "merger.linear_fc1.weight": (m, m),
        "merger.linear_fc1.bias": (m,), "merger.linear_fc2.weight": (args.out_hidden_size, m),
        "merger.linear_fc2.bias": (args.out_hidden_size,),
    }
    block = {
        "norm1.weight": (d,), "norm1.bias": (d,), "norm2.weight": (d,), "norm2.bias": (d,),
        "attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,), "attn.proj.weight": (d, d), "attn.proj.bias": (d,),
        "mlp.linear_fc1.weight": (i, d), "mlp.linear_fc1.bias": (i,), "mlp.linear_fc2.weight": (d, i),
        "mlp.linear_fc2.bias": (d,),
    }
    for b in range(args.depth):
        shapes.update({f"blocks.{b}.{n}": shape for n, shape in block.items()})
    return shapes
