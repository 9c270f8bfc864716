"""Multimodal rotary positions of Qwen3.5/3.6 (docs/target.md, "Multimodal positions").

Every prompt row has three positions: temporal, height and width. A text row has the same
value in all three, counting on from the row before. The `<|image_pad|>` rows of one image
(grid (t, h, w) patches, merged merge_size x merge_size into one row each) sit on a grid
that starts at the current position p: row (i, j) of the merged grid gets (p, p + i, p + j).
The text after the image continues at p + max(h, w) / merge_size, one past the largest
position the image used, so a prompt with images ends at a position smaller than its
length; that difference (`delta`) is added to every later row's index.

The rotary frequencies are shared out among the three streams: with the interleaved layout
(`mrope_interleaved`), frequency slot j takes the height position when j % 3 == 1 and
j < 3 * section[1], the width position when j % 3 == 2 and j < 3 * section[2], and the
temporal one otherwise. For text all three agree, which is plain 1-D RoPE.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

DEFAULT_SECTION = (11, 11, 10)  # what transformers assumes when the config names none


def mrope_section(rope_parameters: dict) -> tuple[int, int, int]:
    """The (temporal, height, width) frequency counts a text config's rope_parameters give."""
    if rope_parameters.get("mrope_interleaved", True) is not True:
        raise ValueError("rope_parameters: mrope_interleaved false (the sectioned layout "
                         "of Qwen2-VL) is not supported")
    section = tuple(int(n) for n in rope_parameters.get("mrope_section", DEFAULT_SECTION))
    if len(section) != 3 or min(section) < 0:
        raise ValueError(f"rope_parameters: mrope_section must be 3 counts, got {section}")
    return section


def image_positions(start: int, grid_thw, merge_size: int) -> np.ndarray:
    """[3, t * h * w / merge_size**2] positions of one image's rows, its grid starting at start."""
    t, h, w = (int(grid_thw[0]), int(grid_thw[1]) // merge_size, int(grid_thw[2]) // merge_size)
    temporal, height, width = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([temporal, height, width]).reshape(3, -1).astype(np.int64) + start


def rope_positions(tokens, image_grids, image_token_id: int,
                   merge_size: int = 2) -> tuple[np.ndarray, int]:
    """([3, len(tokens)] positions, delta) for a prompt whose runs of image_token_id are the
    images of image_grids (t, h, w in patches), in order. delta = last position + 1 -
    len(tokens): a row at index i after the prompt sits at position i + delta in all three."""
    tokens = np.asarray(tokens)
    grids = [tuple(int(x) for x in g) for g in image_grids]
    is_image = tokens == image_token_id
    pieces, position, row, used = [], 0, 0, 0
    while row < len(tokens):
        end = row
        while end < len(tokens) and is_image[end] == is_image[row]:
            end += 1
        if not is_image[row]:
            pieces.append(np.broadcast_to(np.arange(position, position + end - row), (3, end - row)))
            position += end - row
        else:  # one image per run, as in transformers (<|vision_end|> separates images)
            if used == len(grids):
                raise ValueError(f"the prompt has more image token runs than the {len(grids)} images")
            t, h, w = grids[used]
            if end - row != t * h * w // merge_size ** 2:
                raise ValueError(f"image {used} needs {t * h * w // merge_size ** 2} image tokens, "
                                 f"its run has {end - row}")
            pieces.append(image_positions(position, grids[used], merge_size))
            position += max(h, w) // merge_size
            used += 1
        row = end
    if used != len(grids):
        raise ValueError(f"the prompt has image tokens for {used} of {len(grids)} images")
    positions = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), np.int64)
    last = int(positions.max()) + 1 if positions.size else 0
    return positions.astype(np.int64), last - len(tokens)


def frequency_streams(rotary_dim: int, section=DEFAULT_SECTION) -> np.ndarray:
    """[rotary_dim / 2] the stream (0 temporal, 1 height, 2 width) each frequency slot reads."""
    slots = np.arange(rotary_dim // 2)
    streams = np.zeros(rotary_dim // 2, dtype=np.int64)
    streams[(slots % 3 == 1) & (slots < 3 * section[1])] = 1
    streams[(slots % 3 == 2) & (slots < 3 * section[2])] = 2
    return streams


def mrope_angles(positions: np.ndarray, rotary_dim: int, theta: float,
                 section=DEFAULT_SECTION) -> mx.array:
    """[T, rotary_dim / 2] float32 rotary angles for [3, T] positions: slot j turns by
    positions[stream j] * theta ** (-2j / rotary_dim). cos and sin of these, repeated over
    the two halves of the rotary dims, are what plain RoPE uses at 1-D positions."""
    inverse = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim))
    chosen = np.asarray(positions)[frequency_streams(rotary_dim, section)]  # [half, T]
    return mx.array(chosen.T.astype(np.float32)) * mx.array(inverse.astype(np.float32))
