"""Image preprocessing for the Qwen3.6 vision tower (docs/target.md, "Image inputs").

An image arrives as encoded bytes (PNG, JPEG, WebP, ...). It is decoded with Pillow,
made RGB (transparency composited onto white), resized so both sides are multiples of
patch_size * merge_size with the pixel count kept within the checkpoint's bounds,
rescaled to 0..1, normalized with the checkpoint's mean and std, and cut into patches
laid out the way the vision tower's patch embedding reads them: one row per spatial
patch, grouped merge_size x merge_size so that each group becomes one image token, each
row holding channel x time x patch x patch values (a still image is repeated in time).

The settings come from the checkpoint's `preprocessor_config.json` (or the
`image_processor` entry of `processor_config.json`); without either, the values
Qwen3.5/3.6 checkpoints publish are used (`ImageSettings()`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

# an aspect ratio beyond this cannot keep its shape at the patch grid's resolution
MAX_ASPECT_RATIO = 200
# decoded pixels a source image may have before it is resized (about 8k x 8k)
MAX_SOURCE_PIXELS = 64 * 1024 * 1024
READABLE = ("PNG", "JPEG", "GIF", "WebP", "BMP", "TIFF")  # the formats clients send (Pillow reads more)
OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")  # a Python object's repr in an error message


class ImageInputError(ValueError):
    """An image the preprocessor cannot take; the message is one line naming why."""


class NotAnImageError(ImageInputError):
    pass


class ImageSizeError(ImageInputError):
    pass


@dataclass(frozen=True)
class ImageSettings:
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 256 * 256
    max_pixels: int = 4096 * 4096
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = int(Image.Resampling.BICUBIC)

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this (32 for patch 16, 28 for patch 14)."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class PreparedImage:
    patches: np.ndarray          # float32 [N, 3 * temporal_patch_size * patch_size**2]
    grid_thw: tuple[int, int, int]  # (1, resized height / patch, resized width / patch)
    tokens: int                  # <|image_pad|> tokens: N / merge_size**2
    size: tuple[int, int]        # resized (height, width)
    digest: str = ""             # SHA-256 of the grid and patches: the prompt cache's key for the image

    @classmethod
    def of(cls, patches: np.ndarray, grid_thw: tuple[int, int, int], merge_size: int,
           size: tuple[int, int]) -> PreparedImage:
        """The image with its token count and content digest computed."""
        patches = np.ascontiguousarray(patches, dtype=np.float32)
        h = hashlib.sha256(np.asarray(grid_thw, dtype="<i8").tobytes())
        h.update(patches.astype("<f4").tobytes())
        t, gh, gw = grid_thw
        return cls(patches, tuple(grid_thw), t * gh * gw // merge_size ** 2, size, h.hexdigest())


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")  # where a checkpoint states them


def read_image_settings(checkpoint_dir) -> ImageSettings:
    """The image processor settings a checkpoint directory states; defaults when it has none."""
    folder = Path(checkpoint_dir)
    flat = folder / "preprocessor_config.json"
    nested = folder / "processor_config.json"
    if flat.is_file():
        raw, where = json.loads(flat.read_text()), flat
    elif nested.is_file():
        raw, where = json.loads(nested.read_text()).get("image_processor", {}), nested
    else:
        return ImageSettings()
    return settings_from_dict(raw, str(where))


def settings_from_dict(raw: dict, where: str = "preprocessor_config.json") -> ImageSettings:
    for flag in ("do_resize", "do_convert_rgb"):
        if raw.get(flag, True) is not True:
            raise ValueError(f"{where}: {flag}={raw[flag]!r} is not supported")
    default = ImageSettings()
    size = raw.get("size") or {}
    # the older top-level min_pixels / max_pixels win over size, as in the processor
    min_pixels = raw.get("min_pixels") or size.get("shortest_edge") or default.min_pixels
    max_pixels = raw.get("max_pixels") or size.get("longest_edge") or default.max_pixels
    settings = ImageSettings(
        patch_size=int(raw.get("patch_size", default.patch_size)),
        merge_size=int(raw.get("merge_size", default.merge_size)),
        temporal_patch_size=int(raw.get("temporal_patch_size", default.temporal_patch_size)),
        min_pixels=int(min_pixels),
        max_pixels=int(max_pixels),
        image_mean=_triple(raw.get("image_mean", default.image_mean)),
        image_std=_triple(raw.get("image_std", default.image_std)),
        rescale_factor=float(raw.get("rescale_factor", default.rescale_factor)),
        do_rescale=bool(raw.get("do_rescale", True)),
        do_normalize=bool(raw.get("do_normalize", True)),
        resample=int(raw.get("resample", default.resample)),
    )
    if min(settings.patch_size, settings.merge_size, settings.temporal_patch_size) < 1 \
            or settings.min_pixels > settings.max_pixels:
        raise ValueError(f"{where}: inconsistent image settings {raw}")
    return settings


def _triple(value) -> tuple[float, ...]:
    values = [value] * 3 if isinstance(value, (int, float)) else list(value)
    if len(values) != 3:
        raise ValueError(f"image mean/std needs 3 channels, got {value!r}")
    return tuple(float(v) for v in values)


def smart_resize(height: int, width: int, settings: ImageSettings) -> tuple[int, int]:
    """The (height, width) an image is resized to: sides multiples of settings.factor, the
    area within min_pixels..max_pixels, the aspect ratio kept as closely as that allows."""
    if height < 1 or width < 1:
        raise ImageSizeError(f"image has zero size ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageSizeError(f"image aspect ratio {width}x{height} exceeds {MAX_ASPECT_RATIO}:1")
    factor = settings.factor
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > settings.max_pixels:
        shrink = math.sqrt(height * width / settings.max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < settings.min_pixels:
        grow = math.sqrt(settings.min_pixels / (height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def decode_image(data: bytes, max_source_pixels: int = MAX_SOURCE_PIXELS) -> Image.Image:
    """Encoded bytes -> an RGB Pillow image (alpha composited onto white)."""
    if not data:
        raise ImageSizeError("image is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > max_source_pixels:
            raise ImageSizeError(f"image is too large ({width}x{height} pixels; "
                                 f"at most {max_source_pixels} before resizing)")
        if width < 1 or height < 1:
            raise ImageSizeError(f"image has zero size ({width}x{height})")
        image.load()
    except Image.DecompressionBombError as e:
        raise ImageSizeError(f"image is too large ({_line(e)})") from None
    except UnidentifiedImageError:  # Pillow's message names its BytesIO object, nothing of use
        raise NotAnImageError(f"not a readable image (its bytes are in no image format this server reads: "
                              f"{', '.join(READABLE)})") from None
    except (OSError, SyntaxError) as e:
        raise NotAnImageError(f"not a readable image ({_line(e)})") from None
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if not has_alpha:
        return image.convert("RGB")
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")


def _line(error: Exception) -> str:
    """An error's message on one line, without the repr of an object (`<_io.BytesIO object at 0x...>`)."""
    return " ".join(OBJECT_REPR.sub("the image", str(error)).split()) or type(error).__name__


def prepare_image(data: bytes, settings: ImageSettings | None = None) -> PreparedImage:
    """Encoded image bytes -> the vision tower's flattened patches, grid and token count."""
    settings = settings or ImageSettings()
    image = decode_image(data)
    height, width = smart_resize(image.height, image.width, settings)
    resized = image.resize((width, height), resample=Image.Resampling(settings.resample))
    pixels = np.asarray(resized).transpose(2, 0, 1)  # (3, H, W) uint8
    if settings.do_rescale:
        # computed in float64 and stored as float32, as the reference processor does
        pixels = (pixels.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    else:
        pixels = pixels.astype(np.float32)
    if settings.do_normalize:
        mean = np.asarray(settings.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(settings.image_std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    patches, grid_h, grid_w = patchify(pixels, settings)
    return PreparedImage.of(patches, (1, grid_h, grid_w), settings.merge_size, (height, width))


def patchify(pixels: np.ndarray, settings: ImageSettings) -> tuple[np.ndarray, int, int]:
    """(C, H, W) float32 -> ([grid_h * grid_w, C * T * ps * ps], grid_h, grid_w).

    Rows run over merge groups in raster order, and within a group over its
    merge_size x merge_size patches in raster order; a row is (channel, time, y, x)."""
    ps, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    channels, height, width = pixels.shape
    grid_h, grid_w = height // ps, width // ps
    blocks = pixels.reshape(channels, grid_h // m, m, ps, grid_w // m, m, ps)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, ps, ps)
    blocks = np.repeat(blocks[:, :, :, :, :, None], t, axis=5)  # time after channel
    return blocks.reshape(grid_h * grid_w, channels * t * ps * ps), grid_h, grid_w
