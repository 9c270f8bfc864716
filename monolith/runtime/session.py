"""A sequence kept between requests: the target's cache, the tokens in it, restore points,
and what a speculative decoder keeps with them (the drafter's context snapshot and the
conversation's fallback state)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

MAX_RESTORE_POINTS = 6  # besides the empty cache; each holds references to the recurrent states


@dataclass(frozen=True)
class _Point:
    length: int  # the session's first `length` tokens are in the cache at this point
    snapshot: object  # the cache's Snapshot there
    logits: mx.array | None  # next-token logits there, when kept (prompt ends)


class Session:
    """A new prompt resumes from the longest restore point it extends exactly; anything
    else starts from the empty cache. Restoring is free: KV rows past the offset are
    ignored and the recurrent states are held by reference."""

    def __init__(self):
        self.cache = None
        self.tokens: list[int] = []
        self._points: list[_Point] = []
        self.draft_snapshot = None  # the drafter's context, in step with the cache
        self.fallback = None  # the speculative decoder's scheduler.Fallback: a conversation that goes on keeps it

    def resume(self, model, prompt: Sequence[int], max_context: int, new_tokens: int = 0):
        """Put the cache at the longest restore point `prompt` extends that leaves at
        least `new_tokens` tokens to prefill; return (cache, cached token count, the
        logits there or None). A point equal to the whole prompt counts only if it
        kept its logits."""
        if self.cache is None or self.cache.max_context != max_context:
            self.cache = model.make_cache(max_context)
            self.tokens, self._points = [], [_Point(0, self.cache.snapshot(), None)]
        best = self._points[0]
        for point in self._points[1:]:
            n = point.length
            if (n > best.length and n <= len(prompt) - new_tokens and (n < len(prompt) or point.logits is not None)
                    and self.tokens[:n] == list(prompt[:n])):
                best = point
        self.cache.restore(best.snapshot)
        self.tokens = list(prompt[:best.length])
        self._points = [p for p in self._points if p.length <= best.length]  # later ones get overwritten
        return self.cache, best.length, best.logits

    def mark(self, tokens: Sequence[int], logits: mx.array | None = None, snapshot=None) -> None:
        """Record a restore point: the cache holds exactly `tokens` (or held them at
        `snapshot`, taken with len(tokens) rows)."""
        tokens = list(tokens)
        if len(tokens) > len(self.tokens):
            self.tokens = tokens
        snap = self.cache.snapshot() if snapshot is None else snapshot
        self._points = [p for p in self._points if p.length != len(tokens)] + [_Point(len(tokens), snap, logits)]
        self._points.sort(key=lambda p: p.length)
        if len(self._points) > MAX_RESTORE_POINTS + 1:  # keep the empty cache and the newest points
            self._points = [self._points[0]] + self._points[-MAX_RESTORE_POINTS:]

    def reset(self) -> None:
        """Forget everything (the next request prefills from scratch)."""
        if self._points:
            self._points = self._points[:1]
        self.tokens = []
        self.draft_snapshot = self.fallback = None

    @property
    def restore_points(self) -> list[int]:
        return [p.length for p in self._points]
