"""A sequence kept between requests: the target's cache, the tokens in it, restore points,
and what a speculative decoder keeps with them (the drafter's context snapshot and the
conversation's fallback state); with a prompt cache (prompt_cache.py), the saved
states of every earlier sequence too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..models.cache import Snapshot
from .prompt_cache import PromptCache, common_prefix, put_rows, row_layers

MAX_RESTORE_POINTS = 6  # besides the empty cache; each holds references to the recurrent states


@dataclass(frozen=True)
class _Point:
    length: int  # the session's first `length` tokens are in the cache at this point
    snapshot: object  # the cache's Snapshot there


class Session:
    """A new prompt resumes from the longest restore point it extends exactly, or from a
    deeper saved state of the prompt cache (loaded into the live cache); anything else
    starts from the empty cache. Either way at least one prompt token is left to
    prefill: its logits start the reply. Restoring a point is free: KV rows past the
    offset are ignored and the recurrent states are held by reference."""

    def __init__(self, prompt_cache: PromptCache | None = None):
        self.cache = None
        self.tokens: list[int] = []
        self._points: list[_Point] = []
        self.draft_snapshot = None  # the drafter's context, in step with the cache
        self.fallback = None  # the speculative decoder's fallback.Fallback: a conversation that goes on keeps it
        self.prompt_cache = prompt_cache

    def resume(self, model, prompt: Sequence[int], max_context: int, drafter=None):
        """Put the cache at the longest restore point `prompt` extends that leaves at
        least one token to prefill, or at a deeper saved state of the prompt cache; return
        (cache, cached token count). With a `drafter` (a speculative decoder's), a
        saved state also fills the drafter's context, session.draft_snapshot."""
        if self.cache is None or self.cache.max_context != max_context:
            self.cache = model.make_cache(max_context)
            self.tokens, self._points = [], [_Point(0, self.cache.snapshot())]
            self.draft_snapshot = None
        prompt = list(prompt)
        best = self._points[0]
        for point in self._points[1:]:
            n = point.length
            if best.length < n < len(prompt) and self.tokens[:n] == prompt[:n]:
                best = point
        stored = self._saved_state_for(prompt, best.length, drafter, max_context)
        if stored is not None:
            return self.cache, stored
        self.cache.restore(best.snapshot)
        self._count(best.length)
        self.tokens = prompt[:best.length]
        self._points = [p for p in self._points if p.length <= best.length]  # later ones get overwritten
        return self.cache, best.length

    def _saved_state_for(self, prompt: list[int], live: int, drafter, max_context: int) -> int | None:
        """Load the prompt cache's deepest saved state of `prompt` if it lies past `live`
        tokens (the live cache's best point); its length, or None."""
        cache = self.prompt_cache
        if cache is None or not cache.budget:
            return None
        draft = None
        if drafter is not None:
            draft = self.draft_snapshot
            if draft is None or draft.max_context != max_context:
                drafter.start(max_context)
                draft = drafter.snapshot()
            if draft is None:  # this drafter cannot resume: nothing to load its context into
                return None
        node = cache.lookup(prompt, len(prompt) - 1, self.cache, draft)
        if node is None or node.end <= live:
            return None
        held = common_prefix(self.tokens, prompt, node.end)
        draft_held = 0 if draft is None or draft is not self.draft_snapshot else min(held, draft.offset)
        cache.load(node, self.cache, draft, held, draft_held)
        if held < len(self.tokens):  # another sequence's saved state: the drafting state was the live one's
            self.fallback = None
        self.tokens = prompt[:node.end]
        self._points = [p for p in self._points if p.length <= held]
        self._points.append(_Point(node.end, node.state))
        self.draft_snapshot = draft
        self._count(node.end)
        return node.end

    def _count(self, cached: int) -> None:
        if self.prompt_cache is not None:
            stats = self.prompt_cache.stats
            if cached:
                stats.hits += 1
            else:
                stats.misses += 1

    def save_state(self, tokens: Sequence[int], snapshot=None, draft=None) -> None:
        """Keep the cache's state after `tokens` in the prompt cache (if any): the cache
        holds their rows and is at len(tokens) rows (or was, at `snapshot`); `draft` is
        the drafter's context holding them too, when the engine drafts."""
        if self.prompt_cache is None:
            return
        state = self.cache.snapshot() if snapshot is None else snapshot
        self.prompt_cache.insert(list(tokens), self.cache, state, draft)

    def stops(self, start: int, end: int, boundaries: Sequence[int] = ()) -> list[int]:
        """Where prefilling rows [start, end) saves states: one token before the end
        (the same prompt again resumes there) and the end, and with a prompt cache its
        interval's multiples and the message `boundaries` in between."""
        if self.prompt_cache is None or not self.prompt_cache.budget:
            return [s for s in (end - 1, end) if s > start]
        return self.prompt_cache.stops(start, end, boundaries)

    def mark(self, tokens: Sequence[int], snapshot=None) -> None:
        """Record a restore point: the cache holds exactly `tokens` (or held them at
        `snapshot`, taken with len(tokens) rows)."""
        tokens = list(tokens)
        if len(tokens) > len(self.tokens):
            self.tokens = tokens
        snap = self.cache.snapshot() if snapshot is None else snapshot
        self._points = [p for p in self._points if p.length != len(tokens)] + [_Point(len(tokens), snap)]
        self._points.sort(key=lambda p: p.length)
        if len(self._points) > MAX_RESTORE_POINTS + 1:  # keep the empty cache and the newest points
            self._points = [self._points[0]] + self._points[-MAX_RESTORE_POINTS:]

    def export(self, tokens: Sequence[int], drafting: bool = False) -> tuple[int, list, Snapshot]:
        """The state after the longest restore point `tokens` extends: (its length n,
        copies of the KV rows [0, n) per row layer (the draft context's too, `drafting`),
        the GDN snapshot there). ValueError if the session holds none."""
        tokens = list(tokens)
        held = [p for p in self._points if 0 < p.length <= len(tokens) and self.tokens[:p.length] == tokens[:p.length]]
        draft = self.draft_snapshot if drafting else None
        if drafting:
            held = [p for p in held if draft is not None and draft.offset >= p.length]
        if not held:
            raise ValueError("the session does not hold this conversation's state")
        point = max(held, key=lambda p: p.length)
        rows = [layer.rows(0, point.length) for layer in row_layers(self.cache, draft)]
        mx.eval([a for pair in rows for a in pair])
        return point.length, rows, point.snapshot

    def adopt(self, model, max_context: int, tokens: Sequence[int], rows: list, snapshot: Snapshot,
              drafter=None) -> None:
        """Hold exactly `tokens`, from an exported state (rows per row layer, the draft's
        after the target's with a `drafter`, and the GDN snapshot after them)."""
        if len(tokens) + 1 > max_context:
            raise ValueError(f"the saved state holds {len(tokens)} tokens; the context is {max_context}")
        self.cache = model.make_cache(max_context)
        empty = self.cache.snapshot()
        draft = None
        if drafter is not None:
            drafter.start(max_context)
            draft = drafter.snapshot()
            if draft is None:
                raise ValueError("this drafter cannot resume a saved state")
        put_rows(self.cache, draft, [(0, rows)])
        self.cache.adopt(snapshot)
        if draft is not None:
            draft.adopt(len(tokens))
        self.tokens = list(tokens)
        self._points = [_Point(0, empty), _Point(len(tokens), snapshot)]
        self.draft_snapshot, self.fallback = draft, None

    def reset(self) -> None:
        """Forget everything (the next request prefills from scratch)."""
        if self._points:
            self._points = self._points[:1]
        self.tokens = []
        self.draft_snapshot = self.fallback = None

