"""The tokens of one terminal chat conversation (monolith/chat.py): what the model saw,
turn by turn, so each prompt extends the cached sequence."""

from __future__ import annotations

import secrets

from .serving.images import prompt_ids as image_prompt_ids


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
        self.images: list = []  # the images in `tokens`, in order (image_inputs.PreparedImage)
        self.turns = 0

    def _head(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def prompt(self, user_text: str, images=()) -> list[int]:
        """The next prompt's ids: the user's text after `images` (which it then holds)."""
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

    def commit(self, prompt: list[int], reply: list[int], images=()) -> None:
        """After a reply (complete or stopped): the prompt and the reply's tokens, without
        the end token (the template's text after a reply supplies it), and the prompt's
        new `images`."""
        self.tokens = list(prompt) + list(reply)
        self.images += list(images)
        self.turns += 1
