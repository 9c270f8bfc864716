"""The tokens of one terminal chat conversation (monolith/chat.py): what the model saw,
turn by turn, so each prompt extends the cached sequence."""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass

from .models.image_inputs import PreparedImage, prepare_image
from .runtime.images import PromptImages
from .serving.images import prompt_ids as image_prompt_ids


@dataclass(frozen=True)
class Attachment:
    """An image of a message: prepared for the model, and its file's bytes (kept for /save)."""

    image: PreparedImage
    data: bytes

    @classmethod
    def of(cls, data: bytes, vision) -> Attachment:
        return cls(prepare_image(data, vision.settings), data)


class Conversation:
    """The tokens of one conversation as the model saw them. The first turn renders the
    chat template; later turns append the template's text between an assistant reply
    and the next generation prompt to the exact tokens so far, so every prompt extends
    the cached sequence and only the new turn is prefilled."""

    def __init__(self, tokenizer, system: str | None = None, template_kwargs: dict | None = None, vision=None):
        self.tokenizer = tokenizer
        self.system = system
        self.template_kwargs = template_kwargs or {}
        self.vision = vision  # the engine's models.vision.Vision, for messages with images
        self.tokens: list[int] = []
        self.attachments: list[Attachment] = []  # the images in `tokens`, in order
        self.turns = 0

    @property
    def images(self) -> list[PreparedImage]:
        return [a.image for a in self.attachments]

    def key(self) -> list[int]:
        """The tokens as the engine's caches hold them (runtime/images.py: image rows keyed
        by their content)."""
        if not self.attachments:
            return list(self.tokens)
        return PromptImages(self.tokens, self.images, self.vision, None).key

    def saved(self) -> list[str]:
        """The images' files, base64, as /save keeps them."""
        return [base64.b64encode(a.data).decode() for a in self.attachments]

    def restore(self, tokens: list[int], saved: list[str]) -> None:
        """Hold `tokens` and the images /save kept (ValueError when they do not fit)."""
        if saved and self.vision is None:
            raise ValueError("the conversation holds images and this model takes none")
        self.tokens = [int(t) for t in tokens]
        self.attachments = [Attachment.of(base64.b64decode(s, validate=True), self.vision) for s in saved]

    def _head(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def prompt(self, user_text: str, attachments=()) -> list[int]:
        """The next prompt's ids: the user's text after the `attachments`' images."""
        images = [a.image for a in attachments]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": user_text}]
        user = {"role": "user", "content": content if images else user_text}
        if not self.tokens:
            text = self.tokenizer.apply_chat_template(self._head() + [user], **self.template_kwargs)
            return image_prompt_ids(self.tokenizer, text, list(images), self.vision)
        sentinel = "\x00reply-" + secrets.token_hex(8)
        text = self.tokenizer.apply_chat_template(
            self._head() + [{"role": "user", "content": "."}, {"role": "assistant", "content": sentinel}, user],
            **self.template_kwargs)
        suffix = text[text.index(sentinel) + len(sentinel):]
        return self.tokens + image_prompt_ids(self.tokenizer, suffix, list(images), self.vision)

    def commit(self, prompt: list[int], reply: list[int], attachments=()) -> None:
        """After a reply (complete or stopped): the prompt and the reply's tokens, without
        the end token (the template's text after a reply supplies it), and the prompt's
        new `attachments`."""
        self.tokens = list(prompt) + list(reply)
        self.attachments += list(attachments)
        self.turns += 1
