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

The Fallback (fallback.py) decides before a round whether to draft at all.

In a batch (engine --max-batch) a drafted round's rows share a forward with the other
sequences' rows: `peers` = (the other sequences, the target rows they put into the last
forward), and the cost scheduler's block length maximizes the batch's aggregate rate,
(peers + expected tokens) / (T_draft + T_verify(peer rows + 1 + l)).

A round is priced at the sequence's context (the rows before it): with timings measured
at several contexts (`add_costs`), T_draft and each T_verify(rows) are `CostCurve`s of
the context, linear between the contexts measured (a rise goes on past the last).
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


@dataclass(frozen=True)
class CostCurve:
    """A cost as a function of the sequence's context (the rows before a round), measured
    at a few contexts: linear between them, the first's below the first; past the last a
    rise goes on at the last segment's slope, a fall is not assumed (held at the last).
    The Fallback's break-even (a drafted round's cost in plain steps,
    calibrate.measure_cost_curve) and the cost scheduler's timings are such curves."""

    points: tuple[tuple[int, float], ...]  # (context, cost), contexts increasing

    def __post_init__(self):
        contexts = [c for c, _ in self.points]
        if not self.points or contexts != sorted(set(contexts)):
            raise ValueError(f"a cost curve needs points at increasing contexts, got {self.points!r}")
        if not all(s >= 0 for _, s in self.points):
            raise ValueError(f"a cost curve's costs must be at least 0, got {self.points!r}")

    @classmethod
    def flat(cls, steps: float) -> CostCurve:
        """The same cost at every context (one measurement)."""
        return cls(((0, float(steps)),))

    def at(self, context: int) -> float:
        points = self.points
        if context <= points[0][0]:
            return points[0][1]
        for (c0, s0), (c1, s1) in zip(points, points[1:]):
            if context <= c1:
                return s0 + (s1 - s0) * (context - c0) / (c1 - c0)
        if len(points) == 1:
            return points[0][1]
        (c0, s0), (c1, s1) = points[-2:]
        return s1 + max(s1 - s0, 0.0) * (context - c1) / (c1 - c0)

    def describe(self) -> str:
        return ", ".join(f"{s:.1f} at {c}" for c, s in self.points) + " rows of context"


class Scheduler:
    name = "fixed"
    uses_confidence = False  # choose() wants the proposal's confidences on the host
    uses_peers = False  # choose() reads the batch's peers

    def choose(self, gamma: int, confidence: np.ndarray | None, peers: tuple[int, int] = ALONE,
               context: int = 0) -> int:
        """How many of `gamma` proposals to verify, 0 <= l <= gamma, `context` rows before
        the round."""
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
            self.reached, self.accepted, self.predicted, self.observed = (
                np.concatenate([counts, np.zeros(pad)]) for counts in (self.reached, self.accepted, self.predicted,
                                                                       self.observed))


class ThresholdScheduler(SurvivalScheduler):
    name = "threshold"

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, **kw):
        if not 0 <= threshold <= 1:
            raise ValueError(f"the survival threshold must be in [0, 1], got {threshold}")
        super().__init__(**kw)
        self.threshold = threshold

    def choose(self, gamma: int, confidence: np.ndarray | None, peers: tuple[int, int] = ALONE,
               context: int = 0) -> int:
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
        draft_step_seconds; measured by calibrate.measure_costs when not given, at any
        context until `add_costs` gives timings at longer ones."""
        super().__init__(**kw)
        self.draft_seconds = draft_seconds
        self.draft_step_seconds = float(draft_step_seconds)
        self.verify_seconds = None if verify_seconds is None else [float(t) for t in verify_seconds]
        self.context = 0  # where the timings above were measured
        self.longer: list[tuple[int, float, float, list[float]]] = []  # (context, draft, draft step, verify table)

    @property
    def calibrated(self) -> bool:
        return self.draft_seconds is not None and self.verify_seconds is not None

    def set_costs(self, draft_seconds: float, verify_seconds, proposals: int | None = None, context: int = 0) -> None:
        """`draft_seconds`: a draft's cost; with `proposals`, a sequential drafter's for
        that many proposals (each costs a share of it); measured at `context` rows."""
        self.draft_seconds, self.draft_step_seconds = split_draft(draft_seconds, proposals)
        self.verify_seconds, self.context, self.longer = [float(t) for t in verify_seconds], context, []

    def add_costs(self, context: int, draft_seconds: float, verify_seconds, proposals: int | None = None) -> None:
        """The timings at a longer `context` than the ones before (as set_costs)."""
        if context <= (self.longer[-1][0] if self.longer else self.context):
            raise ValueError(f"timings at {context} rows of context must come after the longer ones")
        self.longer.append((context, *split_draft(draft_seconds, proposals), [float(t) for t in verify_seconds]))

    def draft_time(self, proposals: int, context: int = 0) -> float:
        return self._at(context, lambda draft, step, _: draft + step * proposals)

    def verify_time(self, rows: int, context: int = 0) -> float:
        """T_verify(rows) at `context`, extrapolated linearly past the table."""
        return self._at(context, lambda _, __, table: table_time(table, rows))

    def _at(self, context: int, cost) -> float:
        """`cost(draft, draft step, verify table)` at `context`: a CostCurve over the
        contexts measured."""
        first = cost(self.draft_seconds, self.draft_step_seconds, self.verify_seconds)
        if not self.longer:
            return first
        points = ((self.context, first), *((c, cost(d, s, t)) for c, d, s, t in self.longer))
        return CostCurve(points).at(context)

    def choose(self, gamma: int, confidence: np.ndarray | None, peers: tuple[int, int] = ALONE,
               context: int = 0) -> int:
        if not self.calibrated:
            raise RuntimeError("the cost scheduler has no timings: call set_costs (see measure_costs)")
        survival = self.survival(gamma, confidence)
        others, rows = peers
        best_l, best = 0, (others + 1.0) / (self.draft_time(0, context) + self.verify_time(rows + 1, context))
        expected = others + 1.0
        for l in range(1, gamma + 1):
            expected += survival[l - 1]
            value = expected / (self.draft_time(l, context) + self.verify_time(rows + 1 + l, context))
            if value <= best:
                break  # the first non-improvement ends the scan
            best_l, best = l, value
        return max(best_l, self._floor(gamma))


def split_draft(draft_seconds: float, proposals: int | None) -> tuple[float, float]:
    """(T_draft's fixed part, its part per proposal): a block drafter pays once, a
    sequential one (`proposals` given) a share of `draft_seconds` per proposal."""
    if proposals is None:
        return float(draft_seconds), 0.0
    return 0.0, float(draft_seconds) / proposals


def table_time(table: list[float], rows: int) -> float:
    """table[rows - 1], extrapolated linearly past the table."""
    if rows <= len(table):
        return table[rows - 1]
    slope = table[-1] - table[-2] if len(table) > 1 else table[-1]
    return table[-1] + slope * (rows - len(table))


def make_scheduler(name: str, max_positions: int = 16, threshold: float | None = None) -> Scheduler:
    if name == "fixed":
        return FixedScheduler()
    if name == "threshold":
        return ThresholdScheduler(DEFAULT_THRESHOLD if threshold is None else threshold, max_positions=max_positions)
    if name == "cost":
        return CostScheduler(max_positions=max_positions)
    raise ValueError(f"unknown scheduler {name!r} (known: {', '.join(SCHEDULERS)})")
