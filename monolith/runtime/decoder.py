"""The decoders: one loop (rounds.py) on a `Session`, with or without a drafter.

A decoder is called as `decoder(session, prompt, max_tokens, params, stop_ids, on_token,
logprobs=None, cancelled=..., boundaries=(), guide=None) -> Outcome`, or as a generator
of its forwards (`steps`, batch.py: the engine runs it in a Batch with other
sequences); its arguments were checked at the boundary (events.check_request).
`Decoder` declares what the engine reads of a decoder besides that (`logprobs`, `kinds`,
`drafter`), with the defaults of one that gives none of them (a test's scripted decoder).
`PlainDecoder` never drafts; `SpeculativeDecoder` drafts with a drafter (drafter.py).
Both resume, prefill, decode and keep their state the same way:

- the session resumes from its longest restore point or prompt-cache saved state that
  leaves at least one prompt token to prefill (the same prompt again: its last token);
- the prefill runs the rest in chunks, saving prompt-cache states at the session's
  stops (`Session.stops`: every N tokens, the message `boundaries`, the prompt's end and
  one token before it); a cancel takes effect between chunks, keeping what was
  prefilled;
- rounds emit tokens to `on_token(id, logprob)` (with `kinds=True`: `on_token(id,
  logprob, how)`, how the token came: `token_kinds`) until a stop token (not output),
  max_tokens or the context's end, or `on_token` returning False;
- at the end the cache holds the prompt and every emitted token but the last, which is
  kept as a restore point and a saved state.

Logprobs come from the target's rows that chose each token: the verify rows for
accepted, corrected and bonus tokens, the step's row in a plain round. A prompt that
extends the session's tokens prefills only its new ones: the drafter's context snapshot
is kept with the session (a drafter that cannot resume prefills every prompt whole).
With a `break_even` (a round's cost in plain steps: a number, or a scheduler.CostCurve
of the context, calibrate.measure_cost_curve), each conversation gets a
fallback.Fallback: rounds become plain steps while drafting does not pay at the
sequence's context; a prompt that extends the session (the next turn) goes on with the
state the last request left.
A `guide` (grammar.Guide) constrains the output (rounds.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ..sampling import SamplingParams
from .batch import Steps, drive
from .calibrate import calibrate_cost_scheduler
from .drafter import Drafter, Forking
from .events import ACCEPTED, BONUS, CORRECTION, PLAIN, Outcome, TokenLogprob
from .rounds import RoundResult, Rounds, check_gamma
from .fallback import Fallback
from .scheduler import CostCurve, CostScheduler, Scheduler, StepCosts
from .session import Session


class Decoder:
    """What the engine asks of a decoder (engine.py, jobs.py): `steps(...)` (batch.py),
    and what it can do."""

    logprobs = False  # gives each token's logprob (a request's `logprobs`)
    kinds = False  # steps(kinds=True) tells on_token how each token came
    drafter: Drafter | None = None  # what it drafts with (None: plain steps)

    def steps(self, session: Session, prompt: Sequence[int], max_tokens: int | None, params: SamplingParams,
              stop_ids, on_token: Callable[[int, TokenLogprob | None], bool], **options) -> Steps:
        raise NotImplementedError


class SpeculativeDecoder(Decoder):
    """The one decode loop; `drafter` None decodes plainly (see PlainDecoder)."""

    logprobs = True  # from the target's rows (logprobs.py)
    kinds = True  # steps(kinds=True) tells on_token how each token came

    def __init__(self, model, drafter: Drafter | None, max_context: int, prefill_chunk_size: int = 512,
                 gamma: int | None = None, scheduler: Scheduler | None = None,
                 break_even: float | CostCurve | None = None,
                 profile: bool = False, on_round: Callable[[RoundResult, Rounds], None] | None = None,
                 step_costs: StepCosts | None = None):
        """`scheduler` is kept across requests (adaptive schedulers learn); a cost
        scheduler without timings is calibrated here, once. `profile` times each round's
        stages (more host syncs); `on_round(result, rounds)` sees each round after its
        commit."""
        self.model, self.drafter = model, drafter
        self.max_context = max_context
        if prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size!r}")
        self.prefill_chunk_size = prefill_chunk_size
        self.gamma = 0 if drafter is None else check_gamma(gamma, drafter.max_proposals)
        self.scheduler = scheduler
        if isinstance(scheduler, CostScheduler) and not scheduler.calibrated:
            calibrate_cost_scheduler(scheduler, model, drafter, self.gamma, max_context)
        self.cost_curve = break_even if break_even is None or isinstance(break_even, CostCurve) \
            else CostCurve.flat(break_even)  # a round's cost in plain steps by context: the fallback's
        self.step_costs = step_costs  # a batch's forward costs: the fallback's break-even follows the batch
        self.profile = profile
        self.on_round = on_round

    def __call__(self, session: Session, prompt: Sequence[int], max_tokens: int | None, params: SamplingParams,
                 stop_ids, on_token: Callable[[int, TokenLogprob | None], bool], logprobs: int | None = None,
                 cancelled: Callable[[], bool] = lambda: False, boundaries: Sequence[int] = (),
                 guide=None, on_resume: Callable[[int], None] = lambda cached: None, images=None,
                 kinds: bool = False) -> Outcome:
        return drive(self.steps(session, prompt, max_tokens, params, stop_ids, on_token, logprobs, cancelled,
                                boundaries, guide, on_resume, images, kinds))

    def steps(self, session: Session, prompt: Sequence[int], max_tokens: int | None, params: SamplingParams,
              stop_ids, on_token: Callable[[int, TokenLogprob | None], bool], logprobs: int | None = None,
              cancelled: Callable[[], bool] = lambda: False, boundaries: Sequence[int] = (),
              guide=None, on_resume: Callable[[int], None] = lambda cached: None, images=None,
              kinds: bool = False) -> Steps:
        """The call as a generator of its draft blocks and forwards (batch.py), on a drafter
        of its own when the drafter forks; `on_resume(cached)` is told how many prompt
        tokens it resumed with, before the prefill. With `images` (images.PromptImages),
        `prompt` is its key: the sessions and the prompt cache see the key, the target the
        real ids and the images. `kinds`: `on_token(id, logprob, how)` (token_kinds)."""
        max_context, prompt = self.max_context, list(prompt)
        room = max_context - len(prompt)
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        start = time.perf_counter()
        drafter = self.drafter
        if isinstance(drafter, Forking):
            drafter = drafter.fork()
        rounds = self._resume(session, drafter, prompt, params, logprobs, guide)
        cached = rounds.cache.offset
        on_resume(cached)
        resumable = drafter is None or drafter.snapshot() is not None

        def save_state(end: int) -> None:
            if end == len(prompt) - 1 and resumable:  # the same prompt again resumes here
                session.mark(prompt[:end])
            if resumable:  # the drafter's context as of now (it appends the rows it observed)
                session.save_state(prompt[:end], draft=None if drafter is None else drafter.snapshot())

        stops = session.stops(cached, len(prompt), boundaries)
        rows = prompt[cached:]
        if images is not None:
            stops, rows = [s for s in stops if not images.inside(s)], images.tokens[cached:]
        first = yield from rounds.prefill_steps(rows, self.prefill_chunk_size, stops, save_state, cancelled, images)
        if first is None:  # cancelled between prefill chunks: keep what was prefilled
            self._keep(session, rounds, prompt[:rounds.cache.offset])
            return Outcome([], "abort", len(prompt), cached, time.perf_counter() - start, 0.0, 0)
        emitted = [first]
        session.mark(prompt)
        first_at = time.perf_counter()
        try:
            out, finish, read = yield from run_rounds(
                rounds, emitted, max_tokens, frozenset(stop_ids),
                lambda token_id, logprob, *how: on_token(token_id, logprob, *how) and not cancelled(), self.on_round,
                kinds)
        finally:
            self._keep(session, rounds, prompt + emitted[:-1])
        end = time.perf_counter()
        return Outcome(out, finish, len(prompt), cached, first_at - start, end - first_at, read - 1, finish == "stop",
                       rounds.stats)

    @property
    def break_even(self) -> float | None:
        """A drafted round's cost in plain steps at the shortest context measured (None:
        no fallback)."""
        return None if self.cost_curve is None else self.cost_curve.points[0][1]

    def _resume(self, session: Session, drafter: Drafter | None, prompt: list[int], params: SamplingParams,
                logprobs: int | None, guide) -> Rounds:
        """The sequence's rounds on the session's cache, at the longest point both the
        cache and the drafter's context can resume from."""
        cache, cached = session.resume(self.model, prompt, self.max_context, drafter=drafter)
        rounds = Rounds(self.model, drafter, params, self.max_context, self.gamma, self.scheduler,
                        self.profile, cache=cache, logprobs=logprobs, guide=guide)
        if cached and drafter is not None and not drafter.restore(session.draft_snapshot, cached):
            session.reset()  # no draft context for this point: a saved state (which holds one), or start over
            _, cached = session.resume(self.model, prompt, self.max_context, drafter=drafter)
            if cached:
                drafter.restore(session.draft_snapshot, cached)
        if self.cost_curve is not None and guide is None and drafter is not None:  # a grammar: every round drafts
            kept = session.fallback if cached else None
            rounds.fallback = kept if kept is not None else Fallback(self.cost_curve, self.step_costs, self.gamma)
        return rounds

    def _keep(self, session: Session, rounds: Rounds, committed: list[int]) -> None:
        """After a run (or its failure): the cache holds the prompt and every emitted
        token but the last (the next anchor); keep that point with the drafter's context."""
        rounds.sync_drafter()
        drafting = rounds.drafter is not None
        snapshot = rounds.drafter.snapshot() if drafting else None
        if (snapshot is not None or not drafting) and rounds.cache.offset == len(committed):
            session.mark(committed)
            session.draft_snapshot, session.fallback = snapshot, rounds.fallback
            session.save_state(committed, draft=snapshot)
        else:
            session.reset()


def run_rounds(rounds: Rounds, emitted: list[int], budget: int, stops: frozenset[int],
               on_token: Callable[..., bool], on_round: Callable[[RoundResult, Rounds], None] | None = None,
               kinds: bool = False) -> Steps:
    """Hand out the tokens in `emitted` (the prefill's first one), then those of rounds,
    which `emitted` collects, each with its logprob (None without) and, with `kinds`, how
    it came (token_kinds) to `on_token`, until a stop token (not output: "stop"),
    `budget` output tokens ("length") or `on_token` returning False ("abort"). Returns
    (output, finish reason, tokens read); a generator of the rounds' steps (batch.py)."""
    out: list[int] = []
    pending, logprobs, read = list(emitted), [rounds.first_logprob] * len(emitted), 0
    hows = [PLAIN] * len(emitted)
    while True:
        for token, logprob, how in zip(pending, logprobs, hows):
            read += 1
            if token in stops:
                return out, "stop", read
            out.append(token)
            if not (on_token(token, logprob, how) if kinds else on_token(token, logprob)):
                return out, "abort", read
        if len(out) >= budget:
            return out, "length", read
        result = yield from rounds.round_steps(budget - len(out))
        if on_round is not None:
            on_round(result, rounds)
        pending = result.tokens
        logprobs = result.logprobs or [None] * len(pending)
        hows = token_kinds(result, rounds.drafter is not None)
        emitted += pending


def token_kinds(result: RoundResult, drafting: bool) -> list[str]:
    """How each token of a round came (events.ACCEPTED etc.): tokens[:accepted] are
    accepted proposals, the last one the correction when a proposal was rejected, else
    the bonus; a round without proposals, or without a drafter (under a grammar its
    forced tokens are verified as proposals: jump-forward), is plain steps."""
    if not drafting or result.proposed == 0:
        return [PLAIN] * len(result.tokens)
    last = CORRECTION if result.accepted < result.proposed else BONUS
    return [ACCEPTED] * result.accepted + [last]


class PlainDecoder(SpeculativeDecoder):
    """Plain decoding: the rounds of SpeculativeDecoder without a drafter, every round
    one pipelined step (jump-forward under a grammar)."""

    def __init__(self, model, max_context: int, prefill_chunk_size: int = 512):
        super().__init__(model, None, max_context, prefill_chunk_size)
