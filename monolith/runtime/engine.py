"""The engine: one loaded target (plus an optional draft) that turns requests into
token streams.

Requests wait in a bounded FIFO queue and run one at a time on a worker thread. Each
request reports through a `sink` (called on the worker thread) with `Started`, then
`Delta`s (text that is whole UTF-8 characters and cannot be the start of a stop
string, with the logprobs of its tokens), then one `Finished` or `Failed`.
`Job.cancel()` (a client that went away, Ctrl-C) stops a request at its next token,
or removes it from the queue.

The sequence a request leaves behind is kept in a `Session` (the model cache plus
restore points), so a request whose prompt extends it prefills only the new tokens:
the next chat turn, or the same prompt again. The generation itself is one call,
`backend(session, prompt, ...)`: `PlainDecoder` here; a speculative backend has the
same shape.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..tokenizer import IncrementalDetokenizer
from .decode import ContextLengthError
from .sampling import SamplingParams, key_chain, sample

MAX_TOP_LOGPROBS = 20
MAX_RESTORE_POINTS = 6  # besides the empty cache; each holds references to the recurrent states


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


class QueueFull(RuntimeError):
    """The queue holds as many waiting requests as it may."""


class QueueTimeout(RuntimeError):
    """A request waited in the queue longer than the engine's queue timeout."""


class EngineClosed(RuntimeError):
    """The engine was closed: it takes no more requests."""


# ------------------------------------------------------------------ requests and events


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int | None = None  # None: until a stop or the context is full
    params: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and the k most likely


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probabilities under the model's raw next-token distribution (before
    temperature and filters, as vLLM reports them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class SpecCounters:
    drafts: int = 0  # speculative rounds
    draft_tokens: int = 0  # proposals verified
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # accepted count at draft position 0, 1, ...

    def __add__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + (0,) * (n - len(self.accepted_per_position))
        b = other.accepted_per_position + (0,) * (n - len(other.accepted_per_position))
        return SpecCounters(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                         self.accepted_tokens + other.accepted_tokens, tuple(x + y for x, y in zip(a, b)))

    @property
    def acceptance_length(self) -> float:
        """tau: tokens committed per round (accepted + the bonus token)."""
        return (self.accepted_tokens + self.drafts) / self.drafts if self.drafts else 0.0


@dataclass(frozen=True)
class Outcome:
    """What a backend call produced."""

    token_ids: list[int]  # output tokens (a stop token is not one of them)
    finish_reason: str  # "stop" (stop token), "length", or "abort" (on_token asked to stop)
    prompt_tokens: int
    cached_tokens: int  # prompt tokens taken from the session instead of prefilled
    prefill_seconds: float  # start to the first output token
    decode_seconds: float  # first output token to the last
    decode_steps: int
    stop_token: bool = False  # a stop token ended it (it counts as generated)
    spec: SpecCounters | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Started:
    queued_seconds: float


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop", "length", or "cancelled"
    usage: Usage
    token_ids: tuple[int, ...]
    queued_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    spec: SpecCounters | None = None

    @property
    def prefilled_tokens(self) -> int:
        return self.usage.prompt_tokens - self.usage.cached_tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_steps and self.decode_seconds > 0 else 0.0


@dataclass(frozen=True)
class Failed:
    error: Exception


Event = Started | Delta | Finished | Failed


# ------------------------------------------------------------------ sessions


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
        if getattr(self.cache, "record", False):  # a speculative run that failed may have left it on
            self.cache.record = False
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
        self.draft_context = None

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
    whole. No logprobs: the round does not keep the target's rows."""

    logprobs = False

    def __init__(self, model, drafter, max_context: int, prefill_chunk_size: int = 512,
                 block_size: int | None = None, scheduler=None):
        from .scheduler import CostScheduler, measure_costs
        from .speculative import check_block_size

        self.model = model
        self.drafter = drafter
        self.max_context = max_context
        self.prefill_chunk_size = prefill_chunk_size
        self.block_size = check_block_size(block_size, drafter.max_proposals)
        self.scheduler = scheduler  # kept across requests: adaptive schedulers learn
        if isinstance(scheduler, CostScheduler) and not scheduler.calibrated:  # once, not per request
            scheduler.set_costs(*measure_costs(model, drafter, self.block_size, SamplingParams()))
        self.resumable = hasattr(drafter, "context") and hasattr(getattr(drafter, "draft", None), "rewind_context")

    def __call__(self, session: Session, prompt: Sequence[int], max_tokens: int | None, params: SamplingParams,
                 stop_ids, on_token: Callable[[int, TokenLogprob | None], bool], logprobs: int | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> Outcome:
        from .speculative import SpeculativeDecoder

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
            self.drafter.draft.rewind_context(context, cached)
            self.drafter.context = context
        elif cached:  # no draft context for this point: start over
            session.reset()
            cache, cached, _ = session.resume(model, prompt, max_context, new_tokens=1)
        decoder.cache = cache
        emitted = [decoder.prefill(prompt[cached:], self.prefill_chunk_size)]
        if self.resumable:
            session.mark(prompt)
        first_at = time.perf_counter()
        out: list[int] = []
        pending, read, stop_token = emitted[:], 0, False
        try:
            while True:
                for token_id in pending:
                    read += 1
                    if token_id in stops:
                        finish, stop_token = "stop", True
                        break
                    out.append(token_id)
                    if not on_token(token_id, None) or cancelled():
                        finish = "abort"
                        break
                else:
                    max_new = min(max_tokens - len(out), room - len(out))
                    if max_new > 0:
                        pending = decoder.round(max_new).tokens
                        emitted += pending
                        continue
                    finish = "length"
                break
        finally:
            # the cache holds the prompt and every emitted token but the last (the next anchor)
            if self.resumable and cache.offset == len(prompt) + len(emitted) - 1:
                session.mark(prompt + emitted[:-1])
                session.draft_context = self.drafter.context
            else:
                session.reset()
        end = time.perf_counter()
        return Outcome(out, finish, len(prompt), cached, first_at - start, end - first_at, read - 1, stop_token,
                       spec_counters(decoder.stats))


def spec_counters(stats) -> SpecCounters | None:
    """The engine's additive counters from a generation's speculative stats."""
    if stats is None:
        return None
    c = stats.prometheus()
    return SpecCounters(c["spec_decode_num_drafts_total"], c["spec_decode_num_draft_tokens_total"],
                        c["spec_decode_num_accepted_tokens_total"],
                        tuple(c["spec_decode_num_accepted_tokens_per_pos_total"]))


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, max_context: int) -> list[int]:
    """The prompt as a list of ints; ValueError (or ContextLengthError) if it is empty,
    holds an id outside the vocabulary, or leaves no room for one generated token."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: at least one token is needed")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range for a vocabulary of {vocab_size}")
    if len(prompt) + 1 > max_context:
        raise ContextLengthError(len(prompt), max_context)
    return prompt


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


# ------------------------------------------------------------------ text


class TextStream:
    """Generated tokens -> released text: whole UTF-8 characters only, never text that
    could be the start of a stop string; ends before the first stop string. Logprobs
    travel with the text of their tokens (a token's entry is released with the text
    from where its own text starts)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.stopped = False  # a stop string was found
        self.text = ""  # released so far
        self._held = ""
        self._decoded = 0  # characters decoded so far (released + held)
        self._logprobs: list[tuple[int, TokenLogprob]] = []  # (start offset, entry), not yet released

    def add(self, token_id: int, logprob: TokenLogprob | None = None) -> Delta | None:
        if self.stopped:
            return None
        if logprob is not None:
            self._logprobs.append((self._decoded, logprob))
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
        self.text += out
        end = len(self.text)
        if final or self.stopped:
            ready = [lp for start, lp in self._logprobs if start < end or (final and not self.stopped)]
            self._logprobs = []
        else:
            ready = [lp for start, lp in self._logprobs if start < end]
            self._logprobs = [(s, lp) for s, lp in self._logprobs if s >= end]
        if not out and not ready:
            return None
        return Delta(out, tuple(ready))


def _stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


# ------------------------------------------------------------------ the engine


class Job:
    """One request in the engine. `cancel()` is safe from any thread."""

    _ids = itertools.count(1)

    def __init__(self, engine: Engine, request: GenerationRequest, sink: Callable[[Event], None],
                 session: Session, timeout: float):
        self.id = next(self._ids)
        self.request = request
        self.sink = sink
        self.session = session
        self.submitted_at = time.monotonic()
        self.deadline = self.submitted_at + timeout
        self.started = threading.Event()
        self.done = threading.Event()
        self._engine = engine
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()
        self._engine._drop(self)


@dataclass
class EngineTotals:
    """Totals over the engine's life (for /stats and logs)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    spec: SpecCounters = field(default_factory=SpecCounters)


class Engine:
    """See the module docstring. `backend` defaults to plain decoding of `model`."""

    def __init__(self, model, tokenizer, *, max_context: int = 32768, prefill_chunk_size: int = 512,
                 max_queue: int = 64, queue_timeout: float = 600.0, backend=None, draft_name: str | None = None):
        if max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {max_context}")
        if max_queue < 1 or queue_timeout <= 0:
            raise ValueError("max_queue must be >= 1 and queue_timeout > 0")
        self.model = model
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.backend = backend or PlainDecoder(model, max_context, prefill_chunk_size)
        self.draft_name = draft_name
        self.stop_ids = frozenset(tokenizer.eos_token_ids) | frozenset(getattr(model.args, "eos_token_ids", ()))
        self.vocab_size = model.args.vocab_size
        self.session = Session()  # the default: requests without their own session share it
        self.totals = EngineTotals()
        self._queue: deque[Job] = deque()
        self._lock = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="monolith-engine", daemon=True)
        self._thread.start()
        _ENGINES.add(self)

    # ---------------------------------------------------------------- public

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return 0 if self._running is None else 1

    def new_session(self) -> Session:
        return Session()

    @property
    def supports_logprobs(self) -> bool:
        return getattr(self.backend, "logprobs", False)

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        return check_prompt(prompt_ids, self.vocab_size, self.max_context)

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None], session: Session | None = None,
               timeout: float | None = None) -> Job:
        """Queue a request; raise QueueFull when max_queue requests already wait. The
        request is dropped with a QueueTimeout if it has not started by its deadline."""
        self.check_prompt(request.prompt_ids)
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.logprobs}")
        if request.logprobs is not None and not self.supports_logprobs:
            raise ValueError("logprobs are not available with this backend (speculative decoding)")
        job = Job(self, request, sink, session or self.session, self.queue_timeout if timeout is None else timeout)
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is closed")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self._queue.append(job)
            self._lock.notify_all()
        return job

    def generate(self, request: GenerationRequest, session: Session | None = None) -> tuple[str, Finished]:
        """Run one request to the end (blocking): (text, Finished)."""
        events: list[Event] = []
        job = self.submit(request, events.append, session)
        job.done.wait()
        for e in events:
            if isinstance(e, Failed):
                raise e.error
        return "".join(e.text for e in events if isinstance(e, Delta)), events[-1]

    def warmup(self) -> None:
        """One short generation on the worker thread (allocates the cache, builds the
        kernels), then forget it."""
        session = self.new_session()
        self.generate(GenerationRequest((0, 1), max_tokens=2), session)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel the running request, fail the queued ones, stop the worker."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            if self._running is not None:
                self._running._cancelled.set()
            self._lock.notify_all()
        for job in queued:
            self._emit(job, Failed(EngineClosed("the engine was closed")))
            job.done.set()
        self._thread.join(timeout)

    # ---------------------------------------------------------------- worker

    def _drop(self, job: Job) -> None:
        with self._lock:
            try:
                self._queue.remove(job)
            except ValueError:
                return  # running or finished: the worker sees the flag at the next token
        self._emit(job, Finished("cancelled", Usage(len(job.request.prompt_ids), 0, 0), ()))
        job.done.set()

    def _work(self) -> None:
        try:
            self._serve_queue()
        finally:
            release_thread_streams()

    def _serve_queue(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                job = self._running = self._queue.popleft()
            try:
                if job.cancelled:
                    self._emit(job, Finished("cancelled", Usage(len(job.request.prompt_ids), 0, 0), ()))
                elif time.monotonic() > job.deadline:
                    self._emit(job, Failed(QueueTimeout(
                        f"the request waited {time.monotonic() - job.submitted_at:.1f} s in the queue")))
                else:
                    self._run(job)
            finally:
                with self._lock:
                    self._running = None
                job.done.set()

    def _run(self, job: Job) -> None:
        request = job.request
        queued = time.monotonic() - job.submitted_at
        job.started.set()
        self._emit(job, Started(queued))
        text = TextStream(self.tokenizer, request.stop)

        def on_token(token_id: int, logprob: TokenLogprob | None) -> bool:
            delta = text.add(token_id, logprob)
            if delta is not None:
                self._emit(job, delta)
            return not (text.stopped or job.cancelled)

        try:
            outcome = self.backend(job.session, request.prompt_ids, request.max_tokens, request.params,
                                   self.stop_ids, on_token, logprobs=request.logprobs,
                                   cancelled=lambda: job.cancelled)
        except Exception as e:  # noqa: BLE001 - reported to the request; the engine keeps serving
            job.session.reset()
            self._emit(job, Failed(e))
            return
        tail = text.finish()
        if tail is not None:
            self._emit(job, tail)
        if text.stopped:
            finish = "stop"
        elif outcome.finish_reason == "abort":
            finish = "cancelled"
        else:
            finish = outcome.finish_reason
        generated = len(outcome.token_ids) + outcome.stop_token
        usage = Usage(outcome.prompt_tokens, generated, outcome.cached_tokens)
        t = self.totals
        t.requests += 1
        t.prompt_tokens += usage.prompt_tokens
        t.cached_tokens += usage.cached_tokens
        t.generated_tokens += generated
        t.prefill_seconds += outcome.prefill_seconds
        t.decode_seconds += outcome.decode_seconds
        t.decode_steps += outcome.decode_steps
        if outcome.spec is not None:
            t.spec = t.spec + outcome.spec
        self._emit(job, Finished(finish, usage, tuple(outcome.token_ids), queued, outcome.prefill_seconds,
                                 outcome.decode_seconds, outcome.decode_steps, outcome.spec))

    @staticmethod
    def _emit(job: Job, event: Event) -> None:
        try:
            job.sink(event)
        except Exception:  # noqa: BLE001 - a consumer that went away must not stop the engine
            job._cancelled.set()
