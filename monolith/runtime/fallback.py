"""Whether a sequence drafts its next round at all (docs/drafts.md 4.2): `Fallback`.

`Fallback` decides before a round whether to draft at all: while the recent rounds'
tokens per round stay below the break-even (a round's cost in plain steps at the
sequence's context: a scheduler.CostCurve, measured at start at a few contexts by
calibrate.measure_cost_curve), rounds are plain one-row steps, with a
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

A round is priced at the sequence's context (its committed rows) and the request's own
tokens per round: a long request whose rounds cost more plain steps than a round can
emit at all (gamma + 1 tokens) takes plain steps from its first round, with no probe,
and one whose acceptance collapses falls back mid-generation. Each change between
drafted and plain rounds is a `Switch` with its reason, kept in the request's stats
(stats.SpecStats.switches). Before any round a drafted round is expected to emit gamma +
1 tokens (its first round drafts wherever a round can pay at all).
"""

from __future__ import annotations

from dataclasses import dataclass

from .scheduler import ALONE, CostCurve, StepCosts

SWITCH_REASONS = ("cost", "acceptance", "probe")
SWITCHES = (("plain", "cost"), ("plain", "acceptance"), ("draft", "cost"), ("draft", "probe"))  # (to, reason)


@dataclass(frozen=True)
class Switch:
    """A sequence's change between drafted and plain rounds (Fallback.speculate), and why:
    `cost`: a drafted round's cost at this context (next to this batch) moved past the
    tokens a round is expected to emit; `acceptance`: the rounds' tokens fell below the
    cost; `probe`: a probe round lifted them above it."""

    context: int  # the rows before the round
    to: str  # "draft" or "plain"
    reason: str  # one of SWITCH_REASONS
    cost: float  # a drafted round's cost there, in plain steps
    expected: float  # the tokens a drafted round was expected to emit

    def describe(self) -> str:
        if self.reason == "acceptance":
            why = f"rounds emit {self.expected:.1f} tokens, below the {self.cost:.1f} plain steps a round costs"
        elif self.reason == "probe":
            why = (f"a probe lifted rounds to {self.expected:.1f} tokens, at least the {self.cost:.1f} plain steps "
                   "a round costs")
        else:
            side = "more" if self.to == "plain" else "no more"
            why = f"a round costs {self.cost:.1f} plain steps, {side} than the {self.expected:.1f} tokens expected"
        return f"context {self.context}: {why}"

    def as_json(self) -> dict:
        return {"context": self.context, "to": self.to, "reason": self.reason, "cost": round(self.cost, 3),
                "expected_tokens": round(self.expected, 3), "detail": self.describe()}


class Fallback:
    """Plain rounds while speculation does not pay (module docstring), priced at the
    sequence's context (a CostCurve). A probe that does not lift the average above the
    break-even doubles the wait before the next one (up to MAX_PROBE_EVERY), so a draft
    that does not fit the text costs ever less; where a round costs more plain steps than
    it can emit at all (gamma + 1 tokens) no probe runs. Each change between drafted and
    plain rounds is kept as `switch` by the speculate() that made it."""

    PROBE_EVERY = 8  # plain rounds before the first probe
    MAX_PROBE_EVERY = 64
    DECAY = 0.7  # weight of the past in the tokens-per-round average (~3 rounds)

    def __init__(self, break_even: float | CostCurve, costs: StepCosts | None = None, gamma: int = 7):
        """`break_even`: a round's cost in plain steps, at every context or as a
        CostCurve; `costs` (the batch's forward costs) and `gamma` (rows a drafted round
        adds) make the break-even follow the batch (the module doc); without them it is
        the same at any batch."""
        self.curve = break_even if isinstance(break_even, CostCurve) else CostCurve.flat(break_even)
        if not min(s for _, s in self.curve.points) > 0:
            raise ValueError(f"the break-even tokens per round must be positive, got {self.curve.points!r}")
        self.costs, self.gamma = costs, gamma
        self.peers, self.context = ALONE, 0  # as the latest speculate() saw them
        self.tokens_per_round: float | None = None  # running average over speculative rounds
        self.plain_in_a_row = 0
        self.probe_every = self.PROBE_EVERY
        self.probing = False
        self.probe_paid = False  # the latest update() was a probe's that lifted the average to the cost
        self.drafting = True  # the mode: drafted rounds, or plain ones (with probes)
        self.paid: float | None = None  # the cost the latest drafting decision paid
        self.switch: Switch | None = None  # the switch the latest speculate() made

    def threshold(self, peers: tuple[int, int] = ALONE, context: int | None = None) -> float:
        """The tokens a drafted round must emit to pay at `context` (None: the latest),
        next to `peers`: the break-even there alone, (peers + 1) * T(drafted) / T(plain) -
        peers in a batch. T(drafted) counts what the break-even says a drafted round costs
        beyond its verify rows (the draft, the commit)."""
        break_even = self.curve.at(self.context if context is None else context)
        others, rows = peers
        if not others or self.costs is None:
            return break_even
        c, g = self.costs, self.gamma
        extra = max(break_even * c.one_row - c.forward(1 + g), 0.0)
        plain = c.forward(rows + 1, others + 1)
        return (others + 1) * (extra + c.forward(rows + 1 + g, others + 1)) / plain - others

    def expected(self) -> float:
        """The tokens a drafted round is expected to emit: the recent rounds' average, the
        most a round can emit before any round."""
        return float(self.gamma + 1) if self.tokens_per_round is None else self.tokens_per_round

    def speculate(self, peers: tuple[int, int] = ALONE, context: int | None = None) -> bool:
        """Draft this round (with `peers` in the batch, `context` rows before it; None:
        the latest)?"""
        self.peers, self.switch = peers, None
        if context is not None:
            self.context = context
        cost, expected = self.threshold(peers), self.expected()
        if expected >= cost:
            self._mode(True, cost, expected)
            self.probe_every, self.paid = self.PROBE_EVERY, cost
            return True
        self._mode(False, cost, expected)
        if cost > self.gamma + 1:  # no round pays here, even one that keeps every proposal: no probe
            return False
        self.plain_in_a_row += 1
        if self.plain_in_a_row > self.probe_every:
            self.plain_in_a_row, self.probing = 0, True
            return True
        return False

    def _mode(self, drafting: bool, cost: float, expected: float) -> None:
        if drafting == self.drafting:
            return
        if drafting:
            reason = "probe" if self.probe_paid else "cost"
        else:
            reason = "acceptance" if self.paid is not None and expected < self.paid else "cost"
        self.drafting = drafting
        self.switch = Switch(self.context, "draft" if drafting else "plain", reason, cost, expected)

    def plain_next(self, context: int | None = None) -> bool:
        """Will the next speculate() (at `context`, None: the latest) say no? (Asking
        changes nothing.)"""
        cost = self.threshold(self.peers, context)
        if self.expected() >= cost:
            return False
        return cost > self.gamma + 1 or self.plain_in_a_row + 1 <= self.probe_every

    def plain_run(self) -> int:
        """After speculate() said no: the plain rounds left before the next probe, this
        one included (no probe where no round pays)."""
        if self.threshold(self.peers) > self.gamma + 1:
            return self.MAX_PROBE_EVERY
        return self.probe_every - self.plain_in_a_row + 1

    def skip(self, rounds: int) -> None:
        """Count `rounds` more plain rounds (run together with the one speculate() chose)."""
        if self.threshold(self.peers) <= self.gamma + 1:
            self.plain_in_a_row += rounds

    def update(self, emitted: int) -> None:
        """After a speculative round that emitted `emitted` tokens (accepted + 1)."""
        past = self.tokens_per_round
        self.tokens_per_round = emitted if past is None else self.DECAY * past + (1 - self.DECAY) * emitted
        paid = self.tokens_per_round >= self.threshold(self.peers)
        if self.probing and not paid:
            self.probe_every = min(2 * self.probe_every, self.MAX_PROBE_EVERY)
        self.probe_paid, self.probing = self.probing and paid, False
