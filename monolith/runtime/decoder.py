"""The decoder: one loop (rounds.py) on a `Session`, with or without a drafter.

A decoder is called as `decoder(generation) -> Outcome`, or as a generator of its
forwards (`steps(generation)`, batch.py: the engine runs it in a Batch with other
sequences); the generation (generation.Generation: the prompt, sampling, stop ids,
logprobs, boundaries, guide, images, session and emitter) was checked at the boundary
(events.check_request). `drafter` None decodes plainly; with a drafter (drafter.py) the
rounds draft. Either way it resumes, prefills, decodes and keeps its state the same way:

- the session resumes from its longest restore point or prompt-cache saved state that
  leaves at least one prompt token to prefill (the same prompt again: its last token);
- the prefill runs the rest in chunks, saving prompt-cache states at the session's
  stops (`Session.stops`: every N tokens, the message `boundaries`, the prompt's end and
  one token before it); a cancel (`emitter.cancelled()`) takes effect between chunks,
  keeping what was prefilled;
- rounds hand tokens to `emitter.token(id, logprob, kind)`, how each came:
  `token_kinds`) until a stop token (not output), max_tokens or the context's end, or
  the emitter returning False or cancelling;
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
from collections.abc import Callable

from .batch import Steps, drive
from .calibrate import calibrate_cost_scheduler
from .drafter import Drafter, Forking, check_gamma
from .events import ACCEPTED, BONUS, CORRECTION, PLAIN, Outcome
from .fallback import Fallback
from .generation import Emitter, Generation
from .rounds import RoundResult, Rounds
from .scheduler import CostCurve, CostScheduler, Scheduler
from .session import Session


class Decoder:
    """The one decode loop; `drafter` None decodes plainly (every round one pipelined
    step, jump-forward under a grammar). What the engine reads of it besides `steps`:
    `logprobs` (it gives each token's logprob) and `drafter`.

    Set after construction: `step_costs` (a batch's forward costs: the fallback's
    break-even follows the batch), `profile` (time each round's stages: more host
    syncs) and `on_round(result, rounds)`, which sees each round after its commit."""

    logprobs = True  # from the target's rows (logprobs.py)
    drafter: Drafter | None = None

    def __init__(self, model, drafter: Drafter | None, max_context: int, prefill_chunk_size: int = 512,
                 gamma: int | None = None, scheduler: Scheduler | None = None,
                 break_even: float | CostCurve | None = None):
        """`scheduler` is kept across requests (adaptive schedulers learn); a cost
        scheduler without timings is calibrated here, once."""
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
        self.step_costs = None
        self.profile = False
        self.on_round: Callable[[RoundResult, Rounds], None] | None = None

    def __call__(self, generation: Generation) -> Outcome:
        return drive(self.steps(generation))

    def steps(self, generation: Generation) -> Steps:
        """The call as a generator of its draft blocks and forwards (batch.py), on a drafter
        of its own when the drafter forks; the emitter is told how many prompt tokens it
        resumed with, before the prefill. With `images` (images.PromptImages), the prompt
        is its key: the sessions and the prompt cache see the key, the target the real ids
        and the images."""
        g, session, emitter = generation, generation.session, generation.emitter
        prompt, images = list(g.prompt), g.images
        room = self.max_context - len(prompt)
        max_tokens = room if g.max_tokens is None else min(g.max_tokens, room)
        start = time.perf_counter()
        drafter = self.drafter
        if isinstance(drafter, Forking):
            drafter = drafter.fork()
        rounds = self._resume(generation, drafter, prompt)
        cached = rounds.cache.offset
        emitter.resumed(cached)
        resumable = drafter is None or drafter.snapshot() is not None

        def save_state(end: int) -> None:
            if end == len(prompt) - 1 and resumable:  # the same prompt again resumes here
                session.mark(prompt[:end])
            if resumable:  # the drafter's context as of now (it appends the rows it observed)
                session.save_state(prompt[:end], draft=None if drafter is None else drafter.snapshot())

        stops = session.stops(cached, len(prompt), g.boundaries)
        rows = prompt[cached:]
        if images is not None:
            stops, rows = [s for s in stops if not images.inside(s)], images.tokens[cached:]
        first = yield from rounds.prefill_steps(rows, self.prefill_chunk_size, stops, save_state)
        if first is None:  # cancelled between prefill chunks: keep what was prefilled
            self._keep(session, rounds, prompt[:rounds.cache.offset])
            return Outcome([], "abort", len(prompt), cached, time.perf_counter() - start, 0.0, 0)
        emitted = [first]
        session.mark(prompt)
        first_at = time.perf_counter()
        try:
            out, finish, read = yield from run_rounds(rounds, emitted, max_tokens, frozenset(g.stop_ids), emitter,
                                                      self.on_round)
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

    def _resume(self, generation: Generation, drafter: Drafter | None, prompt: list[int]) -> Rounds:
        """The sequence's rounds on the session's cache, at the longest point both the
        cache and the drafter's context can resume from."""
        session = generation.session
        cache, cached = session.resume(self.model, prompt, self.max_context, drafter=drafter)
        rounds = Rounds(self.model, drafter, generation, self.max_context, self.gamma, self.scheduler, cache)
        rounds.profile = self.profile
        if cached and drafter is not None and not drafter.restore(session.draft_snapshot, cached):
            session.reset()  # no draft context for this point: a saved state (which holds one), or start over
            _, cached = session.resume(self.model, prompt, self.max_context, drafter=drafter)
            if cached:
                drafter.restore(session.draft_snapshot, cached)
        # a fallback for a drafting sequence; under an engaged grammar every round drafts
        if self.cost_curve is not None and rounds.guide is None and drafter is not None:
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


def run_rounds(rounds: Rounds, emitted: list[int], budget: int, stops: frozenset[int], emitter: Emitter,
               on_round: Callable[[RoundResult, Rounds], None] | None = None) -> Steps:
    """Hand out the tokens in `emitted` (the prefill's first one), then those of rounds,
    which `emitted` collects, each with its logprob (None without) and how it came
    (token_kinds) to `emitter.token`, until a stop token (not output: "stop"), `budget`
    output tokens ("length") or the emitter returning False or cancelling ("abort").
    Returns (output, finish reason, tokens read); a generator of the rounds' steps
    (batch.py)."""
    out: list[int] = []
    pending, logprobs, read = list(emitted), [rounds.first_logprob] * len(emitted), 0
    hows = [PLAIN] * len(emitted)
    while True:
        for token, logprob, how in zip(pending, logprobs, hows):
            read += 1
            if token in stops:
                return out, "stop", read
            out.append(token)
            if not emitter.token(token, logprob, how) or emitter.cancelled():
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
