"""Speculative decoding measures (docs/drafts.md 5), shared by the generate loop, the CLI's
JSON, the benchmarks and (later) the server's Prometheus metrics.

Per round: `proposed` = l, the proposals verified; `accepted` = a, the leading ones the
target kept (the round emits a + 1 tokens: those and the bonus).
- acceptance length tau = mean of a + 1 over rounds;
- per-position conditional acceptance at position j (1-based): of the rounds that
  verified a proposal at j and accepted every proposal before it, the share that
  accepted j too;
- vLLM's counters: `spec_decode_num_drafts_total` (rounds that verified at least one
  proposal), `spec_decode_num_draft_tokens_total` (proposals verified),
  `spec_decode_num_accepted_tokens_total`, and
  `spec_decode_num_accepted_tokens_per_pos_total{position}` (0-based, as vLLM);
- per request (docs/drafts.md 4.2): the plain rounds the Fallback chose instead of
  drafting and its switches between drafted and plain rounds, each with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROMETHEUS_NAMES = (
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_accepted_tokens_per_pos_total",
)


@dataclass
class SpecStats:
    gamma: int  # proposals asked of the drafter per round (l <= gamma)
    proposed_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    # Stage seconds, summed over rounds; None unless the rounds were profiled (profiling
    # evaluates each stage before the next one starts: extra host syncs).
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    commit_seconds: float | None = None
    plain_rounds: int = 0  # one-row rounds a Fallback chose instead of drafting (not in the above)
    switches: list = field(default_factory=list)  # the Fallback's fallback.Switch-es, in order

    def record(self, proposed: int, accepted: int, seconds: tuple[float, float, float] | None = None) -> None:
        if not 0 <= accepted <= proposed <= self.gamma:
            raise ValueError(f"a round accepted {accepted} of {proposed} proposals (gamma {self.gamma})")
        self.proposed_per_round.append(proposed)
        self.accepted_per_round.append(accepted)
        if seconds is not None:
            draft, verify, commit = seconds
            self.draft_seconds = (self.draft_seconds or 0.0) + draft
            self.verify_seconds = (self.verify_seconds or 0.0) + verify
            self.commit_seconds = (self.commit_seconds or 0.0) + commit

    @property
    def rounds(self) -> int:
        return len(self.accepted_per_round)

    @property
    def mean_accepted(self) -> float | None:
        return sum(self.accepted_per_round) / self.rounds if self.rounds else None

    @property
    def acceptance_length(self) -> float | None:
        """tau: tokens emitted per round (accepted + the bonus), the mean over rounds."""
        return self.mean_accepted + 1 if self.rounds else None

    def accepted_per_position(self) -> list[int]:
        """Rounds whose proposal at position j (0-based index) was accepted."""
        return [sum(1 for a in self.accepted_per_round if a > j) for j in range(self.gamma)]

    def reached_per_position(self) -> list[int]:
        """Rounds that verified a proposal at position j and accepted all before it."""
        return [sum(1 for l, a in zip(self.proposed_per_round, self.accepted_per_round) if l > j and a >= j)
                for j in range(self.gamma)]

    def per_position_acceptance(self) -> list[float | None]:
        """Conditional acceptance by position (None where no round reached it)."""
        return [acc / reached if reached else None
                for acc, reached in zip(self.accepted_per_position(), self.reached_per_position())]

    def prometheus(self) -> dict:
        """vLLM's spec-decode counters (per-position: a list indexed by `position`)."""
        return {
            "spec_decode_num_drafts_total": sum(1 for l in self.proposed_per_round if l > 0),
            "spec_decode_num_draft_tokens_total": sum(self.proposed_per_round),
            "spec_decode_num_accepted_tokens_total": sum(self.accepted_per_round),
            "spec_decode_num_accepted_tokens_per_pos_total": self.accepted_per_position(),
        }

    def as_json(self) -> dict:
        return {
            "rounds": self.rounds,
            "block_size": self.gamma,  # as generate --draft-block-size names it
            "accepted_per_round": list(self.accepted_per_round),
            "proposed_per_round": list(self.proposed_per_round),
            "mean_accepted": self.mean_accepted,
            "acceptance_length": self.acceptance_length,
            "per_position_acceptance": self.per_position_acceptance(),
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "commit_seconds": self.commit_seconds,
            "plain_rounds": self.plain_rounds,
            "switches": [s.as_json() for s in self.switches],
            "counters": self.prometheus(),
        }
