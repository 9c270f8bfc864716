"""Block schedulers: how many of the gamma proposals a round verifies (docs/drafts.md 4.2).

- `fixed`: all gamma.
- `threshold`: cut before the first position whose survival a_j = prod_{i<=j} c_i
  falls below a threshold (default 0.1).
- `cost`: the l maximizing the expected tokens per second
  (1 + sum_{j<=l} a_j) / (T_draft(l) + T_verify(1 + l)), scanning l = 0, 1, ... and
  stopping at the first l that does not improve on the one before. T_draft and the
  T_verify table (rows 1..gamma+1) are measured at warm-up by calibrate.measure_costs:
  medians of timed stages on a scratch sequence at a short context, kept for the whole run.
  A block drafter (DSpark) pays one forward for any l: T_draft(l) = T_draft. A sequential
  one (the MTP head: one head forward per proposal; drafter.py `sequential`) pays per
  proposal: T_draft(l) = l * T_draft(gamma) / gamma, and its round drafts only the l
  chosen (rounds.py asks before drafting).

Whatever l is chosen, it is chosen from the draft's side alone (confidences, past
rounds), never from the target's verdict on this round, so the output distribution is
that of the target (rejection sampling stays exact for any l).

Survival estimates, per position j = 1..max_proposals, learned online from the
rounds' verdicts with exponential forgetting (DECAY per round, so the estimates follow a
drifting prompt and an estimate no round observes drifts back to its prior):
- with a confidence head: a_j = min(1, raw a_j * r_j), where r_j = (observed + 1) /
  (predicted + 1) over the rounds that verified position j: observed counts the rounds
  that accepted j, predicted sums the raw survivals the head gave j in those rounds
  (a running ratio of observed to predicted survival; r_j = 1 before any round);
- without one: a_j = prod_{i<=j} rate_i with rate_i the conditional acceptance at i
  ((accepted + 1) / (reached + 1): optimistic, 1, before any round reaches i).
Both schedulers verify at least `min_proposals` (default 1) proposals when any are
available: with l = 0 no position is ever observed again and the online estimates could
lock the scheduler at l = 0 for good; one extra verify row is cheap.

`choose` reads the confidences on the host, which costs one more host sync per round
(the verify's shape depends on them); `fixed`, and the others without a confidence
head, add none.

`Fallback` decides before a round whether to draft at all: while the recent rounds'
tokens per round stay below the break-even (a round's cost in plain steps, measured
once by calibrate.measure_break_even), rounds are plain one-row steps, with a
speculative probe after PROBE_EVERY of them (waits doubling while probes fail) to
notice when drafting pays again. The decision depends only on past rounds, so outputs
keep their distribution (greedy: equal to plain).

In a batch (engine --max-batch) a drafted round's rows share a forward with the other
sequences' rows, so what it costs depends on the batch: `peers` = (the other sequences,
the target rows they put into the last forward). With the batch's `StepCosts` (measured
at start: calibrate.measure_step_costs), the Fallback drafts while drafting raises the
batch's aggregate tokens per second: a round emitting E tokens where a plain step emits
1, with each peer emitting (at least) 1 per step either way, pays when
(peers + E) / T(drafted step) > (peers + 1) / T(plain step), i.e. E above
(peers + 1) * T(drafted) / T(plain) - peers. Alone that is the break-even; where a
verify row costs little next to the step (a Mac, bound by reading the weights) it stays
near it, and where rows cost compute (this CPU) it rises with the batch, so at high batch
sequences take plain steps. The cost scheduler's block length maximizes the same
aggregate rate: (peers + expected tokens) / (T_draft + T_verify(peer rows + 1 + l)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCHEDULERS = ("fixed", "threshold", "cost")
DEFAULT_THRESHOLD = 0.1
DECAY = 0.98


ALONE = (0, 0)  # peers of a sequence that runs alone: (other sequences, their rows)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one target forward over a batch: one_row + per_row * (rows - 1) +
    per_sequence * (sequences - 1)."""

    one_row: float
    per_row: float
    per_sequence: float

    def forward(self, rows: int, sequences: int = 1) -> float:
        return self.one_row + self.per_row * (rows - 1) + self.per_sequence * (sequences - 1)


class Scheduler:
    name = "fixed"
    uses_confidence = False  # choose() wants the proposal's confidences on the host
    uses_peers = False  # choose() reads the batch's peers

    def choose(self, gamma: int, confidence: np.ndarray | None, peers: tuple[int, int] = ALONE) -> int:
        """How many of `gamma` proposals to verify, 0 <= l <= gamma."""
        return gamma

    def update(self, proposed: int, accepted: int, confidence: np.ndarray | None) -> None:
        """Learn from a round that verified `proposed` and accepted `accepted`."""


class FixedScheduler(Scheduler):
    pass


class SurvivalScheduler(Scheduler):
    """Keeps the online per-position estimates that `threshold` and `cost` share."""

    uses_confidence = True

    def __init__(self, max_positions: int = 16, min_proposals: int = 1, decay: float = DECAY):
        self.min_proposals = min_proposals
        self.decay = decay
        n = max_positions
        self.reached = np.zeros(n)  # rounds that verified j with all before accepted
        self.accepted = np.zeros(n)  # ... and accepted j
        self.predicted = np.zeros(n)  # raw survival the head gave j, rounds that verified j
        self.observed = np.zeros(n)  # rounds that verified j and accepted it

    def survival(self, gamma: int, confidence: np.ndarray | None) -> np.ndarray:
        """Estimated a_1..a_gamma (non-increasing, in [0, 1])."""
        self._grow(gamma)
        if confidence is None:
            rates = (self.accepted[:gamma] + 1) / (self.reached[:gamma] + 1)
            return np.cumprod(rates)
        raw = np.cumprod(np.clip(np.asarray(confidence, np.float64)[:gamma], 0.0, 1.0))
        ratio = (self.observed[:gamma] + 1) / (self.predicted[:gamma] + 1)
        return np.minimum.accumulate(np.minimum(raw * ratio, 1.0))

    def update(self, proposed: int, accepted: int, confidence: np.ndarray | None) -> None:
        self._grow(proposed)
        for arr in (self.reached, self.accepted, self.predicted, self.observed):
            arr *= self.decay
        verified = np.arange(proposed)  # 0-based positions
        self.reached[: min(accepted + 1, proposed)] += 1
        self.accepted[:accepted] += 1
        if confidence is not None and proposed:
            raw = np.cumprod(np.clip(np.asarray(confidence, np.float64)[:proposed], 0.0, 1.0))
            self.predicted[verified] += raw
            self.observed[:accepted] += 1

    def _floor(self, gamma: int) -> int:
        return min(self.min_proposals, gamma)

    def _grow(self, n: int) -> None:
        if n > self.reached.size:
            pad = n - self.reached.size
            for name in ("reached", "accepted", "predicted", "observed"):
                setattr(self, name, np.concatenate([getattr(self, name), np.zeros(pad)]))


class ThresholdScheduler(SurvivalScheduler):
    name = "threshold"

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, **kw):
        if not 0 <= threshold <= 1:
            raise ValueError(f"the survival threshold must be in [0, 1], got {threshold}")
        super().__init__(**kw)
        self.threshold = threshold

    def choose(self, gamma: int, confidence: np.ndarray | None, peers: tuple[int, int] = ALONE) -> int:
        survival = self.survival(gamma, confidence)
        below = np.flatnonzero(survival < self.threshold)
        keep = int(below[0]) if below.size else gamma
        return max(keep, self._floor(gamma))


class CostScheduler(SurvivalScheduler):
    name = "cost"
    uses_peers = True

    def __init__(self, draft_seconds: float | None = None, verify_seconds=None, draft_step_seconds: float = 0.0,
                 **kw):
        """verify_seconds[r - 1] = T_verify(r rows); T_draft(l) = draft_seconds + l *
        draft_step_seconds; measured by calibrate.measure_costs when not given."""
        super().__init__(**kw)
        self.draft_seconds = draft_seconds
        self.draft_step_seconds = float(draft_step_seconds)
        self.verify_seconds = None if verify_seconds is None else [float(t) for t in verify_seconds]

    @property
    def calibrated(self) -> bool:
        return self.draft_seconds is not None and self.verify_seconds is not None

    def set_costs(self, draft_seconds: float, verify_seconds, proposals: int | None = None) -> None:
        """`draft_seconds`: a draft's cost; with `proposals`, a sequential drafter's for
        that many proposals (each costs a share of it)."""
        self.verify_seconds = [float(t) for t in verify_seconds]
        if proposals is None:
            self.draft_seconds, self.draft_step_seconds = float(draft_seconds), 0.0
        else:
            self.draft_seconds, self.draft_step_seconds = 0.0, float(draft_seconds) / proposals

    def draft_time(self, proposals: int) -> float:
        return self.draft_seconds + self.draft_step_seconds * proposals

    def verify_time(self, rows: int) -> float:
        """T_verify(rows), extrapolated linearly past the table."""
        table = self.verify_seconds
        if rows <= len(table):
            return table[rows - 1]
        slope = table[-1] - table[-2] if len(table) > 1 else table[-1]
        return table[-1] + slope * (rows - len(table))

    def choose(self, gamma: int, confidence: np.ndarray | None, peers: tuple[int, int] = ALONE) -> int:
        if not self.calibrated:
            raise RuntimeError("the cost scheduler has no timings: call set_costs (see measure_costs)")
        survival = self.survival(gamma, confidence)
        others, rows = peers
        best_l, best = 0, (others + 1.0) / (self.draft_time(0) + self.verify_time(rows + 1))
        expected = others + 1.0
        for l in range(1, gamma + 1):
            expected += survival[l - 1]
            value = expected / (self.draft_time(l) + self.verify_time(rows + 1 + l))
            if value <= best:
                break  # the first non-improvement ends the scan
            best_l, best = l, value
        return max(best_l, self._floor(gamma))


class Fallback:
    """Plain rounds while speculation does not pay (module docstring). A probe that does
    not lift the average above the break-even doubles the wait before the next one (up
    to MAX_PROBE_EVERY), so a draft that does not fit the text costs ever less."""

    PROBE_EVERY = 8  # plain rounds before the first probe
    MAX_PROBE_EVERY = 64
    DECAY = 0.7  # weight of the past in the tokens-per-round average (~3 rounds)

    def __init__(self, break_even: float, costs: StepCosts | None = None, gamma: int = 7):
        """`costs` (the batch's forward costs) and `gamma` (rows a drafted round adds) make
        the break-even follow the batch (the module doc); without them it is the same
        at any batch."""
        if not break_even > 0:
            raise ValueError(f"the break-even tokens per round must be positive, got {break_even}")
        self.break_even = float(break_even)
        self.costs, self.gamma = costs, gamma
        self.peers = ALONE  # as the latest speculate() saw them
        self.tokens_per_round: float | None = None  # running average over speculative rounds
        self.plain_in_a_row = 0
        self.probe_every = self.PROBE_EVERY
        self.probing = False

    def threshold(self, peers: tuple[int, int] = ALONE) -> float:
        """The tokens a drafted round must emit to pay, next to `peers`: the break-even
        alone, (peers + 1) * T(drafted) / T(plain) - peers in a batch. T(drafted) counts
        what the measured break-even says a drafted round costs beyond its verify rows
        (the draft, the commit)."""
        others, rows = peers
        if not others or self.costs is None:
            return self.break_even
        c, g = self.costs, self.gamma
        extra = max(self.break_even * c.one_row - c.forward(1 + g), 0.0)
        plain = c.forward(rows + 1, others + 1)
        return (others + 1) * (extra + c.forward(rows + 1 + g, others + 1)) / plain - others

    def speculate(self, peers: tuple[int, int] = ALONE) -> bool:
        """Draft this round (with `peers` in the batch)?"""
        self.peers = peers
        if self.tokens_per_round is None or self.tokens_per_round >= self.threshold(peers):
            self.probe_every = self.PROBE_EVERY
            return True
        self.plain_in_a_row += 1
        if self.plain_in_a_row > self.probe_every:
            self.plain_in_a_row, self.probing = 0, True
            return True
        return False

    def plain_next(self) -> bool:
        """Will the next speculate() say no? (Asking changes nothing.)"""
        return (self.tokens_per_round is not None and self.tokens_per_round < self.threshold(self.peers)
                and self.plain_in_a_row + 1 <= self.probe_every)

    def plain_run(self) -> int:
        """After speculate() said no: the plain rounds left before the next probe, this
        one included."""
        return self.probe_every - self.plain_in_a_row + 1

    def skip(self, rounds: int) -> None:
        """Count `rounds` more plain rounds (run together with the one speculate() chose)."""
        self.plain_in_a_row += rounds

    def update(self, emitted: int) -> None:
        """After a speculative round that emitted `emitted` tokens (accepted + 1)."""
        past = self.tokens_per_round
        self.tokens_per_round = emitted if past is None else self.DECAY * past + (1 - self.DECAY) * emitted
        if self.probing and self.tokens_per_round < self.threshold(self.peers):
            self.probe_every = min(2 * self.probe_every, self.MAX_PROBE_EVERY)
        self.probing = False


def make_scheduler(name: str, max_positions: int = 16, threshold: float | None = None) -> Scheduler:
    if name == "fixed":
        return FixedScheduler()
    if name == "threshold":
        return ThresholdScheduler(DEFAULT_THRESHOLD if threshold is None else threshold, max_positions=max_positions)
    if name == "cost":
        return CostScheduler(max_positions=max_positions)
    raise ValueError(f"unknown scheduler {name!r} (known: {', '.join(SCHEDULERS)})")
