"""One generation as the decoder runs it: a `Generation`, the request made whole for
the runtime (its prompt as the caches see it, sampling, stop ids, logprobs, message
boundaries, grammar guide, images and session) with its `Emitter`, which the decoder
tells each token and how many prompt tokens it resumed with, and asks whether to stop.
`Decoder.steps`, `Rounds` and `prefill_rows` take it whole.

The emitter is how a generation reports up: the decoder calls it and never a function
of its caller's. `Reporter` is the emitter of a request in the engine (jobs.Job): it
turns tokens into the request's events through its sink (Started, Resumed, Deltas:
text that is whole UTF-8 characters and cannot be the start of a stop string, held for
the round and sent together, `release`; then one Finished or Failed). `Tokens` hands
each token to a function (engine.run_decoder, the tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..sampling import SamplingParams
from .events import (
    PLAIN,
    Delta,
    Event,
    Failed,
    Finished,
    Outcome,
    Resumed,
    Started,
    TokenLogprob,
    Usage,
)
from .session import Session
from .textstream import TextStream


class Emitter:
    """What a generation tells and asks of its caller, with the answers of one that
    wants nothing: every token taken, never cancelled."""

    def token(self, token_id: int, logprob: TokenLogprob | None, kind: str = PLAIN) -> bool:
        """The next output token, its logprob (None without) and how it came
        (events.ACCEPTED etc.); False: stop here."""
        return True

    def resumed(self, cached: int) -> None:
        """The generation resumed with `cached` prompt tokens (before its prefill)."""

    def cancelled(self) -> bool:
        """Stop now (checked between prefill chunks and after each token)."""
        return False


class Tokens(Emitter):
    """Each token to `on_token(id, logprob)` (False from it: stop here); `cancelled()`
    asked between prefill chunks and after each token."""

    def __init__(self, on_token: Callable[[int, TokenLogprob | None], bool] = lambda token_id, logprob: True,
                 cancelled: Callable[[], bool] = lambda: False):
        self.on_token, self.is_cancelled = on_token, cancelled

    def token(self, token_id: int, logprob: TokenLogprob | None, kind: str = PLAIN) -> bool:
        return bool(self.on_token(token_id, logprob))

    def cancelled(self) -> bool:
        return self.is_cancelled()


@dataclass
class Generation:
    """One sequence to generate, as checked at the engine's boundary
    (events.check_request): the decoders trust it."""

    prompt: Sequence[int] = ()  # as the caches see it: the ids, or with images their key (images.PromptImages)
    max_tokens: int | None = None  # None: until a stop token or the context's end
    params: SamplingParams = SamplingParams()
    stop_ids: frozenset[int] = frozenset()  # tokens that end the output (not output themselves)
    logprobs: int | None = None  # None: off; k: each token's logprob and the k likeliest
    boundaries: Sequence[int] = ()  # where the prompt's messages end: prompt-cache saves
    guide: object = None  # a grammar.Guide constraining the output
    images: object = None  # images.PromptImages of a prompt with images (`prompt` is its key)
    session: Session = field(default_factory=Session)
    emitter: Emitter = field(default_factory=Emitter)


class Reporter(Emitter):
    """A request's events through `sink` (called on the engine's worker thread). A sink
    that fails (a consumer that went away) cancels the request and never stops the
    engine; `cancel()` is safe from any thread."""

    def __init__(self, sink: Callable[[Event], None]):
        self.sink = sink
        self.held: list[Delta] = []  # this round's text, sent when the round is over (`release`)
        self.text: TextStream | None = None  # from `start`
        self._cancelled = threading.Event()

    def emit(self, event: Event) -> None:
        try:
            self.sink(event)
        except Exception:  # noqa: BLE001 - a consumer that went away must not stop the engine
            self._cancelled.set()

    def cancel(self) -> None:
        self._cancelled.set()

    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def start(self, tokenizer, stop: Sequence[str], queued: float) -> None:
        """The request leaves the queue: its text is cut at the `stop` strings."""
        self.text = TextStream(tokenizer, stop)
        self.emit(Started(queued))

    def token(self, token_id: int, logprob: TokenLogprob | None, kind: str = PLAIN) -> bool:
        delta = self.text.add(token_id, logprob, kind)
        if delta is not None:
            self.held.append(delta)  # sent after the batch's round (Engine._serve_queue)
        return not (self.text.stopped or self.cancelled())

    def resumed(self, cached: int) -> None:
        self.emit(Resumed(cached))

    def release(self) -> None:
        """Send the text this round held back, as one Delta."""
        if self.held:
            held, self.held = self.held, []
            self.emit(Delta.join(held))

    def failed(self, error: Exception) -> None:
        self.release()
        self.emit(Failed(error))

    def finished(self, outcome: Outcome, queued: float) -> None:
        """The decoder's outcome as the request's last events: the text held back by a
        possible stop string, then Finished."""
        tail = self.text.finish()
        if tail is not None:
            self.held.append(tail)
        self.release()
        if self.text.stopped:
            finish = "stop"
        elif outcome.finish_reason == "abort":
            finish = "cancelled"
        else:
            finish = outcome.finish_reason
        generated = len(outcome.token_ids) + outcome.stop_token
        usage = Usage(outcome.prompt_tokens, generated, outcome.cached_tokens)
        self.emit(Finished(finish, usage, tuple(outcome.token_ids), queued, outcome.prefill_seconds,
                           outcome.decode_seconds, outcome.decode_steps, outcome.speculative))
