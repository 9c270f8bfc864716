"""speculators' DSpark drafts (`speculators_model_type: "dspark"`, vLLM's format)."""

from __future__ import annotations

from ...checkpoint import Checkpoint
from ..recipe import PackError
from .base import DraftFormat


class SpeculatorsFormat(DraftFormat):
    """speculators' DSpark: the layer fields under transformer_layer_config, the taps as
    aux_hidden_state_layer_ids (which count the embedding as layer 0), the block mask from
    layer_types and sliding_window_non_causal, no default for sample_from_anchor."""

    def taps(self, where: str, cfg: dict) -> list:
        aux = cfg.get("aux_hidden_state_layer_ids")
        if aux is None:
            raise PackError(f"{where}: speculators draft without aux_hidden_state_layer_ids")
        return [int(i) - 1 for i in aux]  # speculators counts the embedding as layer 0

    def stated_taps(self, taps: tuple[int, ...] | list[int]) -> str:
        return f"aux_hidden_state_layer_ids {[i + 1 for i in taps]} (target layer ids {list(taps)})"

    def layer_config(self, cfg: dict) -> dict:
        return cfg.get("transformer_layer_config") or {}

    def block_causal(self, where: str, cfg: dict, layer_cfg: dict, sliding: list, windows: list) -> list:
        """speculators' create_anchor_block_mask_mod: `non_causal = sliding_window is None or
        sliding_window_non_causal` per layer, the flag defaulting to false, so full-attention
        layers are always bidirectional."""
        for name, source in (("is_causal", cfg), ("is_causal", layer_cfg), ("dflash_config", cfg)):
            if name in source:
                raise PackError(f"{where}: {name} is not read by speculators (its block mask follows "
                                "layer_types and sliding_window_non_causal); remove it")
        flag = cfg.get("sliding_window_non_causal", False)
        if not isinstance(flag, bool):
            raise PackError(f"{where}: sliding_window_non_causal {flag!r} must be true or false")
        return [w is not None and not flag for w in windows]

    def unstated_sample_from_anchor(self, ckpt: Checkpoint, where: str) -> bool:
        raise PackError(f"{where}: neither sample_from_anchor nor speculators_config speculative_tokens is given "
                        "(speculators reads a missing sample_from_anchor as true, vLLM as false)")
