"""Multimodal rotary positions (monolith/models/mrope.py) against transformers' Qwen3_5Model
get_rope_index and Qwen3_5TextRotaryEmbedding (docs/target.md, "Multimodal positions")."""

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from monolith.models.mrope import (
    frequency_streams,
    mrope_angles,
    mrope_section,
    rope_positions,
)

START, PAD, END = 900, 901, 902  # <|vision_start|>, <|image_pad|>, <|vision_end|>


def prompt(*parts):
    """Text parts are lists of token ids; an image part is its grid (t, h, w) in patches."""
    tokens, grids = [], []
    for part in parts:
        if isinstance(part, tuple):
            tokens += [START] + [PAD] * (part[0] * part[1] * part[2] // 4) + [END]
            grids.append(part)
        else:
            tokens += part
    return tokens, grids


def reference_positions(tokens, grids):
    ids = torch.tensor([tokens])
    stub = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)),
        get_vision_position_ids=partial(qwen3_5.Qwen3_5Model.get_vision_position_ids, None))
    positions, delta = qwen3_5.Qwen3_5Model.get_rope_index(
        stub, ids, mm_token_type_ids=(ids == PAD).int(),
        image_grid_thw=torch.tensor(grids) if grids else None)
    return positions[:, 0].numpy(), int(delta[0, 0])


PROMPTS = {
    "text": prompt([1, 2, 3, 4, 5]),
    "one image": prompt([7, 8], (1, 4, 6), [9, 10, 11]),
    "two images": prompt([7], (1, 6, 4), [12, 13], (1, 2, 10), [14]),
    "image right after image": prompt((1, 2, 2), (1, 8, 2), [5]),
}


@pytest.mark.parametrize("name", PROMPTS)
def test_positions_match_get_rope_index(name):
    tokens, grids = PROMPTS[name]
    positions, delta = rope_positions(tokens, grids, PAD)
    expected, expected_delta = reference_positions(tokens, grids)
    np.testing.assert_array_equal(positions, expected)
    assert delta == expected_delta
    if not grids:  # text alone: today's 1-D positions in all three streams
        np.testing.assert_array_equal(positions, np.broadcast_to(np.arange(len(tokens)), (3, len(tokens))))


@pytest.mark.parametrize("name", ["text", "two images"])
def test_angles_match_the_rotary_embedding(name):
    tokens, grids = PROMPTS[name]
    positions, _ = rope_positions(tokens, grids, PAD)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=2, head_dim=256, rope_parameters=rope)
    reference = qwen3_5.Qwen3_5TextRotaryEmbedding(config)
    cos, sin = reference(torch.zeros(1, dtype=torch.float32), torch.tensor(positions)[:, None])
    angles = np.array(mrope_angles(positions, 64, 10000.0, mrope_section(rope)))
    np.testing.assert_allclose(np.cos(np.concatenate([angles, angles], -1)), cos[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(np.sin(np.concatenate([angles, angles], -1)), sin[0].numpy(), atol=1e-6)


def test_each_stream_gets_its_section_of_frequencies():
    for section in [(11, 11, 10), (24, 20, 20), (2, 1, 1)]:
        assert np.bincount(frequency_streams(2 * sum(section), section)).tolist() == list(section)


def test_mismatched_images_are_refused():
    tokens, grids = PROMPTS["one image"]
    with pytest.raises(ValueError, match="needs 8 image tokens, its run has 6"):
        rope_positions(tokens, [(1, 4, 8)], PAD)
    with pytest.raises(ValueError, match="for 1 of 2 images"):
        rope_positions(tokens, grids * 2, PAD)
    with pytest.raises(ValueError, match="more image token runs than the 0 images"):
        rope_positions(tokens, [], PAD)
    with pytest.raises(ValueError, match="not supported"):
        mrope_section({"mrope_interleaved": False})
