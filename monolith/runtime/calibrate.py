"""What a round costs on this machine, measured at start on a scratch sequence with the
decoder's own stages (rounds.Rounds: the same verify forward, acceptance and commit a
served round runs):

- `measure_costs`: T_draft and the T_verify(rows) table the cost scheduler reads;
- `measure_step_costs`: what a batch's target forward costs per row and per sequence
  (scheduler.StepCosts: the batch-aware Fallback and cost scheduler read it);
- `measure_break_even`: a drafted round's cost in plain steps (fallback.Fallback's
  threshold), as the median over several trials, each timing consecutive rounds
  against chained runs of pipelined plain steps. One start gives one answer only if
  the decision has a margin: `round_can_pay` drafts only when the break-even sits
  clearly (PAY_MARGIN) below the tokens a round can emit, because a break-even near
  the cut swings across it from start to start on a loaded machine;
- `measure_cost_curve`: the break-even at a few contexts (`curve_contexts`: 64 rows,
  then 2048 and 8192 where the context reaches them), a scheduler.CostCurve: the
  Fallback prices each round at the sequence's context with it. A start measures the
  longer contexts only once the short one says drafting can pay (where it cannot, as on
  MLX's Linux CPU wheel, the start decodes plainly and measures nothing more);
  `calibrate_cost_scheduler` does the same for the cost scheduler's timings;
- `measure_acceptance`: the proposals a drafter gets accepted per round, greedy, on the
  prompts it is given (the start's calibration prompts: drafter_choice.py weighs it
  against the break-even to pick the drafter that pays).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import mlx.core as mx

from ..sampling import SamplingParams
from .batch import Forward, run_forwards
from .drafter import Drafter
from .generation import Generation
from .rounds import PLAIN_RUN, Block, Rounds
from .scheduler import CostCurve, CostScheduler, FixedScheduler, StepCosts

PAY_MARGIN = 0.1  # draft only when a round costs at most (1 - PAY_MARGIN) x the tokens it can emit
BREAK_EVEN_TRIALS = 3
CURVE_CONTEXTS = (64, 2048, 8192)  # rows of context a round is priced at (the first: every measurement's default)


@dataclass(frozen=True)
class BreakEven:
    steps: float  # a drafted round's cost in plain steps: the median over trials
    trials: tuple[float, ...]

    def describe(self) -> str:
        low, high = min(self.trials), max(self.trials)
        return f"{self.steps:.1f} plain steps (median of {len(self.trials)} trials, {low:.1f}-{high:.1f})"


def scratch_rounds(model, drafter: Drafter, gamma: int, params: SamplingParams, context: int,
                   extra_rows: int) -> Rounds:
    """A sequence of `context` random prompt rows with room for `extra_rows` more.
    Restarts the drafter: call before the real sequence's `drafter.start`."""
    prompt = mx.random.randint(0, model.args.vocab_size, (context,), key=mx.random.key(0)).tolist()
    rounds = Rounds(model, drafter, Generation(params=params), context + extra_rows, gamma, FixedScheduler())
    rounds.prefill(prompt)
    mx.eval(rounds.cache.arrays(), drafter.arrays())
    return rounds


def median_seconds(run, repeats: int) -> float:
    """Median seconds of run() (which must evaluate its result) over `repeats` runs after
    one warm-up (compile, allocate); the benches time with it too."""
    run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_costs(model, drafter: Drafter, gamma: int, params: SamplingParams, context: int = 64,
                  repeats: int = 5) -> tuple[float, list[float]]:
    """(T_draft, [T_verify(1), ..., T_verify(gamma + 1)]) in seconds: medians of timed
    runs after a warm-up, each verify from the same snapshot."""
    rounds = scratch_rounds(model, drafter, gamma, params, context, gamma + 2)
    snap = rounds.cache.snapshot()
    key = None if params.greedy else mx.random.key(1)

    def draft():
        p = drafter.propose(rounds.anchor, gamma, params, key)
        mx.eval([a for a in (p.tokens, p.q, p.confidence) if a is not None])
        return p

    proposal = draft()

    def verify(rows: int):
        rounds.cache.restore(snap)
        block = Block(proposal, None, proposal.tokens[:rows - 1].astype(mx.int32), key)
        mx.eval(rounds.verify(block), block.features, rounds.cache.arrays())

    draft_seconds = median_seconds(draft, repeats)
    verify_seconds = [median_seconds(lambda r=rows: verify(r), repeats) for rows in range(1, gamma + 2)]
    rounds.cache.restore(snap)
    return draft_seconds, verify_seconds


def measure_step_costs(model, sequences: int, rows: int = 8, context: int = 64, repeats: int = 5) -> StepCosts:
    """StepCosts from medians of timed forwards on scratch sequences of `context` rows:
    one row of one sequence, `rows` rows of one, and one row each of `sequences`
    sequences in one batched forward (each from the same state)."""
    prompt = mx.random.randint(0, model.args.vocab_size, (context,), key=mx.random.key(0))
    caches = []
    for _ in range(max(sequences, 1)):
        cache = model.make_cache(context + rows + 1)
        model.forward(prompt, cache, logits="none")
        mx.eval(cache.arrays())
        caches.append((cache, cache.snapshot()))
    token = mx.zeros((1,), mx.int32)

    def timed(forwards) -> float:
        samples = []
        for i in range(repeats + 1):  # the first is a warm-up
            for cache, snap in caches:
                cache.restore(snap)
            begin = time.perf_counter()
            mx.eval([out[0] for out in run_forwards(forwards)])
            samples.append(time.perf_counter() - begin)
        return statistics.median(samples[1:])

    cache = caches[0][0]
    one = timed([Forward(model, token, cache)])
    many = timed([Forward(model, mx.zeros((rows,), mx.int32), cache)])
    per_row = max(many - one, 0.0) / max(rows - 1, 1)
    per_sequence = 0.0
    if sequences > 1:
        batch = timed([Forward(model, token, c) for c, _ in caches])
        per_sequence = max(batch - one - per_row * (sequences - 1), 0.0) / (sequences - 1)
    return StepCosts(one, per_row, per_sequence)


def measure_break_even(model, drafter: Drafter, gamma: int, params: SamplingParams, context: int = 64,
                       repeats: int = 6, trials: int = BREAK_EVEN_TRIALS) -> BreakEven:
    """A drafted round's cost in plain steps, as the decoder runs both: per trial, the
    time of `repeats` consecutive rounds (draft, verify of gamma + 1 rows, commit) per
    round over the time of `repeats` chained runs of PLAIN_RUN pipelined plain steps per
    step, each after a warm-up; the median over `trials`."""
    per_trial = (repeats + 1) * (gamma + 1 + PLAIN_RUN)
    rounds = scratch_rounds(model, drafter, gamma, params, context, trials * per_trial + 2)

    def seconds(run) -> float:
        run()  # warm-up
        mx.eval(rounds.cache.arrays())
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        mx.eval(rounds.cache.arrays(), rounds.unobserved)
        return time.perf_counter() - start

    ratios = []
    for _ in range(trials):
        round_seconds = seconds(lambda: rounds.round(gamma + 1)) / repeats
        step_seconds = seconds(lambda: rounds.run_plain(PLAIN_RUN, queue_next=True)) / (repeats * PLAIN_RUN)
        rounds.sync_drafter()
        ratios.append(round_seconds / step_seconds)
    return BreakEven(statistics.median(ratios), tuple(ratios))


def curve_contexts(max_context: int) -> tuple[int, ...]:
    """The contexts a start prices a round at: the short one, and the longer ones of
    CURVE_CONTEXTS that a sequence of `max_context` rows reaches."""
    first, *longer = CURVE_CONTEXTS
    return (first, *(c for c in longer if c < max_context))


def measure_cost_curve(model, drafter: Drafter, gamma: int, params: SamplingParams, max_context: int,
                       first: BreakEven | None = None) -> CostCurve:
    """The break-even at each of curve_contexts(max_context) (`first`: the short
    context's, measured already), as a CostCurve."""
    points = []
    for context in curve_contexts(max_context):
        if first is not None and context == CURVE_CONTEXTS[0]:
            measured = first
        else:
            measured = measure_break_even(model, drafter, gamma, params, context=context)
        points.append((context, measured.steps))
    return CostCurve(tuple(points))


def calibrate_cost_scheduler(scheduler: CostScheduler, model, drafter: Drafter, gamma: int, max_context: int) -> None:
    """The cost scheduler's timings (measure_costs) at each of curve_contexts(max_context);
    a sequential drafter's draft is priced per proposal."""
    proposals = gamma if drafter.sequential else None
    for i, context in enumerate(curve_contexts(max_context)):
        draft, verify = measure_costs(model, drafter, gamma, SamplingParams(), context)
        if i == 0:
            scheduler.set_costs(draft, verify, proposals, context)
        else:
            scheduler.add_costs(context, draft, verify, proposals)


@dataclass(frozen=True)
class Acceptance:
    """The proposals accepted in each greedy round of `gamma` proposals that verified
    all of them (rounds cut short by the token budget are not counted)."""

    gamma: int
    accepted: tuple[int, ...]

    def tokens(self, gamma: int | None = None) -> float:
        """The tokens a round of `gamma` (at most self.gamma) proposals emits on average:
        accepted + 1, each round's accepted count capped at `gamma` (for a sequential
        drafter exact round by round: its first proposals do not depend on how many
        follow). 1.0 when no round was measured."""
        g = self.gamma if gamma is None else gamma
        if not 1 <= g <= self.gamma:
            raise ValueError(f"gamma must be in [1, {self.gamma}], got {g}")
        if not self.accepted:
            return 1.0
        return 1 + sum(min(a, g) for a in self.accepted) / len(self.accepted)


def measure_acceptance(model, drafter: Drafter, gamma: int, prompts, max_new: int = 48,
                       stops=frozenset()) -> Acceptance:
    """Greedy speculative decoding of up to `max_new` tokens after each prompt (token
    ids), each round verifying all `gamma` proposals; a prompt's run ends at a token of
    `stops`. Restarts the drafter (as scratch_rounds does)."""
    accepted = []
    for prompt in prompts:
        rounds = Rounds(model, drafter, Generation(), len(prompt) + max_new + gamma + 2, gamma, FixedScheduler())
        latest, emitted = [rounds.prefill(prompt)], 1
        while emitted < max_new and not stops.intersection(latest):
            result = rounds.round(gamma + 1)
            if result.proposed == gamma:
                accepted.append(result.accepted)
            latest = result.tokens
            emitted += len(latest)
    return Acceptance(gamma, tuple(accepted))


def pays(cost: float, tokens: float) -> bool:
    """Does a round that costs `cost` plain steps and emits `tokens` pay? Only when it
    costs at most (1 - PAY_MARGIN) x those tokens (the module doc says why the margin)."""
    return cost <= (1 - PAY_MARGIN) * tokens


def round_pay_limit(gamma: int) -> float:
    """The largest break-even at which a drafted round of gamma proposals is worth
    running: it emits at most gamma + 1 tokens, less the margin."""
    return (1 - PAY_MARGIN) * (gamma + 1)


def round_can_pay(break_even: float, gamma: int) -> bool:
    """Can a drafted round of gamma proposals pay? Not when it costs about as many plain
    steps as the tokens it can emit, or more (then decode plainly)."""
    return pays(break_even, gamma + 1)
