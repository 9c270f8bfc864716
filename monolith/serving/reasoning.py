"""Qwen's reasoning split: the text of a `<think>...</think>` block goes to
`reasoning_content`, the rest to `content` (as vLLM's qwen3 reasoning parser and
llama.cpp's server do).

A reply is inside the block from its start when the prompt left one open (a template
whose generation prompt ends with `<think>`, as Qwen3.6's does with thinking on), or
when the reply itself opens with `<think>` (leading whitespace allowed); otherwise it has
no reasoning. The tags are dropped, and so is the whitespace right after each of them.
Streaming holds back a piece that could be the start of the tag it waits for, so a tag
split across tokens never leaks into either field. A reply cut off inside the block
(max_tokens) is all reasoning.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """The rendered prompt ends inside a think block: its last <think> comes after its
    last </think>, with nothing but whitespace after it."""
    at = prompt_text.rfind(OPEN)
    return at >= 0 and at > prompt_text.rfind(CLOSE) and not prompt_text[at + len(OPEN):].strip()


class ReasoningSplitter:
    """feed(text) -> (reasoning, content) pieces as they become certain; finish() gives
    what was held back. With `spans` a list, each piece given out is also recorded there
    as (part, start, end): "reasoning" or "content", and where it lies in all the text
    fed (serving/openai/speculation.py cuts how each character came by these)."""

    def __init__(self, open_at_start: bool = False):
        self.state = "reasoning" if open_at_start else "start"
        self.held = ""
        self.at = 0  # where `held` starts in all the text fed
        self.spans: list[tuple[str, int, int]] | None = None
        self.strip_next = open_at_start  # drop the whitespace after a tag
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning, content = [], []
        while self.held:
            if self.strip_next:
                self._drop(len(self.held) - len(self.held.lstrip()))
                if not self.held:
                    break
                self.strip_next = False
            if self.state == "start":
                head = self.held.lstrip()
                if head.startswith(OPEN):
                    self._drop(len(self.held) - len(head) + len(OPEN))
                    self.state, self.strip_next = "reasoning", True
                    continue
                if OPEN.startswith(head):  # maybe the tag, still arriving
                    break
                self.state = "content"
            if self.state == "content":
                self._give(len(self.held), content, "content")
                break
            at = self.held.find(CLOSE)
            if at >= 0:
                self._give(at, reasoning, "reasoning")
                self._drop(len(CLOSE))
                self.state, self.strip_next = "content", True
                continue
            self._give(len(self.held) - _partial_tail(self.held, CLOSE), reasoning, "reasoning")
            break
        return self._out(reasoning, content)

    def finish(self) -> tuple[str, str]:
        reasoning, content = [], []
        if self.state == "reasoning":
            self._give(len(self.held), reasoning, "reasoning")
        elif self.state == "content" or self.held.strip():
            self._give(len(self.held), content, "content")
        self._drop(len(self.held))
        return self._out(reasoning, content)

    def _drop(self, n: int) -> None:
        self.held, self.at = self.held[n:], self.at + n

    def _give(self, n: int, out: list[str], part: str) -> None:
        """Give out the first n characters held as `part`."""
        out.append(self.held[:n])
        if n and self.spans is not None:
            self.spans.append((part, self.at, self.at + n))
        self._drop(n)

    def _out(self, reasoning: list[str], content: list[str]) -> tuple[str, str]:
        r, c = "".join(reasoning), "".join(content)
        if r:
            self.reasoning.append(r)
        if c:
            self.content.append(c)
        return r, c


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
