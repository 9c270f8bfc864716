"""A request through the engine, for the HTTP app (app.py) and the Responses WebSocket
(responses/websocket.py): submitted, waited on until it has left the queue and resumed
(`start`), then its reply collected (`respond`) or streamed (`progress`, `stream`)
through the API's reply format (reply_format.py). Engine events cross from the worker
thread into asyncio through an `EventBridge`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..runtime.events import (
    ContextLengthError,
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    RequestError,
    Resumed,
    Started,
)
from ..runtime.grammar import Grammar
from ..runtime.jobs import EngineClosed, QueueFull, QueueTimeout
from ..runtime.pipeline import PipelineError
from .errors import APIError, ContextOverflow, bad
from .metrics import Metrics
from .reply_format import Cancellable, ReplyFormat, Resumable, StreamFormat

log = logging.getLogger("monolith.serve")


@dataclass(frozen=True)
class Prompt:
    """An encoded prompt as a handler submits it, with what came with it."""

    ids: Sequence[int]
    param: str  # the request's field that holds it, named in a 400 ("messages", "prompt", "input")
    boundaries: tuple[int, ...] = ()  # where its chat messages end (tokenizer.message_ends): prompt-cache saves
    constraint: Grammar | None = None  # the output's grammar
    images: tuple = ()  # models.image_inputs.PreparedImage, in prompt order
    draft: bool = False  # monolith.draft: draft every round (a chat request's, openai/speculation.py)


class Driver:
    """The engine driving of the app's handlers (`state`: app.ServerState: its config,
    metrics)."""

    def __init__(self, state):
        self.state = state

    async def generate(self, request: Request, engine, req, fmt, prompt: Prompt, started: float) -> Response:
        job, events = await self.start(engine, req, fmt, prompt, started, request)
        return await self.respond(request, job, events, fmt, req)

    def generation_request(self, engine, req, prompt: Prompt) -> GenerationRequest:
        """What the engine runs of a parsed request (`req`: its generation fields) and its
        encoded prompt: the one place a GenerationRequest is made of a request, under the
        server's output cap."""
        limit, max_tokens = self.state.config.max_tokens_limit, req.max_tokens
        if max_tokens is None:  # the server's default output cap (requests.SamplingDefaults)
            max_tokens = self.state.defaults_for(engine).max_tokens
        if limit is not None:
            max_tokens = limit if max_tokens is None else min(max_tokens, limit)
        if prompt.draft and not engine.can_draft:
            raise bad("monolith.draft: this server holds no drafter (start it with a draft: --draft, or the demo "
                      "pair without --no-draft)", "monolith.draft")
        return GenerationRequest(tuple(prompt.ids), max_tokens, req.params, req.stop, req.logprobs,
                                 tuple(prompt.boundaries), prompt.constraint, tuple(prompt.images), prompt.draft)

    async def start(self, engine, req, fmt, prompt: Prompt, started: float, request: Request | None = None):
        """Submit a request to the engine and wait until it has left the queue (bounded by
        its deadline) and resumed: (the job, its events). The job is cancelled if this is
        cancelled, or if `request`'s client disconnects meanwhile."""
        gen = self.generation_request(engine, req, prompt)
        events = EventBridge(asyncio.get_running_loop(), self.state.metrics, started)
        try:
            job = engine.submit(gen, events.put)
        except ContextLengthError as e:
            raise ContextOverflow(e.prompt_tokens, e.max_context, prompt.param) from None
        except RequestError as e:
            raise bad(str(e), prompt.param if e.field == "prompt" else e.field) from None
        except QueueFull as e:
            raise APIError(429, f"{e}; retry later", code="queue_full") from None
        except EngineClosed:
            raise APIError(503, "the server is shutting down", code="shutting_down") from None
        by_id = isinstance(fmt, Cancellable)  # its response can be cancelled by id (responses/routes.py)
        if by_id:
            fmt.submitted(job)
        try:
            cached = await self._wait_started(request, job, events, by_id)
        except BaseException:
            end(job, fmt)
            raise
        if isinstance(fmt, Resumable):
            fmt.resumed(cached)
        return job, events

    async def respond(self, request: Request, job, events: EventBridge, fmt: ReplyFormat, req) -> Response:
        """A started request's reply: streamed, or collected."""
        if req.stream:
            return StreamingResponse(self.stream(job, events, fmt, req.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:  # the response is read before the job ends: a format may be told (`ended`) and move on
            return JSONResponse(fmt.response(await self.collect(request, job, events, fmt)))
        finally:
            end(job, fmt)

    async def collect(self, request: Request, job, events: EventBridge, fmt: ReplyFormat) -> Finished:
        """A started request's deltas into `fmt`, until its Finished (returned); the job
        is cancelled if `request`'s client disconnects meanwhile. The caller ends the job
        (`end`) once it has read what it needs of `fmt`."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        try:
            while True:
                event = await events.get()
                if isinstance(event, Delta):
                    fmt.collect(event)
                elif isinstance(event, Finished):
                    return event
                elif isinstance(event, Failed):
                    raise engine_error(event.error)
        finally:
            watcher.cancel()

    async def _wait_started(self, request: Request | None, job, events: EventBridge, by_id: bool = False) -> int:
        """Wait until the request has left the queue (bounded by its deadline) and resumed:
        the prompt tokens it resumed with. Cancelled before that, it is a 499 (its client
        has gone), unless it can be cancelled `by_id`: then its format finishes it."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job)) if request is not None else None
        started = False
        try:
            while True:
                left = job.deadline - time.monotonic()
                if left <= 0 and not started:
                    raise engine_error(QueueTimeout("the request timed out waiting in the queue"))
                try:
                    event = await events.get(None if started else left)
                except asyncio.TimeoutError:
                    continue
                if isinstance(event, Started):
                    started = True
                elif isinstance(event, Resumed):
                    return event.cached_tokens
                elif isinstance(event, Failed):
                    raise engine_error(event.error)
                elif isinstance(event, Finished) and by_id:
                    events.unget(event)  # for the format's finished response
                    return 0
                elif isinstance(event, Finished):  # cancelled while queued or prefilling: the client has gone
                    raise APIError(499, "the request was cancelled", code="cancelled")
        finally:
            if watcher is not None:
                watcher.cancel()

    async def progress(self, events: EventBridge, fmt: StreamFormat, include_usage: bool):
        """A started request's stream chunks (dicts, not yet numbered or framed), as the
        engine produces them: None when nothing came for `keepalive_seconds`, and last an
        APIError if generation failed. The caller cancels the job when it is done."""
        keepalive = self.state.config.keepalive_seconds
        for chunk in fmt.stream_start(include_usage):
            yield chunk
        while True:
            try:
                event = await events.get(keepalive)
            except asyncio.TimeoutError:
                yield None
                continue
            if isinstance(event, Delta):
                for chunk in fmt.stream_delta(event, include_usage):
                    yield chunk
            elif isinstance(event, Finished):
                for chunk in fmt.stream_finish(event, include_usage):
                    yield chunk
                return
            elif isinstance(event, Failed):
                yield engine_error(event.error)
                return

    async def stream(self, job, events: EventBridge, fmt: StreamFormat, include_usage: bool):
        """Server-Sent Events of `progress`."""
        try:
            async with aclosing(self.progress(events, fmt, include_usage)) as chunks:
                async for chunk in chunks:
                    if chunk is None:
                        yield fmt.keepalive()
                    elif isinstance(chunk, APIError):
                        yield fmt.failure(chunk)
                    else:
                        yield fmt.event(chunk)
            yield fmt.end()
        finally:
            end(job, fmt)  # the client went away (the task is cancelled) or we are done


class EventBridge:
    """Engine events (pushed on the worker thread) into an asyncio queue. The metrics of
    a request are recorded here, on the worker thread, so that a request whose client
    has gone (nobody reads its queue any more) is counted too. `get` hands out the text
    deltas that queued up while the reader was busy as one (one chunk, not one a token,
    when the event loop falls behind several streams)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: Metrics, started: float):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.metrics = metrics
        self.started = started
        self.first_token: float | None = None
        self._next = None  # an event taken off the queue behind the deltas `get` joined

    def put(self, event) -> None:
        if isinstance(event, Delta) and self.first_token is None:
            self.first_token = time.monotonic() - self.started
        elif isinstance(event, Finished):
            self.metrics.observe(event, self.first_token, time.monotonic() - self.started)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def unget(self, event) -> None:
        """Hand `event` out again, first."""
        self._next = event

    async def get(self, timeout: float | None = None):
        """The next event, within `timeout` seconds (asyncio.TimeoutError), with the
        deltas queued right behind a delta joined to it."""
        if self._next is not None:
            event, self._next = self._next, None
        elif not self.queue.empty():
            event = self.queue.get_nowait()
        else:
            event = await asyncio.wait_for(self.queue.get(), timeout)
        if not isinstance(event, Delta):
            return event
        deltas = [event]
        while not self.queue.empty():
            more = self.queue.get_nowait()
            if not isinstance(more, Delta):
                self._next = more
                break
            deltas.append(more)
        return Delta.join(deltas)


async def _cancel_on_disconnect(request: Request, job) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def end(job, fmt: ReplyFormat) -> None:
    """A request's handler is done with it: its job is cancelled (a no-op once finished)
    and a format that asks (`ended`) is told."""
    job.cancel()
    if isinstance(fmt, Cancellable):
        fmt.ended()


def engine_error(error: Exception) -> APIError:
    if isinstance(error, QueueTimeout):
        return APIError(503, f"{error}; the server is busy, retry later", code="queue_timeout")
    if isinstance(error, EngineClosed):
        return APIError(503, "the server is shutting down", code="shutting_down")
    if isinstance(error, PipelineError):
        log.error("generation failed: %s", error)
        return APIError(503, str(error), code="model_unavailable")
    if isinstance(error, RequestError):  # the engine's check of the request itself
        return bad(str(error), error.field)
    # anything else, a ValueError too, is our own failure: the client's request was valid
    log.error("generation failed: %s: %s", type(error).__name__, error, exc_info=error)
    return APIError(500, "generation failed (the server log has the details)", code="internal_error")
