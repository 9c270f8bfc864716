"""A request in the engine (engine.py): the `Job` that carries it through the queue and
the batch, the errors a queued request meets, and the request's steps: its decoder's,
with the events it reports around them.

A job reports through its `sink` (called on the engine's worker thread) `Started`,
`Resumed` (the prompt tokens the session or the prompt cache held), then `Delta`s (text
that is whole UTF-8 characters and cannot be the start of a stop string, with the
logprobs of its tokens and how each came; one per round and request: a speculative round's tokens are
held and go out together, `Job.release`, once the round has run for every sequence of
the batch), then one `Finished` or `Failed`. `Job.cancel()` (a client that went away,
Ctrl-C) stops a request at its next token, or removes it from the queue.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

from .events import (
    PLAIN,
    Delta,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    Resumed,
    Started,
    TokenLogprob,
    Usage,
)
from .session import Session
from .textstream import TextStream


class QueueFull(RuntimeError):
    """The queue holds as many waiting requests as it may."""


class QueueTimeout(RuntimeError):
    """A request waited in the queue longer than the engine's queue timeout."""


class EngineClosed(RuntimeError):
    """The engine was closed: it takes no more requests."""


class Job:
    """One request in the engine (or, with `task`, a call to run on its worker thread).
    `cancel()` is safe from any thread; `on_cancel(job)` then takes it off the queue if
    it is still there."""

    _ids = itertools.count(1)

    def __init__(self, request: GenerationRequest | None, sink: Callable[[Event], None], session: Session | None,
                 timeout: float, on_cancel: Callable[[Job], None] = lambda job: None):
        self.id = next(self._ids)
        self.request = request
        self.sink = sink
        self.session = session  # None: one of the engine's sessions, when it starts
        self.submitted_at = time.monotonic()
        self.deadline = self.submitted_at + timeout
        self.started = threading.Event()
        self.done = threading.Event()
        self._on_cancel = on_cancel
        self._cancelled = threading.Event()
        self.task: Callable[[], object] | None = None  # Engine.call's work instead of a request
        self.result = self.error = None
        self.held: list[Delta] = []  # the worker's: this round's text, sent when the round is over
        self.images = None  # images.PromptImages of a prompt with images (the engine's, at submit)

    @property
    def prompt(self) -> list[int] | tuple[int, ...]:
        """The prompt as the caches see it: its ids, or with images their key (images.py)."""
        return self.request.prompt_ids if self.images is None else self.images.key

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()
        self._on_cancel(self)

    def emit(self, event: Event) -> None:
        """Hand `event` to the sink; a sink that fails (a consumer that went away) cancels
        the job and never stops the engine."""
        try:
            self.sink(event)
        except Exception:  # noqa: BLE001 - a consumer that went away must not stop the engine
            self._cancelled.set()

    def release(self) -> None:
        """Send the text this round held back, as one Delta."""
        if self.held:
            held, self.held = self.held, []
            self.emit(Delta.join(held))

    def steps(self, decoder, tokenizer, stop_ids: frozenset[int], guide: Callable[[object], object]):
        """The request's steps (batch.py): `decoder.steps` on the job's session, with the
        events around them; `guide(grammar)` builds the request's grammar.Guide."""
        request = self.request
        queued = time.monotonic() - self.submitted_at
        self.started.set()
        self.emit(Started(queued))
        text = TextStream(tokenizer, request.stop)

        def on_token(token_id: int, logprob: TokenLogprob | None, how: str = PLAIN) -> bool:
            delta = text.add(token_id, logprob, how)
            if delta is not None:
                self.held.append(delta)  # sent after the batch's round (Engine._serve_queue)
            return not (text.stopped or self.cancelled)

        try:
            options = {} if request.grammar is None else {"guide": guide(request.grammar)}
            args = (self.session, self.prompt, request.max_tokens, request.params, stop_ids, on_token)
            if self.images is not None:
                options["images"] = self.images
            if decoder.kinds:  # how each token came (Delta.spec)
                options["kinds"] = True
            kwargs = dict(logprobs=request.logprobs, cancelled=lambda: self.cancelled, boundaries=request.boundaries,
                          **options)
            outcome = yield from decoder.steps(*args, **kwargs, on_resume=lambda cached: self.emit(Resumed(cached)))
        except Exception as e:  # noqa: BLE001 - reported to the request; the engine keeps serving
            self.session.reset()
            self.release()
            self.emit(Failed(e))
            return
        tail = text.finish()
        if tail is not None:
            self.held.append(tail)
        self.release()
        if text.stopped:
            finish = "stop"
        elif outcome.finish_reason == "abort":
            finish = "cancelled"
        else:
            finish = outcome.finish_reason
        generated = len(outcome.token_ids) + outcome.stop_token
        usage = Usage(outcome.prompt_tokens, generated, outcome.cached_tokens)
        self.emit(Finished(finish, usage, tuple(outcome.token_ids), queued, outcome.prefill_seconds,
                           outcome.decode_seconds, outcome.decode_steps, outcome.speculative))

    def finish_cancelled(self) -> None:
        """End a request that was cancelled before it started."""
        self.emit(Finished("cancelled", Usage(len(self.request.prompt_ids), 0, 0), ()))
        self.done.set()

    def fail(self, error: Exception) -> None:
        """End a job that did not run (a task's caller gets `error` raised)."""
        self.error = error
        self.emit(Failed(error))
        self.done.set()
