"""A request in the engine (engine.py): the `Job` that carries it through the queue and
the batch, the `JobQueue` it waits in, the errors a queued request meets, and the
request's steps: its decoder's, on the request made whole (generation.Generation).

A job reports through its `Reporter` (generation.py: its sink, called on the engine's
worker thread) `Started`, `Resumed` (the prompt tokens the session or the prompt cache
held), then `Delta`s (one per round and request: a speculative round's tokens are held
and go out together, `Reporter.release`, once the round has run for every sequence of
the batch), then one `Finished` or `Failed`. `Job.cancel()` (a client that went away,
Ctrl-C) stops a request at its next token, or takes it off the queue.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

from .events import Event, Finished, GenerationRequest, Usage
from .generation import Generation, Reporter
from .session import Session


class QueueFull(RuntimeError):
    """The queue holds as many waiting requests as it may."""


class QueueTimeout(RuntimeError):
    """A request waited in the queue longer than the engine's queue timeout."""


class EngineClosed(RuntimeError):
    """The engine was closed: it takes no more requests."""


class Job:
    """One request in the engine (or, with `task`, a call to run on its worker thread).
    `cancel()` is safe from any thread; it takes the job off its `queue` if it is still
    there."""

    _ids = itertools.count(1)

    def __init__(self, request: GenerationRequest | None, sink: Callable[[Event], None], session: Session | None,
                 timeout: float, queue: JobQueue | None = None):
        self.id = next(self._ids)
        self.request = request
        self.reporter = Reporter(sink)
        self.session = session  # None: one of the engine's sessions, when it starts
        self.submitted_at = time.monotonic()
        self.deadline = self.submitted_at + timeout
        self.started = threading.Event()
        self.done = threading.Event()
        self.queue = queue
        self.task: Callable[[], object] | None = None  # Engine.call's work instead of a request
        self.result = self.error = None
        self.images = None  # images.PromptImages of a prompt with images (the engine's, at submit)

    @property
    def prompt(self) -> list[int] | tuple[int, ...]:
        """The prompt as the caches see it: its ids, or with images their key (images.py)."""
        return self.request.prompt_ids if self.images is None else self.images.key

    @property
    def cancelled(self) -> bool:
        return self.reporter.cancelled()

    def cancel(self) -> None:
        self.reporter.cancel()
        if self.queue is not None:
            self.queue.drop(self)

    def steps(self, decoder, generation: Generation, tokenizer):
        """The request's steps (batch.py): `decoder.steps(generation)` (its emitter is the
        job's reporter), with the events around them; the text is `tokenizer`'s."""
        queued = time.monotonic() - self.submitted_at
        self.started.set()
        self.reporter.start(tokenizer, self.request.stop, queued)
        try:
            outcome = yield from decoder.steps(generation)
        except Exception as e:  # noqa: BLE001 - reported to the request; the engine keeps serving
            self.session.reset()
            self.reporter.failed(e)
            return
        self.reporter.finished(outcome, queued)

    def finish_cancelled(self) -> None:
        """End a request that was cancelled before it started."""
        self.reporter.emit(Finished("cancelled", Usage(len(self.request.prompt_ids), 0, 0), ()))
        self.done.set()

    def fail(self, error: Exception) -> None:
        """End a job that did not run (a task's caller gets `error` raised)."""
        self.error = error
        self.reporter.failed(error)
        self.done.set()


class JobQueue:
    """The engine's waiting jobs in order, bounded by `max_queue` (tasks are not
    counted against it), and the lock (a Condition) the engine keeps its state under."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.jobs: deque[Job] = deque()
        self.lock = threading.Condition()
        self.closed = False

    def __len__(self) -> int:
        return len(self.jobs)

    def put(self, job: Job, bounded: bool = True) -> None:
        """Queue `job` (EngineClosed once closed; QueueFull when `bounded` and max_queue
        jobs already wait) and wake the worker."""
        with self.lock:
            if self.closed:
                raise EngineClosed("the engine is closed")
            if bounded and len(self.jobs) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self.jobs.append(job)
            self.lock.notify_all()

    def drop(self, job: Job) -> None:
        """Take a cancelled job off the queue and end it; one that has left the queue
        (running or finished) sees its flag at its next token."""
        with self.lock:
            try:
                self.jobs.remove(job)
            except ValueError:
                return
        job.finish_cancelled()
