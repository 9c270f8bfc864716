"""Generation on a `Session` (the model cache kept between requests, with restore
points): `PlainDecoder`, and `SpeculativeBackend` with the same call shape. A prompt
that extends the session's tokens exactly prefills only the new ones."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from .decode import check_prompt
from .events import Outcome, SpecCounters, TokenLogprob
from ..sampling import SamplingParams, key_chain, sample
from .scheduler import CostScheduler, Fallback, measure_costs

MAX_RESTORE_POINTS = 6  # besides the empty cache; each holds references to the recurrent states


@dataclass(frozen=True)
class _Point:
    length: int  # the session's first `length` tokens are in the cache at this point
    snapshot: object  # the cache's Snapshot there
    logits: mx.array | None  # next-token logits there, when kept (prompt ends)


class Session:
    """A sequence kept between requests: the model cache, the tokens in it, and restore
    points (a cache snapshot after some prefix of those tokens). A new prompt resumes
    from the longest point it extends exactly; anything else starts from the empty
    cache. Restoring is free: KV rows past the offset are ignored and the recurrent
    states are held by reference."""

    def __init__(self):
        self.cache = None
        self.tokens: list[int] = []
        self._points: list[_Point] = []
        self.draft_context = None  # a speculative backend's drafter context, in step with the cache
        self.fallback = None  # and its scheduler.Fallback: a conversation that goes on keeps it

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
        self.draft_context = self.fallback = None

    @property
    def restore_points(self) -> list[int]:
        return [p.length for p in self._points]


# ------------------------------------------------------------------ plain decoding on a session


class PlainDecoder:
    """Plain decoding as a backend: `decode.generate`'s loop (the next step queued
    before the current token is read) on a Session's cache, with cancellable chunked
    prefill, logprobs, and restore points at the prompt's end, at the output's end
    and one step before it (the queued step may hold one token past the output)."""

    logprobs = True  # the backend reports logprobs

    def __init__(self, model, max_context: int, prefill_chunk_size: int = 512):
        self.model = model
        self.max_context = max_context
        self.prefill_chunk_size = prefill_chunk_size

    def __call__(self, session: Session, prompt: Sequence[int], max_tokens: int | None, params: SamplingParams,
                 stop_ids, on_token: Callable[[int, TokenLogprob | None], bool], logprobs: int | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> Outcome:
        model, max_context = self.model, self.max_context
        prompt = check_prompt(prompt, model.args.vocab_size, max_context)
        room = max_context - len(prompt)
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        stops = frozenset(stop_ids)
        keys = None if params.greedy else key_chain(params.seed)

        def pick(row):
            token = sample(row, params, None if keys is None else next(keys))
            return (token, *_logprob_arrays(row, token, logprobs))

        start = time.perf_counter()
        cache, cached, logits = session.resume(model, prompt, max_context)
        if logits is None:
            logits = self._prefill(session, prompt, cached, cancelled)
            if logits is None:
                return Outcome([], "abort", len(prompt), cached, time.perf_counter() - start, 0.0, 0)
        session.mark(prompt, logits)
        pending = pick(logits)
        mx.async_eval(*pending)
        fed, out = list(prompt), []
        first_at, steps, before, stop_token = None, 0, None, False
        while True:
            produced = len(out) + 1  # counting the token in flight
            more = produced < max_tokens
            if more:
                before = cache.snapshot()  # the cache holds exactly `fed`
                row, _ = model(pending[0].reshape(1), cache)
                upcoming = pick(row[-1])
                mx.async_eval(*upcoming)
            token_id = pending[0].item()
            if more:
                fed.append(token_id)
            if first_at is None:
                first_at = time.perf_counter()
            else:
                steps += 1
            if token_id in stops:
                finish, stop_token = "stop", True
                break
            out.append(token_id)
            if not on_token(token_id, _read_logprob(pending)) or cancelled():
                finish = "abort"
                break
            if not more:
                finish = "length"
                break
            pending = upcoming
        end = time.perf_counter()
        if more:  # the last step fed one token past what it read: keep the point before it
            session.mark(fed[:-1], snapshot=before)
        session.mark(fed)
        return Outcome(out, finish, len(prompt), cached, first_at - start, end - first_at, steps, stop_token)

    def _prefill(self, session: Session, prompt: list[int], cached: int, cancelled) -> mx.array | None:
        """Prefill prompt[cached:] chunk by chunk (a cancel takes effect between chunks);
        the last row's logits, or None if cancelled."""
        cache, chunk = session.cache, self.prefill_chunk_size
        done = cached
        while True:
            end = min(done + chunk, len(prompt))
            logits = self.model.prefill(mx.array(prompt[done:end], dtype=mx.int32), cache, chunk_size=chunk)
            done = end
            if done == len(prompt):
                return logits
            mx.eval(cache.arrays())  # bound the graph between chunks
            if cancelled():
                session.mark(prompt[:done])
                return None


class SpeculativeBackend:
    """Speculative decoding as a backend: `speculative.SpeculativeDecoder` rounds on a
    Session's cache, so a prompt that extends the session prefills only its new tokens
    here too. The drafter's context (draft K/V of the committed rows, rewindable by
    offset) is kept with the session; a drafter without one prefills every prompt
    whole. No logprobs: the round does not keep the target's rows. With `fallback`,
    each conversation gets a scheduler.Fallback (break-even measured once here): rounds
    become plain steps while drafting does not pay; a prompt that extends the session
    (the next turn) goes on with the state the last request left, others start afresh."""

    logprobs = False

    def __init__(self, model, drafter, max_context: int, prefill_chunk_size: int = 512,
                 block_size: int | None = None, scheduler=None, fallback: bool = False):
        from .speculative import check_block_size, measure_break_even

        self.model = model
        self.drafter = drafter
        self.max_context = max_context
        self.prefill_chunk_size = prefill_chunk_size
        self.block_size = check_block_size(block_size, drafter.max_proposals)
        self.scheduler = scheduler  # kept across requests: adaptive schedulers learn
        if isinstance(scheduler, CostScheduler) and not scheduler.calibrated:  # once, not per request
            scheduler.set_costs(*measure_costs(model, drafter, self.block_size, SamplingParams()))
        self.break_even = measure_break_even(model, drafter, self.block_size, SamplingParams()) if fallback else None
        self.resumable = hasattr(drafter, "context") and hasattr(drafter, "draft")

    def __call__(self, session: Session, prompt: Sequence[int], max_tokens: int | None, params: SamplingParams,
                 stop_ids, on_token: Callable[[int, TokenLogprob | None], bool], logprobs: int | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> Outcome:
        from .speculative import SpeculativeDecoder, run_rounds

        if logprobs is not None:
            raise ValueError("logprobs are not available with speculative decoding")
        model, max_context = self.model, self.max_context
        prompt = check_prompt(prompt, model.args.vocab_size, max_context)
        room = max_context - len(prompt)
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        stops = frozenset(stop_ids)

        start = time.perf_counter()
        decoder = SpeculativeDecoder(model, self.drafter, params, max_context, self.block_size, self.scheduler)
        if not self.resumable:
            session.reset()
        cache, cached, _ = session.resume(model, prompt, max_context, new_tokens=1)
        context = getattr(session, "draft_context", None)
        if cached and context is not None and context.offset >= cached:
            context.restore(cached)
            self.drafter.context = context
        elif cached:  # no draft context for this point: start over
            session.reset()
            cache, cached, _ = session.resume(model, prompt, max_context, new_tokens=1)
        decoder.cache = cache
        if self.break_even is not None:  # a prompt that extends the session goes on with its fallback's state
            kept = session.fallback if cached else None
            decoder.fallback = kept if kept is not None else Fallback(self.break_even)
        emitted = [decoder.prefill(prompt[cached:], self.prefill_chunk_size)]
        if self.resumable:
            session.mark(prompt)
        first_at = time.perf_counter()
        try:
            out, finish, read = run_rounds(decoder, emitted, max_tokens, stops,
                                           lambda token_id: on_token(token_id, None) and not cancelled())
        finally:
            # the cache holds the prompt and every emitted token but the last (the next anchor)
            decoder.sync_drafter()
            if self.resumable and cache.offset == len(prompt) + len(emitted) - 1:
                session.mark(prompt + emitted[:-1])
                session.draft_context, session.fallback = self.drafter.context, decoder.fallback
            else:
                session.reset()
        end = time.perf_counter()
        return Outcome(out, finish, len(prompt), cached, first_at - start, end - first_at, read - 1, finish == "stop",
                       spec_counters(decoder.stats))


def spec_counters(stats) -> SpecCounters | None:
    """The engine's additive counters from a generation's speculative stats."""
    if stats is None:
        return None
    c = stats.prometheus()
    return SpecCounters(c["spec_decode_num_drafts_total"], c["spec_decode_num_draft_tokens_total"],
                        c["spec_decode_num_accepted_tokens_total"],
                        tuple(c["spec_decode_num_accepted_tokens_per_pos_total"]))


def _logprob_arrays(row: mx.array, token: mx.array, k: int | None) -> tuple:
    if k is None:
        return ()
    logprobs = row - mx.logsumexp(row, keepdims=True)
    chosen = logprobs[token]
    if not k:
        return (chosen,)
    top = mx.argpartition(-logprobs, k - 1)[:k]
    return chosen, top, logprobs[top]


def _read_logprob(pending: tuple) -> TokenLogprob | None:
    if len(pending) == 1:
        return None
    token_id, chosen = int(pending[0].item()), float(pending[1].item())
    top = ()
    if len(pending) == 4:
        top = tuple(sorted(zip(pending[2].tolist(), pending[3].tolist()), key=lambda p: -p[1]))
    return TokenLogprob(token_id, chosen, top)
