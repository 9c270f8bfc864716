"""The target's arguments (docs/target.md, "Config"): the fields of a Qwen3.5 / Qwen3.6
config.json (its `text_config`) that the model reads, checked when it is read."""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.config import QWEN3_5_MOE
from .mrope import DEFAULT_SECTION, mrope_section


class ConfigError(ValueError):
    """config.json lacks a field the model needs, or asks for something unsupported."""


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    eos_token_ids: tuple[int, ...]
    intermediate_size: int | None = None  # dense MLP
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    # the multimodal rotary's frequency counts (models/mrope.py); None: not interleaved
    mrope_section: tuple[int, int, int] | None = DEFAULT_SECTION

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @classmethod
    def from_config(cls, config: dict, architecture: str, generation_config: dict | None = None,
                    where: str = "config.json") -> ModelArgs:
        """Read `text_config` (or the config itself when it has none)."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

        def need(name):
            if name not in text:
                raise ConfigError(f"{where}: the text config has no field {name!r}")
            return text[name]

        layers = need("num_hidden_layers")
        layer_types = text.get("layer_types") or [
            "full_attention" if (i + 1) % text.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(layers)
        ]
        unknown = sorted(set(layer_types) - {"full_attention", "linear_attention"})
        if len(layer_types) != layers or unknown:
            raise ConfigError(f"{where}: layer_types must list {layers} of full_attention/linear_attention"
                              + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"{where}: rope_type {rope['rope_type']!r} is not supported (only default RoPE)")
        theta = rope.get("rope_theta", text.get("rope_theta"))
        if theta is None:
            raise ConfigError(f"{where}: no rope_theta in rope_parameters or the text config")
        moe = architecture == QWEN3_5_MOE
        return cls(
            architecture=architecture,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_hidden_layers=layers,
            layer_types=tuple(layer_types),
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=need("num_key_value_heads"),
            head_dim=need("head_dim"),
            linear_num_key_heads=need("linear_num_key_heads"),
            linear_num_value_heads=need("linear_num_value_heads"),
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            linear_conv_kernel_dim=need("linear_conv_kernel_dim"),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            max_position_embeddings=text.get("max_position_embeddings"),
            eos_token_ids=_eos_ids(generation_config, text, config),
            intermediate_size=None if moe else need("intermediate_size"),
            num_experts=need("num_experts") if moe else None,
            num_experts_per_tok=need("num_experts_per_tok") if moe else None,
            moe_intermediate_size=need("moe_intermediate_size") if moe else None,
            shared_expert_intermediate_size=need("shared_expert_intermediate_size") if moe else None,
            mrope_section=_section(rope, where),
        )


def _section(rope: dict, where: str) -> tuple[int, int, int] | None:
    """The interleaved multimodal rotary's section, None when the layout is not interleaved
    (text still runs; multimodal positions are refused then)."""
    if rope.get("mrope_interleaved", True) is not True:
        return None
    try:
        return mrope_section(rope)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def _eos_ids(*configs) -> tuple[int, ...]:
    """eos_token_id of the first config that has one (generation_config first)."""
    for cfg in configs:
        eos = (cfg or {}).get("eos_token_id")
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()

