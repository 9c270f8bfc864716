"""The Qwen3.5/3.6 vision tower on MLX (docs/target.md, "Vision tower").

Input: the flattened patches [N, C * T * ps * ps] and one (t, h, w) grid per image, in
the order the Qwen image processor emits them (each frame's patches in 2 x 2
merge-block order); output: the merged features [N / 4, text hidden size], one row per
`<|image_pad|>` token. There are no deepstack features (Qwen3.5 has none; its text
model consumes only the merged features).

The host-side geometry (position-embedding taps, rotary positions, attention segments)
is computed per grid in numpy; the tower's arithmetic runs in MLX in the weights' dtype.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..checkpoint import Checkpoint, open_checkpoint
from ..checkpoint.errors import CheckpointError
from ..checkpoint.vision_config import VisionArgs, expected_shapes
from ..kernels.attention import turn
from ..pack import PackError, is_pack, read_manifest
from ..pack.target_recipe import VISION_PREFIX, VISION_SOURCES
from .image_inputs import PROCESSOR_FILES, ImageSettings, read_image_settings

LAYER_NORM_EPS = 1e-6


# ------------------------------------------------------------------ grid geometry (host)


def check_grids(grid_thw, merge: int) -> np.ndarray:
    grids = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if (grids <= 0).any() or (grids[:, 1:] % merge).any():
        raise ValueError(f"grid_thw: each (t, h, w) must be positive with h, w multiples of {merge}: {grids.tolist()}")
    return grids


def patch_rows_cols(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch of one h x w frame, in merge-block order."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return rows.reshape(shape).transpose(0, 2, 1, 3).ravel(), cols.reshape(shape).transpose(0, 2, 1, 3).ravel()


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (align_corners) of `size` positions into a `side`-long table."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0, None)
    return taps, weights.astype(np.float32)


def position_taps(grids: np.ndarray, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices [N, 4] into the learned side x side position table and their bilinear
    weights [N, 4]: the table resampled to each frame's grid, corners aligned."""
    indices, weights = [], []
    for t, h, w in grids.tolist():
        rows, cols = patch_rows_cols(h, w, merge)
        h_taps, h_weights = _axis_taps(rows, h, side)
        w_taps, w_weights = _axis_taps(cols, w, side)
        idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        wgt = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        indices += [idx] * t
        weights += [wgt] * t
    return np.concatenate(indices), np.concatenate(weights)


def rotary_positions(grids: np.ndarray, merge: int) -> np.ndarray:
    """(row, col) [N, 2] of every patch, each frame of an entry alike."""
    out = []
    for t, h, w in grids.tolist():
        out += [np.stack(patch_rows_cols(h, w, merge), axis=-1)] * t
    return np.concatenate(out)


def segments(grids: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each frame's patches: attention stays within one frame."""
    lengths = np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])
    ends = np.cumsum(lengths)
    return list(zip((ends - lengths).tolist(), ends.tolist()))


# ------------------------------------------------------------------------- the tower


class VisionOutput(NamedTuple):
    patch_embeds: mx.array  # [N, D] the patch projection, before the position embedding
    hidden: mx.array  # [N, D] after the blocks
    merged: mx.array  # [N / merge**2, out_hidden_size]


def layer_norm(x: mx.array, w: dict, name: str) -> mx.array:
    return mx.fast.layer_norm(x, w[f"{name}.weight"], w[f"{name}.bias"], LAYER_NORM_EPS)


def linear(x: mx.array, w: dict, name: str) -> mx.array:
    return mx.addmm(w[f"{name}.bias"], x, w[f"{name}.weight"].T)


def gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


def gelu_erf(x: mx.array) -> mx.array:
    return 0.5 * x * (1 + mx.erf(x * (1 / math.sqrt(2))))


class VisionTower:
    """The tower on weights named as under `model.visual.` (patch_embed.proj.weight
    flattened to [D, patch_dim]; blocks as one dict each)."""

    def __init__(self, args: VisionArgs, top: dict[str, mx.array], blocks: list[dict[str, mx.array]]):
        self.args, self.top, self.blocks = args, top, blocks
        self.side = math.isqrt(args.num_position_embeddings)
        quarter = args.head_dim // 4
        self.inv_freq = 1.0 / (args.rope_theta ** (mx.arange(0, 2 * quarter, 2, dtype=mx.float32) / (2 * quarter)))

    @property
    def dtype(self):
        return self.top["pos_embed.weight"].dtype

    def __call__(self, patches, grid_thw) -> mx.array:
        return self.forward(patches, grid_thw).merged

    def forward(self, patches, grid_thw) -> VisionOutput:
        a = self.args
        grids = check_grids(grid_thw, a.spatial_merge_size)
        patches = mx.array(patches).astype(self.dtype)
        n = int((grids[:, 0] * grids[:, 1] * grids[:, 2]).sum())
        if patches.shape != (n, a.patch_dim):
            raise ValueError(f"patches: shape {tuple(patches.shape)}, grid_thw needs ({n}, {a.patch_dim})")
        embeds = linear(patches, self.top, "patch_embed.proj")
        idx, wgt = position_taps(grids, self.side, a.spatial_merge_size)
        table = self.top["pos_embed.weight"]
        x = embeds + (table[mx.array(idx)] * mx.array(wgt)[:, :, None].astype(self.dtype)).sum(axis=1)
        cos, sin = self.rotary(rotary_positions(grids, a.spatial_merge_size))
        spans = segments(grids)
        for w in self.blocks:
            x = x + self.attention(layer_norm(x, w, "norm1"), w, cos, sin, spans)
            x = x + linear(gelu_tanh(linear(layer_norm(x, w, "norm2"), w, "mlp.linear_fc1")), w, "mlp.linear_fc2")
        merged = layer_norm(x, self.top, "merger.norm").reshape(n // a.spatial_merge_size ** 2, -1)
        merged = linear(gelu_erf(linear(merged, self.top, "merger.linear_fc1")), self.top, "merger.linear_fc2")
        return VisionOutput(embeds, x, merged)

    def rotary(self, positions: np.ndarray) -> tuple[mx.array, mx.array]:
        """cos, sin [N, head_dim / 2] of each patch's angles: a quarter of the head's
        frequencies on its row, a quarter on its column (rotate-half pairs)."""
        freqs = mx.array(positions, dtype=mx.float32)[:, :, None] * self.inv_freq  # [N, 2, hd/4]
        angles = freqs.reshape(freqs.shape[0], -1)
        return mx.cos(angles), mx.sin(angles)

    def attention(self, x: mx.array, w: dict, cos: mx.array, sin: mx.array, spans) -> mx.array:
        a = self.args
        n = x.shape[0]
        qkv = linear(x, w, "attn.qkv").reshape(n, 3, a.num_heads, a.head_dim).transpose(1, 2, 0, 3)
        q, k, v = turn(qkv[0], cos, sin), turn(qkv[1], cos, sin), qkv[2]  # [heads, N, head_dim]
        out = []
        for start, end in spans:
            qs, ks, vs = (t[None, :, start:end] for t in (q, k, v))
            o = mx.fast.scaled_dot_product_attention(qs, ks, vs, scale=a.head_dim ** -0.5)
            out.append(o[0].transpose(1, 0, 2))
        return linear(mx.concatenate(out).reshape(n, -1), w, "attn.proj")


# --------------------------------------------------------------------------- the target's eyes


class Vision:
    """What taking images needs for one target: the image processor's settings, the
    vision token ids of its config, and the tower, loaded by `load()` on the first image
    (never for a text-only server). The runtime calls `features` on its worker thread."""

    def __init__(self, config: dict, settings, load: Callable[[], VisionTower], where: str = "config.json"):
        try:
            self.image_token_id = int(config["image_token_id"])
            self.vision_start_id = int(config["vision_start_token_id"])
            self.vision_end_id = int(config["vision_end_token_id"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: a vision model needs image_token_id, vision_start_token_id and "
                                  f"vision_end_token_id ({e})") from None
        self.args = VisionArgs.from_config(config.get("vision_config") or {}, where=f"{where}: vision_config")
        if settings is None:  # no processor config: the tower's own sizes, the processor's defaults
            settings = ImageSettings(patch_size=self.args.patch_size, merge_size=self.args.spatial_merge_size,
                                     temporal_patch_size=self.args.temporal_patch_size)
        self.settings = settings
        if (settings.patch_size, settings.merge_size, settings.temporal_patch_size) != (
                self.args.patch_size, self.args.spatial_merge_size, self.args.temporal_patch_size):
            raise CheckpointError(f"{where}: the image processor's patch/merge/temporal sizes "
                                  f"{(settings.patch_size, settings.merge_size, settings.temporal_patch_size)} differ "
                                  f"from the vision_config's")
        self._load = load
        self._tower: VisionTower | None = None

    @property
    def merge_size(self) -> int:
        return self.args.spatial_merge_size

    @property
    def loaded(self) -> bool:
        return self._tower is not None

    def tower(self) -> VisionTower:
        if self._tower is None:
            self._tower = self._load()
        return self._tower

    def features(self, image) -> mx.array:
        """The merged features [image.tokens, text hidden] of one image_inputs.PreparedImage."""
        return self.tower()(image.patches, [image.grid_thw])


# --------------------------------------------------------------------------- loading


def load_vision_tower(checkpoint, dtype=mx.float32) -> VisionTower:
    """The tower of a checkpoint (a directory or an open monolith.checkpoint Checkpoint)
    from its `model.visual.*` tensors (BF16/F16/F32), cast to `dtype`."""
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    vision_config = ckpt.config.get("vision_config")
    if not isinstance(vision_config, dict):
        raise CheckpointError(f"{ckpt.path}: config.json has no vision_config")
    args = VisionArgs.from_config(vision_config, where=f"{ckpt.path}/config.json: vision_config")
    prefix = next((p for p in VISION_SOURCES if ckpt.has(p + "pos_embed.weight")), None)
    if prefix is None:
        raise CheckpointError(f"{ckpt.path}: no vision tower ({VISION_SOURCES[0]}pos_embed.weight)")
    shapes = expected_shapes(args)
    stored = {n[len(prefix):] for n in ckpt.tensor_names() if n.startswith(prefix)}
    missing, extra = sorted(set(shapes) - stored), sorted(stored - set(shapes))
    if missing or extra:
        raise CheckpointError(f"{ckpt.path}: vision tower tensors under {prefix}: missing {missing[:5]}, "
                              f"unexpected {extra[:5]}")
    values = {}
    for name, shape in shapes.items():
        if tuple(ckpt.shape(prefix + name)) != shape:
            raise CheckpointError(f"{ckpt.path}: {prefix}{name}: shape {tuple(ckpt.shape(prefix + name))}, "
                                  f"the vision_config says {shape}")
        values[name] = mx.array(ckpt.read_float(prefix + name)).astype(dtype)
    values["patch_embed.proj.weight"] = values["patch_embed.proj.weight"].reshape(args.hidden_size, -1)
    return tower_of(args, values)


def tower_of(args: VisionArgs, values: dict[str, mx.array]) -> VisionTower:
    """The tower of its tensors (names after `model.visual.`, the patch embedding flattened)."""
    top = {n: v for n, v in values.items() if not n.startswith("blocks.")}
    blocks = [{n[len(f"blocks.{b}."):]: v for n, v in values.items() if n.startswith(f"blocks.{b}.")}
              for b in range(args.depth)]
    return VisionTower(args, top, blocks)


def load_pack_tower(pack_dir, dtype=mx.float32) -> VisionTower:
    """The tower of a target pack built with it (docs/formats.md 5): its `model.visual.*`
    tensors as stored (the patch embedding already flattened), cast to `dtype`; only the
    shards that hold them are read. The pack is not verified here (engine_setup verifies
    it before anything reads it)."""
    pack_dir = Path(pack_dir)
    manifest = read_manifest(pack_dir)
    config = json.loads((pack_dir / "config.json").read_text())
    args = VisionArgs.from_config(config.get("vision_config") or {}, where=f"{pack_dir}/config.json: vision_config")
    shapes = expected_shapes(args) | {"patch_embed.proj.weight": (args.hidden_size, args.patch_dim)}
    tensors = manifest["tensors"]
    stored = {n[len(VISION_PREFIX):] for n in tensors if n.startswith(VISION_PREFIX)}
    missing, extra = sorted(set(shapes) - stored), sorted(stored - set(shapes))
    if missing or extra:
        raise PackError(f"{pack_dir}: vision tower tensors under {VISION_PREFIX}: missing {missing[:5]}, "
                        f"unexpected {extra[:5]}")
    values = {}
    for shard in sorted({tensors[VISION_PREFIX + n]["shard"] for n in shapes}):
        for name, array in mx.load(str(pack_dir / shard)).items():  # lazy: only the tower's tensors are read
            if name.startswith(VISION_PREFIX):
                values[name[len(VISION_PREFIX):]] = array
    for name, shape in shapes.items():
        if tuple(values[name].shape) != shape:
            raise PackError(f"{pack_dir}: {VISION_PREFIX}{name}: shape {list(values[name].shape)}, "
                            f"the vision_config says {list(shape)}")
        values[name] = values[name].astype(dtype)
    mx.eval(list(values.values()))
    return tower_of(args, values)


def vision_of(path, dtype=mx.float32) -> Vision | None:
    """The `Vision` of a target pack built with its tower, or of a checkpoint directory
    whose config has a vision_config and whose tensors hold the tower; None for a pack
    built --no-vision and for a text-only one. The tower loads on first use (`tower()`),
    in `dtype`."""
    if is_pack(Path(path)):
        pack_dir = Path(path)
        vision = (read_manifest(pack_dir).get("layout") or {}).get("vision")
        if not isinstance(vision, dict) or not vision.get("packed"):
            return None
        config = json.loads((pack_dir / "config.json").read_text())
        return Vision(config, stated_settings(pack_dir), lambda: load_pack_tower(pack_dir, dtype),
                      where=f"{pack_dir}/config.json")
    ckpt = open_checkpoint(path)
    config = ckpt.config
    if not isinstance(config.get("vision_config"), dict):
        return None
    if not any(ckpt.has(p + "pos_embed.weight") for p in VISION_SOURCES):
        return None
    return Vision(config, stated_settings(ckpt.path), lambda: load_vision_tower(ckpt, dtype),
                  where=f"{ckpt.path}/config.json")


def stated_settings(folder) -> ImageSettings | None:
    """The image processor settings a checkpoint or pack states; None when it has no
    processor config (the Vision then takes the tower's own sizes)."""
    folder = Path(folder)
    return read_image_settings(folder) if any((folder / n).is_file() for n in PROCESSOR_FILES) else None
