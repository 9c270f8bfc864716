"""Image preprocessing (monolith/models/image_inputs.py) against transformers' Qwen2-VL image
processor, the one Qwen3.5/3.6 checkpoints name (docs/target.md, "Image inputs")."""

import io
import json

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil_processor

from monolith.models.image_inputs import (
    ImageSettings,
    ImageSizeError,
    NotAnImageError,
    decode_image,
    prepare_image,
    read_image_settings,
    settings_from_dict,
)

# Qwen3.6's published preprocessor_config.json, with the pixel bounds made small so that
# the images stay tiny; the second is a Qwen2-VL style one (patch 14, CLIP mean and std)
SMALL_QWEN36 = {
    "size": {"shortest_edge": 64 * 64, "longest_edge": 192 * 160},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
QWEN36 = {**SMALL_QWEN36, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
PATCH14 = {
    "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 40, "patch_size": 14,
    "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def picture(width, height, mode, fmt, seed):
    rng = np.random.default_rng(seed)
    ramp = np.add.outer(np.linspace(0, 200, height), np.linspace(0, 55, width))
    base = np.clip(ramp[..., None] + rng.normal(0, 30, (height, width, 4)), 0, 255).astype(np.uint8)
    image = Image.fromarray(base, "RGBA")
    image = image.convert(mode) if mode != "RGBA" else image
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


CASES = [  # width, height, mode, format
    (37, 23, "RGB", "PNG"),      # tiny: grows to min_pixels
    (101, 67, "RGB", "JPEG"),    # odd sides
    (640, 200, "RGB", "PNG"),    # beyond max_pixels: shrinks
    (90, 130, "RGBA", "PNG"),    # alpha composited onto white
    (75, 51, "L", "JPEG"),       # grayscale
    (3, 1, "LA", "PNG"),         # 1 pixel high, with alpha
]


@pytest.mark.parametrize("config, case", [
    *[(SMALL_QWEN36, case) for case in CASES], *[(PATCH14, case) for case in CASES],
    (QWEN36, CASES[1]),  # the published bounds: grows to 256x256 in area
], ids=[*[f"patch16-{c[0]}x{c[1]}-{c[2]}-{c[3]}" for c in CASES],
        *[f"patch14-{c[0]}x{c[1]}-{c[2]}-{c[3]}" for c in CASES], "published"])
def test_matches_the_transformers_processor(config, case):
    data = picture(*case, seed=case[0])
    ours = prepare_image(data, settings_from_dict(config))
    reference = pil_processor.Qwen2VLImageProcessorPil(
        **{k: v for k, v in config.items() if k != "image_processor_type"})
    theirs = reference(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    grid = tuple(int(x) for x in theirs["image_grid_thw"][0])
    assert ours.grid_thw == grid
    assert ours.size == (grid[1] * config["patch_size"], grid[2] * config["patch_size"])
    assert ours.tokens == grid[0] * grid[1] * grid[2] // 4
    expected = theirs["pixel_values"]
    assert ours.patches.dtype == np.float32 and ours.patches.shape == expected.shape
    np.testing.assert_allclose(ours.patches, expected, rtol=0, atol=1e-6)


def test_settings_come_from_the_checkpoint(tmp_path):
    assert read_image_settings(tmp_path) == ImageSettings() == settings_from_dict(QWEN36)  # no file: Qwen3.6's
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": PATCH14}))
    nested = read_image_settings(tmp_path)
    assert (nested.factor, nested.min_pixels, nested.max_pixels) == (28, 56 * 56, 28 * 28 * 40)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(SMALL_QWEN36))
    flat = read_image_settings(tmp_path)
    assert (flat.factor, flat.min_pixels, flat.max_pixels) == (32, 64 * 64, 192 * 160)


@pytest.mark.parametrize("data, error, words", [
    (b"", ImageSizeError, "empty"),
    (b"GIF89a not really", NotAnImageError, "not a readable image"),
    (b"%PDF-1.7\n", NotAnImageError, "not a readable image"),
])
def test_bad_bytes_are_named(data, error, words):
    with pytest.raises(error, match=words) as caught:
        prepare_image(data)
    assert "\n" not in str(caught.value)


def test_too_many_source_pixels_is_refused():
    data = picture(40, 30, "RGB", "PNG", seed=2)
    assert decode_image(data, max_source_pixels=1200).size == (40, 30)
    with pytest.raises(ImageSizeError, match="too large"):
        decode_image(data, max_source_pixels=1199)


def test_extreme_aspect_ratio_is_refused():
    with pytest.raises(ImageSizeError, match="aspect ratio"):
        prepare_image(picture(402, 2, "RGB", "PNG", seed=1))
    with pytest.raises(ValueError, match="aspect ratio"):  # so does the reference
        pil_processor.smart_resize(2, 402)
