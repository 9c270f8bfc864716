"""What every draft format answers (DraftFormat), and where a draft config's shared
fields (block_size, mask_token_id, the head fields...) may sit (`config_field`): at the
top level or under one of the DFlash / DeepSpec nested blocks (NESTS). The formats
themselves are the other files of this package."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ...checkpoint import Checkpoint

NESTS = ("dflash_config", "dspark_config")


def config_field(cfg: dict, key: str):
    """A field at the top level or under one of the nested config blocks (NESTS); None
    when neither states it."""
    if key in cfg:
        return cfg[key]
    for nest in NESTS:
        block = cfg.get(nest) or {}
        if key in block:
            return block[key]
    return None


class DraftFormat(ABC):
    """Where one draft format's config.json keeps what the pack records and the draft's
    arguments read, and what it means by what it leaves unstated. The defaults here are
    the DeepSpec / DFlash layout: the layer fields at the top level of config.json, the
    taps as target_layer_ids (top level or nested)."""

    def taps(self, where: str, cfg: dict) -> list | None:
        """The target layer ids, DeepSpec convention (id i = output of target layer i)."""
        return config_field(cfg, "target_layer_ids")

    def stated_taps(self, taps: tuple[int, ...] | list[int]) -> str:
        """The taps (DeepSpec convention) as this format's config.json states them, for
        error messages."""
        return f"target_layer_ids {list(taps)}"

    def layer_config(self, cfg: dict) -> dict:
        """The part of config.json that holds the decoder layers' fields."""
        return cfg

    @abstractmethod
    def block_causal(self, where: str, cfg: dict, layer_cfg: dict, sliding: list, windows: list) -> list:
        """Per layer, whether the block is causal (slot k sees block slots <= k), given which
        layers are sliding_attention (`sliding`) and their windows (None = all rows).
        Raises PackError on a field this format does not read."""

    @abstractmethod
    def unstated_sample_from_anchor(self, ckpt: Checkpoint, where: str) -> bool:
        """Whether slot 0 predicts when no field states it (or PackError when the format
        leaves that open)."""
