"""Image parts on every API (docs/serving.md, "Images"): one home for what the three
APIs share once each has read its own part shape (requests.py: OpenAI `image_url`;
anthropic/requests.py: `image` blocks; responses/items.py: `input_image`).

A part becomes an item of its message's list `content`, `{"type": "image", "image": URL,
"param": where}` (`image_item`), which the checkpoint's chat template renders as
`<|vision_start|><|image_pad|><|vision_end|>` (IMAGE_MARK). A message without images
keeps a string content, as before (`message_content`).

On the worker thread that renders the prompt, `ImageLoader` loads each image of the
messages (a `data:` URL decoded; an http(s) URL fetched only with --allow-image-urls),
checks the limits (`ImageLimits`) and prepares it for the vision tower
(models/image_inputs.py), or, for token counting, only decodes it to learn its size.
`prompt_ids` then encodes the rendered text with each IMAGE_MARK replaced by the image's
ids: vision_start, `image.tokens` x image_token_id, vision_end (what the Qwen processor
expands `<|image_pad|>` to). Every failure is a 400 naming the part.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from ..models.image_inputs import (
    ImageInputError,
    decode_image,
    prepare_image,
    smart_resize,
)
from .errors import bad
from .fields import refuse_extra

IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGES = 32
RECENT_BYTES = 256 * 2**20  # patches of the latest prepared images the server keeps (RecentImages)
FETCH_TIMEOUT = 10.0
FETCH_CHUNK = 2**16
URL_SCHEMES = ("data", "http", "https")
VIDEO_PARTS = ("video_url", "video", "input_video")  # parts some APIs or servers take: refused by name
NO_IMAGES = ("this model takes no images (its checkpoint has no vision tower, or the server was started with "
             "--no-vision)")


@dataclass(frozen=True)
class ImageLimits:
    """What a request's images may be (serve flags: --max-image-bytes, --max-images,
    --allow-image-urls)."""

    max_bytes: int = MAX_IMAGE_BYTES  # encoded bytes of one image
    max_images: int = MAX_IMAGES  # images in one request's conversation
    allow_urls: bool = False  # fetch http(s) image URLs (a local server should not fetch for a web page)
    fetch_timeout: float = FETCH_TIMEOUT  # seconds one fetch may take


class ImageItem(dict):
    """An image part as made here: {"type": "image", "image": URL, "param": where}. Its own
    type tells it from anything a client sent (another API's request re-read as a chat
    request keeps it: requests.py)."""


class CountedImage(NamedTuple):
    """An image as token counting needs it: its <|image_pad|> tokens."""

    tokens: int


# ------------------------------------------------------------------ parsing (each API's parser)


def image_item(url, where: str) -> dict:
    """An image part's URL as the message content item the chat template renders (`where`:
    the part, which every error about the image names). Only its shape is checked here;
    `ImageLoader` loads it."""
    if not isinstance(url, str) or not url:
        raise bad(f"{where}: the image URL must be a non-empty string (a data: URL, or http(s) with "
                  "--allow-image-urls)", where)
    if url.split(":", 1)[0].lower() not in URL_SCHEMES or ":" not in url:
        raise bad(f"{where}: the image URL must be a data: URL (or http(s) with --allow-image-urls), got "
                  f"{url[:40]!r}", where)
    return ImageItem(type="image", image=url, param=where)


def refuse_video(kind: str, where: str):
    raise bad(f"{where}: video input ({kind!r} parts) is not supported; send images", where)


def message_content(items: list) -> str | list[dict]:
    """A message's content from its parts in order (strings of text, `image_item`s): a
    string when it has no image, else a list with adjacent texts joined."""
    if all(isinstance(item, str) for item in items):
        return "".join(items)
    out: list[dict] = []
    for item in items:
        if not isinstance(item, str):
            out.append(item)
        elif out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + item}
        elif item:
            out.append({"type": "text", "text": item})
    return out


def chat_image(part, role: str, where: str) -> dict:
    """A chat message's content part that is not text: an `image_url` part, or an image
    item another API's parser made (anthropic/requests.py re-reads its request as a chat request)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if isinstance(part, ImageItem):
        return part
    if kind in VIDEO_PARTS:
        refuse_video(kind, where)
    if kind != "image_url":
        raise bad(f"{where}: only text and image_url content parts are supported, got {kind!r}", where)
    return openai_image(part, role, where)


def openai_image(part: dict, role: str, where: str) -> dict:
    """An OpenAI chat `image_url` part ({"url", "detail"}; `detail` is a hint this
    model has no switch for: accepted) or a Responses `input_image` part (`image_url` a
    string; `file_id` is refused: this server has no files API)."""
    check_role(role, where)
    if part["type"] == "input_image":
        refuse_extra(part, {"type", "image_url", "file_id", "detail"}, where)
        if part.get("file_id") is not None:
            raise bad(f"{where}.file_id: this server has no files API; send the image as image_url (a data: URL)",
                      where)
        return image_item(part.get("image_url"), where)
    refuse_extra(part, {"type", "image_url"}, where)
    value = part.get("image_url")
    if isinstance(value, dict):
        refuse_extra(value, {"url", "detail"}, f"{where}.image_url")
        value = value.get("url")
    return image_item(value, where)


def anthropic_image(block: dict, where: str) -> dict:
    """An Anthropic `image` block: source {"type": "base64", "media_type", "data"} or
    {"type": "url", "url"}."""
    refuse_extra(block, {"type", "source", "cache_control"}, where)
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        refuse_extra(source, {"type", "media_type", "data"}, f"{where}.source")
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise bad(f"{where}.source: a base64 source needs media_type and data strings", f"{where}.source")
        return image_item(f"data:{media};base64,{data}", where)
    if kind == "url":
        refuse_extra(source, {"type", "url"}, f"{where}.source")
        return image_item(source.get("url"), where)
    raise bad(f"{where}.source must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
              f"{{\"type\": \"url\", \"url\"}} (file sources need a files API this server has not)",
              f"{where}.source")


def check_role(role: str, where: str) -> None:
    if role not in ("user", "tool"):
        raise bad(f"{where}: images are taken in user messages and tool results only, not in {role} messages",
                  where)


def images_in(messages: list[dict]) -> list[dict]:
    """The image items of `messages`, in order."""
    return [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]


# ------------------------------------------------------------------ loading (a worker thread)


class RecentImages:
    """The server's latest prepared images by the SHA-256 of their encoded bytes (LRU, at
    most `budget` bytes of patches): agents resend every screenshot of the conversation
    on every turn, and preparing one (decode, resize, patchify) takes tens of ms. Shared
    by the worker threads that render prompts."""

    def __init__(self, budget: int = RECENT_BYTES):
        self.budget = budget
        self._images: OrderedDict[str, object] = OrderedDict()
        self._bytes = 0  # of the patches kept
        self._lock = threading.Lock()

    def prepared(self, data: bytes, settings):
        """prepare_image(data, settings), or the image prepared from the same bytes before
        (a server's settings never change)."""
        key = hashlib.sha256(data).hexdigest()
        with self._lock:
            found = self._images.get(key)
            if found is not None:
                self._images.move_to_end(key)
                return found
        image = prepare_image(data, settings)
        with self._lock:
            if key not in self._images and image.patches.nbytes <= self.budget:
                self._images[key] = image
                self._bytes += image.patches.nbytes
            while self._bytes > self.budget:
                self._bytes -= self._images.popitem(last=False)[1].patches.nbytes
        return image


class ImageLoader:
    """The images of one request, each source loaded once (a request's conversation and
    its context edits share them). `vision`: the engine's models.vision.Vision (None: the
    model takes no images); `count_only`: learn only each image's token count; `recent`:
    the server's RecentImages."""

    def __init__(self, vision, limits: ImageLimits, count_only: bool = False, recent: RecentImages | None = None):
        self.vision, self.limits, self.count_only = vision, limits, count_only
        self.recent = recent or RecentImages(0)
        self._loaded: dict[str, object] = {}

    def of(self, messages: list[dict]) -> list:
        """The images of `messages` in order: models.image_inputs.PreparedImage (or
        CountedImage when count_only)."""
        items = images_in(messages)
        if items and self.vision is None:
            raise bad(f"{items[0]['param']}: {NO_IMAGES}", items[0]["param"])
        if len(items) > self.limits.max_images:
            at = items[self.limits.max_images]["param"]
            raise bad(f"{at}: a request may hold at most {self.limits.max_images} images; this one holds "
                      f"{len(items)}", at)
        return [self._load(item["image"], item["param"]) for item in items]

    def _load(self, url: str, where: str):
        if url not in self._loaded:
            data = self._bytes(url, where)
            try:
                self._loaded[url] = (self._count(data) if self.count_only
                                     else self.recent.prepared(data, self.vision.settings))
            except ImageInputError as e:
                raise bad(f"{where}: {e}", where) from None
        return self._loaded[url]

    def _count(self, data: bytes) -> CountedImage:
        image = decode_image(data)
        height, width = smart_resize(image.height, image.width, self.vision.settings)
        patch = self.vision.settings.patch_size * self.vision.settings.merge_size
        return CountedImage(height * width // patch ** 2)

    def _bytes(self, url: str, where: str) -> bytes:
        if url[:5].lower() == "data:":
            return data_url_bytes(url, self.limits.max_bytes, where)
        if not self.limits.allow_urls:
            raise bad(f"{where}: image URLs are not fetched by this server (it was not started with "
                      "--allow-image-urls); send the image as a data: URL", where)
        return fetch(url, self.limits, where)


def data_url_bytes(url: str, max_bytes: int, where: str) -> bytes:
    """The bytes of a data: URL holding an image (`data:image/png;base64,...`)."""
    head, comma, payload = url.partition(",")
    if not comma:
        raise bad(f"{where}: malformed data: URL (no comma before the data)", where)
    params = head[5:].split(";")
    media = params[0].strip().lower()
    if media.startswith("video/"):  # other media types are left to the decoder: the bytes say what they are
        raise bad(f"{where}: the data: URL holds {media!r}: video input is not supported; send images", where)
    encoded = "base64" in (p.strip().lower() for p in params[1:])
    if encoded:
        payload = "".join(payload.split())  # line-wrapped base64 (some clients wrap it)
    size = len(payload) * 3 // 4 if encoded else len(payload)
    if size > max_bytes:
        raise _too_large(size, max_bytes, where, "about")
    try:
        data = base64.b64decode(payload, validate=True) if encoded else urllib.parse.unquote_to_bytes(payload)
    except (binascii.Error, ValueError):
        raise bad(f"{where}: the data: URL's base64 data is malformed", where) from None
    if len(data) > max_bytes:
        raise _too_large(len(data), max_bytes, where)
    return data


def fetch(url: str, limits: ImageLimits, where: str) -> bytes:
    """An http(s) image URL's body, within the time (all of it, not each read) and byte limits."""
    deadline = time.monotonic() + limits.fetch_timeout
    chunks, size = [], 0
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "monolith"}),
                                    timeout=limits.fetch_timeout) as response:
            while chunk := response.read(FETCH_CHUNK):
                chunks.append(chunk)
                size += len(chunk)
                if size > limits.max_bytes:
                    raise _too_large(size, limits.max_bytes, where, "over")
                if time.monotonic() > deadline:
                    raise bad(f"{where}: the image URL took over {limits.fetch_timeout:g} s to fetch", where)
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise bad(f"{where}: the image URL could not be fetched: {reason}", where) from None
    return b"".join(chunks)


def _too_large(size: int, limit: int, where: str, about: str = "") -> Exception:
    return bad(f"{where}: the image is {about + ' ' if about else ''}{size} bytes; at most {limit} bytes an image "
               "(--max-image-bytes)", where)


# ------------------------------------------------------------------ prompt ids


def prompt_ids(tokenizer, text: str, images: list, vision) -> list[int]:
    """The ids of a rendered prompt: its text encoded, each IMAGE_MARK (one per image, in
    order) as vision_start, `image.tokens` x image_token_id, vision_end. Without a vision,
    the text is encoded as it is."""
    if vision is None:
        return tokenizer.encode_prompt(text)
    pieces = text.split(IMAGE_MARK)
    if len(pieces) - 1 != len(images):
        raise bad(f"the chat template rendered {len(pieces) - 1} images, but the messages hold {len(images)} "
                  f"(is {IMAGE_MARK} in a text part?)", "messages")
    ids = tokenizer.encode_prompt(pieces[0])
    for image, piece in zip(images, pieces[1:]):
        ids += [vision.vision_start_id] + [vision.image_token_id] * image.tokens + [vision.vision_end_id]
        ids += tokenizer.encode_prompt(piece)
    if ids.count(vision.image_token_id) != sum(image.tokens for image in images):
        raise bad("the text holds <|image_pad|> tokens outside image parts", "messages")
    return ids
