"""The drafter interface the speculative round talks to.

A drafter proposes the next tokens of one sequence from the target's tap features of
every committed row (as vLLM v1's proposers: DSpark, DFlash and the tests' oracles are
peers behind one interface). Its life over one sequence:

    drafter.start(max_context)              # a new sequence: empty context
    drafter.observe(features)               # features [n, len(taps) * hidden] of the next
                                            #   n committed rows, in order (prompt, then each
                                            #   round's kept rows; never rejected rows)
    p = drafter.propose(anchor, gamma, params, key)
                                            # `anchor` = the last emitted token, which sits at
                                            #   position (rows observed so far)

`taps` are the target decoder layers whose outputs the drafter reads; `max_proposals`
bounds gamma; `arrays()` gives the context state to evaluate between prefill chunks
(so a long prompt's features are not all held until the first proposal).
A `Proposal` (defined here, used by monolith.models.dspark) holds gamma target-vocabulary tokens, their filtered draft
distributions q (one-hot under greedy params: rejection sampling needs q, greedy
acceptance does not), and the confidences c_k (probability that proposal k survives
given that all before it did) or None without a confidence head. Everything in a
Proposal may stay lazy: the round reads it in its one host sync.

This module imports no model code (monolith.models.dspark imports it for Proposal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx

from ..sampling import SamplingParams

__all__ = ["DraftModelDrafter", "Drafter", "Proposal"]


@dataclass(frozen=True)
class Proposal:
    tokens: mx.array  # int32 [gamma], target vocabulary ids
    q: mx.array  # float32 [gamma, V_target], the filtered draft distribution of each token
    confidence: mx.array | None  # float32 [gamma] or None (no confidence head)


@runtime_checkable
class Drafter(Protocol):
    taps: list[int]
    max_proposals: int

    def start(self, max_context: int) -> None: ...

    def observe(self, features: mx.array) -> None: ...

    def propose(self, anchor: int, gamma: int, params: SamplingParams, key: mx.array | None) -> Proposal: ...

    def arrays(self) -> list[mx.array]:
        """The context state, to evaluate between prefill chunks (may be empty)."""
        ...


class DraftModelDrafter:
    """The `Drafter` over a loaded DSpark/DFlash draft model (monolith.models.dspark),
    which keeps its context cache in an explicit context object."""

    def __init__(self, draft):
        self.draft = draft
        self.taps = list(draft.taps)
        self.max_proposals = int(draft.max_proposals)
        self.block_size = int(draft.block_size)
        self.context = None

    def __repr__(self) -> str:
        return f"DraftModelDrafter(taps={self.taps}, max_proposals={self.max_proposals})"

    def start(self, max_context: int) -> None:
        self.context = self.draft.make_context(max_context)

    def observe(self, features: mx.array) -> None:
        self.draft.append_context(self._context(), features)

    def propose(self, anchor: int, gamma: int, params: SamplingParams, key: mx.array | None) -> Proposal:
        return self.draft.propose(self._context(), anchor, gamma, params, key=key)

    def arrays(self) -> list[mx.array]:
        return self._context().arrays()

    def _context(self):
        if self.context is None:
            raise RuntimeError("call drafter.start(max_context) before observe/propose")
        return self.context
