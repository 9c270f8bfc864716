"""Model sizes of synthetic targets. `write_target(..., preset=Preset(...))` takes custom
sizes; the draft derives its sizes from the target's config (see draft.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Every matmul input dimension must be a multiple of this: NVFP4 needs K % 16 and
# MLX's mxfp8 (used for per-tensor FP8) needs K % 32.
K_MULTIPLE = 32


@dataclass(frozen=True)
class Preset:
    hidden_size: int = 64
    num_hidden_layers: int = 4
    full_attention_interval: int = 4  # layers 3, 7, ... use full attention
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 32
    intermediate_size: int = 128  # the dense model's MLP
    vocab_size: int = 512
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    # lm_head std = lm_head_gain / sqrt(hidden): > 1 gives peaked logits (few near-ties).
    lm_head_gain: float = 4.0
    # vision tower (written for realism; a text runtime skips it)
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_depth: int = 1
    vision_num_heads: int = 2
    vision_patch_size: int = 4
    vision_num_position_embeddings: int = 16

    def __post_init__(self):
        for name, value in asdict(self).items():
            if isinstance(value, int) and value <= 0:
                raise ValueError(f"Preset.{name} must be positive, got {value}")
        k_dims = {
            "hidden_size": self.hidden_size,
            "num_attention_heads * head_dim": self.num_attention_heads * self.head_dim,
            "linear_num_value_heads * linear_value_head_dim": self.linear_num_value_heads * self.linear_value_head_dim,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "intermediate_size": self.intermediate_size,
        }
        for what, k in k_dims.items():
            if k % K_MULTIPLE:
                raise ValueError(f"Preset: {what} = {k} is a matmul input size; it must be a multiple of {K_MULTIPLE}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("Preset: num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("Preset: linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("Preset: num_experts_per_tok exceeds num_experts")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"Preset: rotary dim head_dim * partial_rotary_factor = {self.rotary_dim} must be even")
        if self.vision_hidden_size % self.vision_num_heads:
            raise ValueError("Preset: vision_hidden_size must be a multiple of vision_num_heads")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mrope_section(self) -> list[int]:
        """Split of the rotary frequency pairs over (t, h, w), like [11, 11, 10] for 32."""
        half = self.rotary_dim // 2
        base, rest = divmod(half, 3)
        return [base + (1 if i < rest else 0) for i in range(3)]

    @property
    def layer_types(self) -> list[str]:
        n = self.full_attention_interval
        return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.num_hidden_layers)]


# The vision tower of the Qwen3.6 releases (27 blocks: 27 * 12 + 3 + 6 = 333 tensors).
QWEN36_VISION = dict(
    vision_hidden_size=1152,
    vision_intermediate_size=4304,
    vision_depth=27,
    vision_num_heads=16,
    vision_patch_size=16,
    vision_num_position_embeddings=2304,
)

PRESETS: dict[str, Preset] = {
    # Tests: the whole MoE target is about 1 MB in BF16.
    "tiny": Preset(),
    # bench/pack_build.py: a BF16 MoE target of about 1.3 GB (checked by a test).
    "bench": Preset(
        hidden_size=1024,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=48,
        num_experts_per_tok=8,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        intermediate_size=3072,
        vocab_size=32768,
        max_position_embeddings=32768,
    ),
    # The published widths and depths (Qwen/Qwen3.6-35B-A3B and Qwen/Qwen3.6-27B configs).
    "qwen3.6-35b-a3b": Preset(
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        vocab_size=248320,
        max_position_embeddings=262144,
        **QWEN36_VISION,
    ),
    "qwen3.6-27b": Preset(
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        intermediate_size=17408,
        vocab_size=248320,
        max_position_embeddings=262144,
        **QWEN36_VISION,
    ),
}


def resolve_preset(preset) -> Preset:
    if isinstance(preset, Preset):
        return preset
    if preset in PRESETS:
        return PRESETS[preset]
    raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)}; or pass a Preset)")
