"""A draft's arguments (docs/drafts.md sections 1-3) from its pack: the draft settings the pack
recorded (manifest layout.draft, DeepSpec conventions) and its copy of config.json.

One DraftArgs serves every draft format: what differs between them (where config.json
keeps the layer fields, how it states the taps) is asked of the draft's format in
monolith.pack.draft_formats (DRAFT_FORMATS), keyed by the draft's architecture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..pack.draft_formats import DRAFT_FORMATS

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class DraftError(ValueError):
    """The draft does not fit the target, or its config asks for something unsupported."""


def yarn_parameters(head_dim: int, theta: float, rope: dict, max_position_embeddings=None,
                    original_max_position_embeddings=None) -> tuple[np.ndarray, float]:
    """(inverse frequencies float32 [head_dim / 2], attention factor) of YaRN RoPE, as
    transformers' `_compute_yarn_parameters` (a config-level original_max_position_embeddings
    takes priority over the rope dict's, as in its `standardize_rope_params`)."""
    original = original_max_position_embeddings or rope.get("original_max_position_embeddings") \
        or max_position_embeddings
    if original is None:
        raise DraftError("yarn rope_parameters need original_max_position_embeddings")
    factor = rope.get("factor")
    if factor is None:
        factor = max_position_embeddings / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    extrapolation = 1 - np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


@dataclass(frozen=True)
class DraftArgs:
    """A draft of any format (`architecture`: a key of DRAFT_FORMATS)."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_inv_freq: tuple[float, ...] | None  # YaRN; None = plain RoPE with rope_theta
    rope_attention_factor: float  # YaRN scales cos and sin by this
    sliding_windows: tuple[int | None, ...]  # per layer: context rows the block sees (None = all)
    block_causal: tuple[bool, ...]  # per layer: slot k sees block slots <= k (else the whole block)
    input_embedding_scale: float  # the block's input embeddings are multiplied by it
    taps: tuple[int, ...]  # DeepSpec convention: id i = output of target layer i
    block_size: int
    mask_token_id: int
    markov_rank: int
    markov_head_type: str
    confidence_head: bool
    confidence_with_markov: bool
    sample_from_anchor: bool  # every slot predicts (DSpark) or slot 0 is dropped (DFlash)

    def stated_taps(self) -> str:
        """The taps as the draft's config.json states them (for error messages)."""
        return DRAFT_FORMATS[self.architecture].stated_taps(self.taps)

    @classmethod
    def from_pack(cls, config: dict, settings: dict, architecture: str, where: str) -> DraftArgs:
        """From the pack's draft settings and its copy of the draft's config.json.
        Target-only fields a qwen3 draft inherits (partial_rotary_factor, mrope_*,
        attn_output_gate, linear_*) are never read."""
        cfg = DRAFT_FORMATS[architecture].layer_config(config)

        def need(name, source=cfg):
            if source.get(name) is None:
                raise DraftError(f"{where}: the draft config has no {name}")
            return source[name]

        for field in ("block_size", "mask_token_id"):
            need(field, settings)
        layers = int(settings["num_layers"])
        windows, causal, embedding_scale = _block_mask(settings, layers, where)
        head_dim = int(need("head_dim"))  # never hidden / heads (the 35B drafts: 32 x 128 != 2048)
        theta, inv_freq, attention_factor = _rope(cfg, head_dim, where)
        if cfg.get("num_hidden_layers") not in (None, layers):
            raise DraftError(f"{where}: num_hidden_layers is {cfg['num_hidden_layers']} but the draft has "
                             f"{layers} layers")
        heads = _heads(settings, where)
        block_size = int(settings["block_size"])
        sample_from_anchor = bool(settings.get("sample_from_anchor", True))
        if block_size < (1 if sample_from_anchor else 2):
            raise DraftError(f"{where}: block_size {block_size} leaves no proposal")
        return cls(
            architecture=architecture,
            hidden_size=int(need("hidden_size")),
            num_layers=layers,
            num_heads=int(need("num_attention_heads")),
            num_kv_heads=int(need("num_key_value_heads")),
            head_dim=head_dim,
            intermediate_size=int(need("intermediate_size")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_inv_freq=inv_freq,
            rope_attention_factor=attention_factor,
            sliding_windows=windows,
            block_causal=causal,
            input_embedding_scale=embedding_scale,
            taps=tuple(int(t) for t in settings["target_layer_ids"]),
            block_size=block_size,
            mask_token_id=int(settings["mask_token_id"]),
            sample_from_anchor=sample_from_anchor,
            **heads,
        )


def _block_mask(settings: dict, layers: int, where: str) -> tuple[tuple, tuple, float]:
    """(sliding_windows, block_causal, input_embedding_scale) of the pack's settings."""
    attention = [settings.get(f) for f in ("sliding_windows", "block_causal", "input_embedding_scale")]
    if None in attention:
        raise DraftError(f"{where}: the pack's draft settings have no per-layer block mask (sliding_windows, "
                         "block_causal, input_embedding_scale): it was built by an older monolith; rebuild it")
    windows, causal, embedding_scale = attention
    if len(windows) != layers or len(causal) != layers:
        raise DraftError(f"{where}: sliding_windows {windows} / block_causal {causal} do not cover the "
                         f"draft's {layers} layers")
    return (tuple(None if w is None else int(w) for w in windows), tuple(bool(c) for c in causal),
            float(embedding_scale))


def _rope(cfg: dict, head_dim: int, where: str) -> tuple[float, tuple[float, ...] | None, float]:
    """(rope_theta, YaRN inverse frequencies or None, attention factor) of the layer config."""
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise DraftError(f"{where}: the draft config has no rope_theta")
    kind = rope.get("rope_type", rope.get("type", "default"))
    inv_freq, attention_factor = None, 1.0
    if kind == "yarn":
        inv, attention_factor = yarn_parameters(head_dim, float(theta), rope, cfg.get("max_position_embeddings"),
                                                cfg.get("original_max_position_embeddings"))
        inv_freq = tuple(float(f) for f in inv)
    elif kind != "default":
        raise DraftError(f"{where}: draft rope_type {kind!r} is not supported (default or yarn)")
    return float(theta), inv_freq, float(attention_factor)


def _heads(settings: dict, where: str) -> dict:
    """The Markov and confidence head fields of DraftArgs from the pack's settings."""
    rank, head_type = int(settings.get("markov_rank") or 0), settings.get("markov_head_type") or "vanilla"
    if head_type not in MARKOV_HEAD_TYPES:
        raise DraftError(f"{where}: markov_head_type {head_type!r} is not one of {', '.join(MARKOV_HEAD_TYPES)}")
    with_markov = bool(settings.get("confidence_head_with_markov"))
    if settings.get("enable_confidence_head") and with_markov and rank == 0:
        raise DraftError(f"{where}: confidence_head_with_markov needs a Markov head (markov_rank > 0)")
    return {"markov_rank": rank, "markov_head_type": head_type,
            "confidence_head": bool(settings.get("enable_confidence_head")), "confidence_with_markov": with_markov}
