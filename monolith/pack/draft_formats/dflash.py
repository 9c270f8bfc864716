"""z-lab DFlash drafts (`DFlashDraftModel`, or a `dflash_config` block): fields at the
top level or under dflash_config / dspark_config, read as vLLM reads them."""

from __future__ import annotations

from ...checkpoint import Checkpoint
from ..recipe import PackError
from .base import DraftFormat


class DFlashFormat(DraftFormat):
    """z-lab DFlash: the block mask from is_causal / dflash_config.causal, else causal on
    the sliding layers; slot 0 dropped unless the draft carries a DSpark Markov head."""

    def block_causal(self, where: str, cfg: dict, layer_cfg: dict, sliding: list, windows: list) -> list:
        """vLLM's `_dflash_layer_causal`: top-level `is_causal`, else `dflash_config.causal`,
        else causal exactly on the sliding_attention layers."""
        if "sliding_window_non_causal" in cfg:
            raise PackError(f"{where}: sliding_window_non_causal is a speculators field; this draft states its "
                            "block mask with is_causal or dflash_config.causal")
        if any(s and w is None for s, w in zip(sliding, windows)):
            raise PackError(f"{where}: sliding_attention layers without a window (sliding_window "
                            f"{layer_cfg.get('sliding_window')!r}, use_sliding_window "
                            f"{layer_cfg.get('use_sliding_window')!r})")
        causal = cfg.get("is_causal")
        field = "is_causal"
        if causal is None:
            causal, field = (cfg.get("dflash_config") or {}).get("causal"), "dflash_config.causal"
        if causal is None:
            return sliding
        if not isinstance(causal, bool):
            raise PackError(f"{where}: {field} {causal!r} must be true or false")
        return [causal] * len(sliding)

    def unstated_sample_from_anchor(self, ckpt: Checkpoint, where: str) -> bool:
        """A plain DFlash draft drops slot 0; a DSpark head predicts from every slot, also
        under a DFlash label (its Markov tensors say what it is)."""
        return ckpt.has_module("markov_head.markov_w1")
