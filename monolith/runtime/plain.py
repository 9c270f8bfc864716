"""Plain decoding: chunked prefill, then one token per step.

The next step is queued before the current token is read (`mx.async_eval`), so the
host's work on token t overlaps the device's work on token t+1 and each generated
token costs one host sync. When the token read turns out to be a stop token, that
one queued step is discarded (the cache then holds one token past the output: the
session keeps a restore point before it).

A decoder is called as `decoder(session, prompt, max_tokens, params, stop_ids,
on_token, logprobs=None, cancelled=..., boundaries=()) -> Outcome` (the speculative
decoder has the same call shape); its arguments were checked at the boundary
(events.check_request). `boundaries` are the prompt's message ends: with a prompt
cache, the prefill takes checkpoints there (and every N tokens, and at the prompt's end;
`Session.stops`), and the request's whole sequence is checkpointed at its end. A `guide`
(grammar.Guide) constrains the output: each token is sampled from the logits masked by
the grammar, so the token must be read before the next one can be chosen (the forward is
still queued before the mask is computed), and where the grammar allows exactly one
token it is emitted without sampling and fed with the tokens before it in one forward
(jump-forward).

Prefill chunks end on multiples of the chunk size counted from the sequence's start, not
from where a resumed prefill begins, so a prompt prefilled from a checkpoint runs the
same chunks as a cold prefill that took that checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from ..sampling import SamplingParams, key_chain, mask_logits, sample
from .batch import Forward, Steps, drive
from .events import Outcome, TokenLogprob
from .grammar import Guide
from .session import Session, chunk_ends


class PlainDecoder:
    """The plain loop on a Session's cache: the next step is queued before the current
    token is read, with cancellable chunked prefill, logprobs, and restore points at the
    prompt's end, at the output's end and one step before it."""

    logprobs = True  # the decoder reports logprobs

    def __init__(self, model, max_context: int, prefill_chunk_size: int = 512):
        self.model = model
        self.max_context = max_context
        if prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size!r}")
        self.prefill_chunk_size = prefill_chunk_size

    def __call__(self, session: Session, prompt: Sequence[int], max_tokens: int | None, params: SamplingParams,
                 stop_ids, on_token: Callable[[int, TokenLogprob | None], bool], logprobs: int | None = None,
                 cancelled: Callable[[], bool] = lambda: False, boundaries: Sequence[int] = (),
                 guide: Guide | None = None) -> Outcome:
        return drive(self.steps(session, prompt, max_tokens, params, stop_ids, on_token, logprobs, cancelled,
                                boundaries, guide))

    def steps(self, session: Session, prompt: Sequence[int], max_tokens: int | None, params: SamplingParams,
              stop_ids, on_token: Callable[[int, TokenLogprob | None], bool], logprobs: int | None = None,
              cancelled: Callable[[], bool] = lambda: False, boundaries: Sequence[int] = (),
              guide: Guide | None = None) -> Steps:
        """The call as a generator of its forwards (batch.py): `__call__` drives it alone,
        the engine in a Batch with other sequences."""
        model, max_context = self.model, self.max_context
        prompt = list(prompt)
        room = max_context - len(prompt)
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        stops = frozenset(stop_ids)
        keys = None if params.greedy else key_chain(params.seed)

        def pick(row):
            token = sample(row, params, None if keys is None else next(keys))
            return (token, *logprob_arrays(row, token, logprobs))

        start = time.perf_counter()
        cache, cached, logits = session.resume(model, prompt, max_context)
        prefilled = logits is None
        if prefilled:
            logits = yield from self._prefill(session, prompt, cached, cancelled, boundaries)
            if logits is None:
                return Outcome([], "abort", len(prompt), cached, time.perf_counter() - start, 0.0, 0)
        session.mark(prompt, logits)
        if guide is not None:
            if prefilled:
                session.checkpoint(prompt)
            def draw(masked):
                return sample(masked, params, None if keys is None else next(keys))

            return (yield from self._guided(session, prompt, logits, guide, max_tokens, stops, draw, logprobs,
                                            on_token, cancelled, start, cached))
        pending = pick(logits)
        mx.async_eval(*pending)
        if prefilled:
            session.checkpoint(prompt)
        fed, out = list(prompt), []
        first_at, steps, before, stop_token = None, 0, None, False
        while True:
            produced = len(out) + 1  # counting the token in flight
            more = produced < max_tokens
            if more:
                before = cache.snapshot()  # the cache holds exactly `fed`
                row, _ = yield Forward(model, pending[0].reshape(1), cache)
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
            if not on_token(token_id, read_logprob(pending)) or cancelled():
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
        session.checkpoint(fed)
        return Outcome(out, finish, len(prompt), cached, first_at - start, end - first_at, steps, stop_token)

    def _guided(self, session: Session, prompt: list[int], row: mx.array, guide: Guide, max_tokens: int,
                stops: frozenset[int], draw, logprobs: int | None, on_token, cancelled, start: float,
                cached: int) -> Outcome:
        """The loop under a grammar: `draw` from the masked row (or take the forced
        token), then feed it with the forced tokens after it in one forward. Logprobs are
        the raw row's, as without a grammar."""
        fed, out = list(prompt), []
        first_at, steps, stop_token, finish = None, 0, False, "length"
        while len(out) < max_tokens:
            forced = guide.forced()
            token = draw(mask_logits(row, guide.words())) if forced is None else mx.array(forced, dtype=mx.int32)
            chosen = (token, *logprob_arrays(row, token, logprobs))
            token_id = int(chosen[0].item())
            if first_at is None:
                first_at = time.perf_counter()
            if token_id in stops:
                finish, stop_token = "stop", True
                break
            guide.push(token_id)
            run, logprob = [token_id], read_logprob(chosen)
            while len(out) + len(run) < max_tokens and (forced := guide.forced()) is not None and forced not in stops:
                guide.push(forced)
                run.append(forced)
            out.append(token_id)
            if not on_token(token_id, logprob) or cancelled():
                finish = "abort"
                break
            if len(run) == 1 and len(out) == max_tokens:  # the last token: nothing reads its row
                break
            rows, _ = yield Forward(self.model, mx.array(run, dtype=mx.int32), session.cache)
            fed += run
            steps += 1
            for i, token_id in enumerate(run[1:]):  # forced: their logprobs from the rows before them
                out.append(token_id)
                if not on_token(token_id, read_logprob((mx.array(token_id), *logprob_arrays(
                        rows[i], mx.array(token_id), logprobs)))) or cancelled():
                    finish = "abort"
                    break
            if finish == "abort":
                break
            row = rows[-1]
            mx.async_eval(row)  # the next forward runs while the host computes the next mask
        end = time.perf_counter()
        session.mark(fed)
        session.checkpoint(fed)
        first_at = first_at or end
        return Outcome(out, finish, len(prompt), cached, first_at - start, end - first_at, steps, stop_token)

    def _prefill(self, session: Session, prompt: list[int], cached: int, cancelled,
                 boundaries: Sequence[int]) -> mx.array | None:
        """Prefill prompt[cached:] chunk by chunk, checkpointing at the session's stops
        before the prompt's end (a cancel takes effect between chunks); the last row's
        logits, or None if cancelled."""
        cache = session.cache
        stops = set(session.stops(cached, len(prompt), boundaries))
        done = cached
        for end in chunk_ends(cached, len(prompt), self.prefill_chunk_size, stops):
            last = end == len(prompt)
            logits, _ = yield Forward(self.model, mx.array(prompt[done:end], dtype=mx.int32), cache,
                                      logits="last" if last else "none")
            done = end
            if last:
                return logits[-1]
            mx.eval(cache.arrays())  # bound the graph between chunks
            if done in stops:
                session.checkpoint(prompt[:done])
            if cancelled():
                session.mark(prompt[:done])
                return None


def logprob_arrays(row: mx.array, token: mx.array, k: int | None) -> tuple:
    """(the sampled token's logprob, and with k the k likeliest ids and their logprobs),
    lazy, under `row`'s raw distribution; () without logprobs (k None)."""
    if k is None:
        return ()
    logprobs = row - mx.logsumexp(row, keepdims=True)
    chosen = logprobs[token]
    if not k:
        return (chosen,)
    top = mx.argpartition(-logprobs, k - 1)[:k]
    return chosen, top, logprobs[top]


def read_logprob(pending: tuple) -> TokenLogprob | None:
    """The TokenLogprob of (token, *logprob_arrays(...)), or None without logprobs."""
    if len(pending) == 1:
        return None
    token_id, chosen = int(pending[0].item()), float(pending[1].item())
    top = ()
    if len(pending) == 4:
        top = tuple(sorted(zip(pending[2].tolist(), pending[3].tolist()), key=lambda p: -p[1]))
    return TokenLogprob(token_id, chosen, top)
