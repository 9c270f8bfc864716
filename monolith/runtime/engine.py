"""The engine: one loaded target (plus an optional draft) that turns requests into
token streams.

Requests wait in a bounded FIFO queue; up to `max_batch` of them run at once on a
worker thread, as sequences of one `batch.Batch`: every round, each running sequence
drafts (if it does) and puts its rows into one shared target forward, so B sequences
cost little more than one where decode is bound by reading the weights. Sequences join
between rounds, in queue order, as slots free up; a newcomer's prefill runs chunk by
chunk inside the rounds, so the others keep streaming. Each request is a `jobs.Job`: it
reports through a `sink` (Started, Resumed, Deltas, then Finished or Failed: jobs.py),
and `Job.cancel()` stops it at its next token, or removes it from the queue.

The sequence a request leaves behind is kept in a `Session` (the model cache plus
restore points), so a request whose prompt extends it prefills only the new tokens:
the next chat turn, or the same prompt again. A request that brings no session of its
own runs on one of the engine's `max_batch` sessions (the free one whose tokens share
the longest prefix with its prompt); all of them share the prompt cache. The
generation itself is `decoder.steps(generation)` (decoder.Decoder, with or without a
drafter) on the request made whole (generation.Generation, whose emitter is the job's
Reporter), which `Job.steps` wraps in the request's first and last events; events.py
holds the request and event types, textstream.py the released text.

serve, chat, generate and the benchmarks all run requests through an Engine;
`run_decoder` below is the same decoder call on the calling thread, without the queue
(for code that wants an Outcome's stats or times a loop without a worker thread).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from dataclasses import replace

import mlx.core as mx

from ..sampling import SamplingParams
from . import memory_trim
from .batch import Batch
from .decoder import Decoder
from .events import (
    Delta,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    Outcome,
    RequestError,
    TokenLogprob,
    check_request,
)
from .generation import Generation, Tokens
from .grammar import GrammarTokenizer
from .images import FeatureCache, PromptImages
from .jobs import EngineClosed, Job, JobQueue, QueueTimeout
from .pipeline import Pipeline
from .prompt_cache import PromptCache, common_prefix
from .session import Session


def release_thread_streams() -> None:
    """Call at the end of a thread that ran MLX work: MLX gives each thread its own
    streams, and a thread's streams still alive at interpreter exit abort the process
    ("terminate called without an active exception")."""
    mx.synchronize()
    mx.clear_streams()


_ENGINES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_engines() -> None:
    for engine in list(_ENGINES):
        engine.close()


@dataclass(frozen=True)
class Drafting:
    """What an engine knows of drafting besides its decoder: the draft its decoder drafts
    with (None: it decodes plainly), why a loaded draft does not draft, and a decoder
    that drafts every round for the requests that ask (GenerationRequest.draft), with
    its draft's name."""

    name: str | None = None
    not_drafting: str | None = None
    on_request: Decoder | None = None
    on_request_name: str | None = None


@dataclass(frozen=True)
class Limits:
    """How much an engine takes: tokens in a sequence (prompt + output), requests waiting
    in its queue, seconds a request may wait there before it starts, and sequences that
    run at once."""

    max_context: int = 32768
    max_queue: int = 64
    queue_timeout: float = 600.0
    max_batch: int = 1

    def __post_init__(self):
        if self.max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {self.max_context}")
        if self.max_queue < 1 or self.queue_timeout <= 0:
            raise ValueError("max_queue must be >= 1 and queue_timeout > 0")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {self.max_batch!r}")


class Engine:
    """See the module docstring. `decoder` defaults to plain decoding of `model`."""

    def __init__(self, model, tokenizer, limits: Limits = Limits(), *, decoder: Decoder | None = None,
                 prompt_cache: PromptCache | None = None, vision=None, drafting: Drafting = Drafting()):
        self.model = model
        self.tokenizer = tokenizer
        self.vision = vision  # models/vision.Vision: the target takes images (None: text only)
        self._features = None if vision is None else FeatureCache(vision)
        self.limits = limits
        self.max_context = limits.max_context
        self.decoder = decoder or Decoder(model, None, limits.max_context)
        self.draft_name = drafting.name  # the draft the decoder drafts with (None: plain decoding)
        self.not_drafting = drafting.not_drafting  # why a draft was loaded but the decoder does not draft
        # a decoder that drafts every round, for requests that ask to be drafted (GenerationRequest.draft)
        self.draft_decoder, self.draft_decoder_name = drafting.on_request, drafting.on_request_name
        self.stop_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model.args.eos_token_ids)
        self.vocab_size = model.args.vocab_size
        self.prompt_cache = prompt_cache  # shared by every session
        self.session = Session(prompt_cache)  # the first of the sessions for requests without their own
        self._sessions = [self.session]
        self._batch = Batch()
        self._grammar_lock = threading.Lock()
        self._grammar_tokenizer: GrammarTokenizer | None = None
        self._queue = JobQueue(limits.max_queue)
        self._lock = self._queue.lock
        self._running: dict[int, Job] = {}  # the jobs in the batch, by id
        self.idle_since = time.monotonic()  # when the last running request ended (serving/models.py's keep-alive)
        if isinstance(model, Pipeline):  # its watchdog fails the requests of a stuck worker
            model.on_broken.append(self.abandon)
        self._thread = threading.Thread(target=self._work, name="monolith-engine", daemon=True)
        self._thread.start()
        _ENGINES.add(self)

    # ---------------------------------------------------------------- public

    @property
    def can_draft(self) -> bool:
        """Whether a request may ask to be drafted whatever the start decided (GenerationRequest.draft)."""
        return self.draft_decoder is not None

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def busy(self) -> bool:
        """A request (or a task) is running or waiting."""
        return bool(self._running or self._queue)

    @property
    def cache_bytes(self) -> int:
        """Bytes the sessions' caches hold now (KV rows and recurrent states; the prompt
        cache's own are its `nbytes`)."""
        caches = [session.cache for session in list(self._sessions) if session.cache is not None]
        return sum(array.nbytes for cache in caches for layer in cache.layers for array in layer.arrays())

    @property
    def down(self) -> str | None:
        """Why the model cannot serve any more (a pipeline whose rank failed), or None."""
        return self.model.broken if isinstance(self.model, Pipeline) else None

    def new_session(self) -> Session:
        return Session(self.prompt_cache)

    @property
    def supports_logprobs(self) -> bool:
        return self.decoder.logprobs

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The vocabulary for grammars, built once (about 4 s at 248K tokens: `serve` starts
        it in the background when ready); a grammar may end the output with any of the
        stop tokens."""
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = GrammarTokenizer.of(self.tokenizer, self.vocab_size, self.stop_ids)
            return self._grammar_tokenizer

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None], session: Session | None = None,
               timeout: float | None = None) -> Job:
        """Check the request (RequestError names the field: the one check of a request's
        content), then queue it; raise QueueFull when max_queue requests already wait. The
        request is dropped with a QueueTimeout if it has not started by its deadline."""
        prompt = check_request(request.prompt_ids, request.max_tokens, request.logprobs, self.vocab_size,
                               self.max_context, self.supports_logprobs)
        request = replace(request, prompt_ids=tuple(prompt))
        images = self._images(request)
        job = Job(request, sink, session, self.limits.queue_timeout if timeout is None else timeout, self._queue)
        job.images = images
        self._queue.put(job)
        return job

    def _images(self, request: GenerationRequest) -> PromptImages | None:
        """The request's images checked against its prompt (RequestError naming "images")."""
        if not request.images:
            return None
        if self.vision is None:
            raise RequestError("images", "this model takes no images (it has no vision tower, or the server "
                                         "was started with --no-vision)")
        if isinstance(self.model, Pipeline):
            raise RequestError("images", "images need the whole target on one machine, not a --distributed pipeline")
        return PromptImages(request.prompt_ids, request.images, self.vision, self._features)

    def run_request(self, request: GenerationRequest, session: Session | None = None,
                    on_text: Callable[[str], None] | None = None) -> tuple[str, Finished]:
        """Run one request to the end (blocking): (text, Finished). `on_text(piece)` sees
        the text as it is released (on the worker thread); an interrupt while waiting
        (Ctrl-C) cancels the request."""
        events: list[Event] = []

        def sink(event: Event) -> None:
            events.append(event)
            if on_text is not None and isinstance(event, Delta) and event.text:
                on_text(event.text)

        job = self.submit(request, sink, session)
        try:
            job.done.wait()
        except KeyboardInterrupt:
            job.cancel()
            raise
        for e in events:
            if isinstance(e, Failed):
                raise e.error
        return "".join(e.text for e in events if isinstance(e, Delta)), events[-1]

    def call(self, fn: Callable[[], object]) -> object:
        """Run fn() on the worker thread between requests (the thread that owns the MLX
        state: sessions, caches); its result, or its exception raised here."""
        job = Job(None, lambda event: None, None, 1e12)
        job.task = fn
        self._queue.put(job, bounded=False)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def warmup(self) -> None:
        """One short generation on the worker thread (allocates the cache, builds the
        kernels), then forget it (on a session of its own, outside the prompt cache)."""
        session = Session()
        self.run_request(GenerationRequest((0, 1), max_tokens=2), session)

    def abandon(self, error: Exception) -> None:
        """The model cannot answer any more (a pipeline rank is unreachable) and the worker
        may be stuck in it: fail every running and queued request now, from this thread."""
        with self._lock:
            self._queue.closed = True
            jobs = list(self._running.values()) + list(self._queue.jobs)
            self._queue.jobs.clear()
            self._running.clear()
            self._lock.notify_all()
        for job in jobs:
            job.fail(error)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel the running requests, fail the queued ones, stop the worker."""
        with self._lock:
            self._queue.closed = True
            queued = list(self._queue.jobs)
            self._queue.jobs.clear()
            for job in self._running.values():
                job.cancel()  # seen at its next token
            self._lock.notify_all()
        for job in queued:
            job.fail(EngineClosed("the engine was closed"))
        self._thread.join(timeout)
        store = None if self.prompt_cache is None else self.prompt_cache.store
        if store is not None:
            store.close()  # the saved states queued for the disk are written

    # ---------------------------------------------------------------- worker

    def _work(self) -> None:
        try:
            self._serve_queue()
        finally:
            release_thread_streams()

    def _serve_queue(self) -> None:
        """Admit queued requests into the batch as slots free up (in queue order), then
        run one round of the batch; until closed and every running request has ended."""
        batch = self._batch
        while True:
            with self._lock:
                while not self._queue and not len(batch) and not self._queue.closed:
                    self._lock.wait()
                if self._queue.closed and not len(batch):
                    return
                admitted = [] if self._queue.closed else self._admit()
            for job in admitted:
                self._start(job)
            worked = bool(admitted or len(batch))
            if len(batch):
                for member in batch.step():
                    self._end(member)
                for member in batch.members:
                    member.owner.reporter.release()
            if worked and not len(batch) and not self._queue:  # idle now: hand back what the work freed
                memory_trim.trim()

    def _admit(self) -> list[Job]:
        """(Under the lock.) The queued jobs that start now, taken off the queue in order:
        tasks, cancelled and timed-out jobs, and requests while the batch has room and
        their session is free (a job whose own session is running waits, and does not
        hold up the jobs behind it)."""
        taken, busy = [], {id(job.session) for job in self._running.values()}
        room, waiting = self.limits.max_batch - len(self._running), False
        for job in list(self._queue.jobs):
            if job.task is not None:
                starts = not waiting  # in queue order: after the requests ahead of it have started
            elif job.cancelled or time.monotonic() > job.deadline:
                starts = True
            else:
                starts = room > 0 and (job.session is None or id(job.session) not in busy)
                if starts:
                    if job.session is None:
                        job.session = self._free_session(job.prompt, busy)
                    busy.add(id(job.session))
                    room -= 1
                else:
                    waiting = True
            if starts:
                self._queue.jobs.remove(job)
                taken.append(job)
        return taken

    def _free_session(self, prompt: Sequence[int], busy: set[int]) -> Session:
        """The engine's free session whose tokens share the longest prefix with `prompt`
        (a new one while there are fewer than max_batch)."""
        free = [s for s in self._sessions if id(s) not in busy]
        if not free:
            session = Session(self.prompt_cache)
            self._sessions.append(session)
            return session
        prompt = list(prompt)
        # the first of equals: sequential requests keep to one session
        return max(free, key=lambda session: common_prefix(session.tokens, prompt))

    def _start(self, job: Job) -> None:
        """Run a task, end a cancelled or timed-out job, or add a request to the batch."""
        if job.task is not None:
            try:
                job.result = job.task()
            except Exception as e:  # noqa: BLE001 - raised again in the calling thread
                job.error = e
            job.done.set()
        elif job.cancelled:
            job.finish_cancelled()
        elif time.monotonic() > job.deadline:
            job.fail(QueueTimeout(f"the request waited {time.monotonic() - job.submitted_at:.1f} s in the queue"))
        else:
            with self._lock:
                self._running[job.id] = job
            decoder = self.decoder
            if job.request.draft and self.draft_decoder is not None:
                if decoder.drafter is None:
                    # drafted on request by a plain server: on a session of its own, without the
                    # prompt cache, whose saved states have no drafter's rows
                    job.session = Session(None)
                decoder = self.draft_decoder
            steps = job.steps(decoder, self._generation(job), self.tokenizer)
            member = self._batch.add(steps, job)
            if member.done:  # it ended before its first forward (it failed, or was cancelled)
                self._end(member)

    def _generation(self, job: Job) -> Generation:
        """A started request made whole for its decoder, the job's reporter its emitter."""
        request = job.request
        guide = None if request.grammar is None else self.grammar_tokenizer.guide(request.grammar)
        return Generation(job.prompt, request.max_tokens, request.params, self.stop_ids, request.logprobs,
                          request.boundaries, guide, job.images, job.session, job.reporter)

    def _end(self, member) -> None:
        job = member.owner
        with self._lock:
            self._running.pop(job.id, None)
            if not self._running:
                self.idle_since = time.monotonic()
        if member.error is not None:  # the steps failed outside the decoder (a bug): the request still ends
            job.session.reset()
            job.reporter.failed(member.error)
        job.done.set()


def run_decoder(decoder, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams = SamplingParams(),
                stop_ids=(), on_token: Callable[[int], None] | None = None, session: Session | None = None,
                logprobs: int | None = None) -> Outcome:
    """Up to `max_tokens` tokens after `prompt_ids` with `decoder`, on the calling thread
    (a fresh Session unless one is given). The sequence (prompt + output) never exceeds
    the decoder's max_context; a stop token ends it with "stop" and is not part of the
    output. `on_token(id)` is called for each output token as it is read."""
    if max_tokens is None:
        raise RequestError("max_tokens", "max_tokens must be an integer >= 1, got None")
    prompt = check_request(prompt_ids, max_tokens, logprobs, decoder.model.args.vocab_size, decoder.max_context,
                           decoder.logprobs)

    def emit(token_id: int, logprob: TokenLogprob | None) -> bool:
        if on_token is not None:
            on_token(token_id)
        return True

    return decoder(Generation(prompt, max_tokens, params, frozenset(int(t) for t in stop_ids), logprobs,
                              session=session or Session(), emitter=Tokens(emit)))
