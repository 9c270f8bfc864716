"""Prompts with images for the vision tests, and transformers' run of them (the reference):
Qwen3_5ForConditionalGeneration / the MoE class fed the same input_ids, pixel_values and
image_grid_thw (tests/hf_reference.py builds it from a synthetic checkpoint)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from monolith.models.image_inputs import ImageSettings, prepare_image

NEW_TOKENS = 4


def png(seed: int, size: tuple[int, int] = (20, 36)) -> bytes:
    """A PNG of random pixels, `size` (height, width)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def image_prompt(config: dict, patch_size: int, seed: int = 3, text_seed: int = 4):
    """(token ids, prepared image): text, <|vision_start|>, the image's pads, <|vision_end|>,
    text (the image: 20 x 36 random pixels)."""
    image = prepare_image(png(seed), ImageSettings(patch_size=patch_size, min_pixels=64, max_pixels=64 * 64))
    text = [int(t) for t in np.random.default_rng(text_seed).integers(0, config["vision_start_token_id"], 9)]
    tokens = (text[:5] + [config["vision_start_token_id"]] + [config["image_token_id"]] * image.tokens
              + [config["vision_end_token_id"]] + text[5:])
    return tokens, image


@torch.no_grad()
def reference_run(ckpt, tokens, image, pad, new_tokens: int = NEW_TOKENS):
    """(prompt logits [T, V], greedy tokens, their step logits [new_tokens, V]) of transformers."""
    from hf_reference import build_vlm_reference

    model = build_vlm_reference(ckpt)
    ids = torch.tensor([tokens])
    inputs = {"input_ids": ids, "pixel_values": torch.from_numpy(image.patches),
              "image_grid_thw": torch.tensor([image.grid_thw]), "mm_token_type_ids": (ids == pad).int()}
    logits = model(**inputs, use_cache=False).logits[0].numpy()
    out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    steps = np.stack([step[0].numpy() for step in out.logits])
    return logits, out.sequences[0, len(tokens):].tolist(), steps
