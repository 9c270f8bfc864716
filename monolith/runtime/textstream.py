"""Generated tokens -> the text a client may see (UTF-8 safe, stop strings held back)."""

from __future__ import annotations

from collections.abc import Sequence

from ..tokenizer import IncrementalDetokenizer
from .events import PLAIN, Delta, TokenLogprob, merge_pieces


class TextStream:
    """Generated tokens -> released text: whole UTF-8 characters only, never text that
    could be the start of a stop string; ends before the first stop string. Logprobs
    travel with the text of their tokens (a token's entry is released with the text
    from where its own text starts), and so does how each token came (`Delta.spec`:
    the released text cut where each token's text starts; a character split over
    tokens goes with the token that completes it)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.stopped = False  # a stop string was found
        self.text = ""  # released so far
        self._held = ""
        self._decoded = 0  # characters decoded so far (released + held)
        self._logprobs: list[tuple[int, TokenLogprob]] = []  # (start offset, entry), not yet released
        self._kinds: list[tuple[int, str]] = []  # (start offset, how) of tokens whose text is not all released

    def add(self, token_id: int, logprob: TokenLogprob | None = None, how: str = PLAIN) -> Delta | None:
        """Take the next token (`how`: how it came, events.ACCEPTED etc.)."""
        if self.stopped:
            return None
        if logprob is not None:
            self._logprobs.append((self._decoded, logprob))
        self._kinds.append((self._decoded, how))
        piece = self.detok.add(token_id)
        self._decoded += len(piece)
        self._held += piece
        return self._release(final=False)

    def finish(self) -> Delta | None:
        """The text still held back, once no more tokens come."""
        if not self.stopped:
            piece = self.detok.flush()
            self._decoded += len(piece)
            self._held += piece
        return self._release(final=True)

    def _release(self, final: bool) -> Delta | None:
        held = self._held
        hits = [i for i in (held.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self._held, self.stopped = held[:min(hits)], "", True
        else:
            keep = 0 if final else _stop_prefix_length(held, self.stop)
            out, self._held = held[:len(held) - keep], held[len(held) - keep:]
        start = len(self.text)
        self.text += out
        end = len(self.text)
        spec = self._pieces(start, end)
        if final or self.stopped:
            ready = [lp for start, lp in self._logprobs if start < end or (final and not self.stopped)]
            self._logprobs = []
        else:
            ready = [lp for start, lp in self._logprobs if start < end]
            self._logprobs = [(s, lp) for s, lp in self._logprobs if s >= end]
        if not out and not ready:
            return None
        return Delta(out, tuple(ready), spec)

    def _pieces(self, start: int, end: int) -> tuple[tuple[str, str], ...]:
        """The (text, how) pieces of the released text [start, end); forgets the tokens
        whose text is all released."""
        kinds = self._kinds
        ends = [at for at, _ in kinds[1:]] + [self._decoded]
        pieces = [(self.text[max(at, start):min(until, end)], how) for (at, how), until in zip(kinds, ends)]
        # kept: the tokens whose text is not all released, or has not come yet (the last ones)
        self._kinds = [] if self.stopped else [k for k, until in zip(kinds, ends) if until > end or k[0] == until]
        return merge_pieces(pieces)


def _stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
