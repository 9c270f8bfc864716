"""A prompt's images through the runtime (docs/target.md, "Images through the runtime"):
checked once at the engine's boundary, then

- **keys:** the caches (the session's restore points, the prompt cache, the state files)
  match prompts by their token ids, and every `<|image_pad|>` row has the same id. So
  the runtime runs on a *key* copy of the prompt in which image j's row r holds
  `row_key(digest_j, r)`, a negative int32 drawn from the image's content digest
  (models/image_inputs.PreparedImage.digest) and the row: the same screenshot in a
  later turn matches its saved rows, and another image with the same text around it
  does not. Saved states never lie strictly inside an image (`inside`), so a false
  match needs every row of an image to collide (2^-31 per row);
- **rows:** each prefill chunk gets the real ids, the vision tower's features of the
  image rows it holds and, when it holds any, the multimodal positions of its rows
  (models/mrope.py); the rows after the last image follow the cache's position delta.

The tower runs on the engine's worker thread when a chunk first needs an image, once per
image; `FeatureCache` keeps the features of the latest images, so a prompt that misses
the caches does not run it again for the same screenshot.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ..models.mrope import rope_positions
from .events import RequestError

RECENT_IMAGES = 8  # features FeatureCache keeps


def row_key(digest: str, row: int) -> int:
    """The key id of row `row` of the image with content digest `digest`: in [-2**31, -1]."""
    h = hashlib.blake2b(f"{digest}:{row}".encode(), digest_size=4).digest()
    return -1 - (int.from_bytes(h, "little") & 0x7FFFFFFF)


class FeatureCache:
    """The vision tower's features of the latest images, by content digest (LRU)."""

    def __init__(self, vision, size: int = RECENT_IMAGES):
        self.vision, self.size = vision, size
        self._recent: OrderedDict[str, mx.array] = OrderedDict()
        self.runs = 0  # images the tower ran on

    def features(self, image) -> mx.array:
        found = self._recent.get(image.digest)
        if found is None:
            found = self.vision.features(image)
            mx.eval(found)
            self.runs += 1
            self._recent[image.digest] = found
            while len(self._recent) > self.size:
                self._recent.popitem(last=False)
        self._recent.move_to_end(image.digest)
        return found


class PromptImages:
    """One prompt's images: where they lie, its key ids, and each prefill chunk's extras."""

    def __init__(self, prompt: Sequence[int], images: Sequence, vision, features: FeatureCache):
        self.tokens = list(prompt)
        self.images = tuple(images)
        self._features = features
        pad = vision.image_token_id
        self.spans = image_spans(self.tokens, pad)
        if len(self.spans) != len(self.images):
            raise RequestError("images", f"the prompt has {len(self.spans)} runs of the image token "
                                         f"{pad} for {len(self.images)} images")
        for i, ((start, end), image) in enumerate(zip(self.spans, self.images)):
            if end - start != image.tokens:
                raise RequestError("images", f"image {i} needs {image.tokens} image tokens, its run has "
                                             f"{end - start}")
        self.positions, self.delta = rope_positions(self.tokens, [im.grid_thw for im in self.images], pad,
                                                    vision.merge_size)
        self.key = list(self.tokens)
        for (start, end), image in zip(self.spans, self.images):
            self.key[start:end] = [row_key(image.digest, r) for r in range(end - start)]

    def inside(self, position: int) -> bool:
        """Whether `position` (a row count) lies strictly inside an image."""
        return any(start < position < end for start, end in self.spans)

    def chunk(self, start: int, end: int) -> tuple[tuple | None, np.ndarray | None]:
        """(features, positions) of the prompt's rows [start, end), as models/qwen3_5.Segment
        takes them: None, None for rows without images that need no positions."""
        touched = [(i, s, e) for i, (s, e) in enumerate(self.spans) if s < end and e > start]
        if not touched:
            return None, None
        rows, values = [], []
        for i, s, e in touched:
            lo, hi = max(s, start), min(e, end)
            rows.append(np.arange(lo, hi) - start)
            values.append(self._features.features(self.images[i])[lo - s:hi - s])
        features = (np.concatenate(rows), values[0] if len(values) == 1 else mx.concatenate(values))
        return features, self.positions[:, start:end]


def image_spans(tokens: Sequence[int], pad: int) -> list[tuple[int, int]]:
    """The [start, end) of every run of `pad` in tokens."""
    spans, start = [], None
    for i, t in enumerate(tokens):
        if t == pad and start is None:
            start = i
        elif t != pad and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(tokens)))
    return spans
