"""The terminal chat run in-process for the chat tests: a `Chat` on given input lines."""

from __future__ import annotations

import argparse
import io

from monolith.chat import Chat


def chat_args(max_tokens=8):
    return argparse.Namespace(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, max_tokens=max_tokens,
                              no_thinking=False, system="Be brief.")


def run_chat(engine, lines, out=None, max_tokens=8):
    """Run a Chat on `lines` (then end of input), writing to `out` (default a StringIO);
    (the chat, what it wrote)."""
    out, pending = out or io.StringIO(), list(lines)

    def read(prompt):
        if not pending:
            raise EOFError
        return pending.pop(0)

    chat = Chat(engine, chat_args(max_tokens), "tiny", out)
    chat.run(read)
    return chat, out.getvalue()
