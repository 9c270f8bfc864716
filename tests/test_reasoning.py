"""The reasoning split (monolith.serving.reasoning): streamed in any pieces it gives what
splitting the whole reply gives, and that is the reference split of vLLM's qwen3 parser
rules (text inside <think>...</think> is reasoning, tags and the whitespace after them
dropped, a block the prompt opened counts from the first character)."""

from __future__ import annotations

import random

import pytest

from monolith.serving.reasoning import ReasoningSplitter, prompt_opens_reasoning

REPLIES = [
    "<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.",
    "  <think>a</think>b",
    "No reasoning here, just <think> in the middle.",
    "<think>\ncut off while thinking",
    "<think></think>",
    "<thin",
    "",
    "\n\n",
    "<think>x</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "after a prompt that opened the block</think>\n\nthe answer </think> stays",
]


def reference(text: str, open_at_start: bool) -> tuple[str, str]:
    if not open_at_start:
        head = text.lstrip()
        if not head.startswith("<think>"):
            return "", text if text.strip() else ""
        text = head[len("<think>"):]
    text = text.lstrip()
    if "</think>" not in text:
        return text, ""
    reasoning, content = text.split("</think>", 1)
    return reasoning, content.lstrip()


def split(pieces, open_at_start):
    splitter = ReasoningSplitter(open_at_start)
    outs = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


@pytest.mark.parametrize("open_at_start", [False, True])
@pytest.mark.parametrize("text", REPLIES)
def test_streamed_in_any_pieces_equals_the_reference(text, open_at_start):
    want = reference(text, open_at_start)
    assert split([text], open_at_start) == want
    assert split(list(text), open_at_start) == want  # a character at a time: tags split everywhere
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert split(pieces, open_at_start) == want


def test_no_piece_of_a_tag_leaks_while_streaming():
    splitter = ReasoningSplitter()
    seen = [splitter.feed(c) for c in "<think>abc</think>def"] + [splitter.finish()]
    assert all("<" not in r and "<" not in c for r, c in seen)
    assert [r for r, _ in seen if r] == ["a", "b", "c"] and "".join(c for _, c in seen) == "def"


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert not prompt_opens_reasoning("user wrote <think> then more words")
