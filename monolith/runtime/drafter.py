"""The drafter interface the speculative round talks to (rounds.py, decoder.py, batch.py).

A drafter proposes the next tokens of one sequence from the target's tap features of
every committed row. The product has two: `draft_model.DraftModelDrafter`, over a DSpark /
DFlash draft model (monolith.models.dspark), and `mtp_drafter.MTPDrafter`, over the
target's own MTP head (models/mtp.py, `--draft mtp`); the tests' oracles (tests/oracles.py) and
bench's replay drafter implement the same interface. A drafter owns its context. Its
life over one sequence:

    drafter.start(max_context)              # a new sequence: empty context
    drafter.observe(features)               # features [n, len(taps) * hidden] of the next
                                            #   n committed rows, in order (prompt, then each
                                            #   round's kept rows; never rejected rows)
    p = drafter.propose(anchor, gamma, params, key)
                                            # `anchor` = the last emitted token, which sits at
                                            #   position (rows observed so far)
    snap = drafter.snapshot()               # the context so far, to resume the sequence later
    drafter.restore(snap, rows)             #   from its first `rows` rows (False: it cannot)

Two abilities are optional, each its own Protocol below (the caller checks with isinstance):

    d = drafter.fork()                      # `Forking`: a drafter over the same model with a
                                            #   context of its own; the decoder forks one per
                                            #   call, so sequences can share a batch. Without
                                            #   it the engine runs one sequence at a time.
    p = drafter.propose_guided(anchor, gamma, params, key, guide, limit)
                                            # `Guided`: under a grammar (grammar.Guide), up to
                                            #   `limit` proposals, each legal given the ones
                                            #   before it, which `guide` has consumed. Without
                                            #   it a grammar request is refused (rounds.py).

A drafter may hold observed rows back until its context is next used (the draft model's
drafter does, so a batch appends every sequence's rows in one packed call).
`taps` are the target decoder layers whose outputs the drafter reads (or the target's
named taps, models/qwen3_5.py NAMED_TAPS); `max_proposals` bounds gamma; a drafter whose
`sequential` attribute is true pays one draft forward per proposal (the MTP head), where
a block drafter pays one for the block: the cost scheduler counts that, and a round asks
the scheduler for its block length before drafting (scheduler.py); `arrays()` gives the
context state to evaluate between prefill chunks (so a long prompt's features are not
all held until the first proposal). A drafter whose `snapshot()` is None cannot resume:
every prompt is then prefilled whole. A snapshot that is a `models.cache.DraftContext`
(the draft model's) also lets the prompt cache copy the context's rows into its saved
states and back (prompt_cache.py). A drafter with a `draft` attribute (a draft model)
has its blocks run packed across a batch (batch.run_proposals: it reads `draft`,
`context` and `waiting`, and passes the block's `hidden` states to propose /
propose_guided).

A `Proposal` (monolith.models.dspark, the draft model's output) holds gamma
target-vocabulary tokens, their filtered draft distributions q (one-hot under greedy
params: rejection sampling needs q, greedy acceptance does not) and the confidences c_k
(probability that proposal k survives given that all before it did) or None. All of it
may stay lazy: the round reads it in its one host sync.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import mlx.core as mx

from ..models.dspark import Proposal
from ..sampling import SamplingParams

__all__ = ["Drafter", "Forking", "Guided", "Proposal"]


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

    def snapshot(self) -> object | None:
        """The context after the rows observed so far (None: this drafter cannot resume)."""
        ...

    def restore(self, snapshot: object, rows: int) -> bool:
        """Continue from `snapshot`'s first `rows` rows; False if it holds fewer."""
        ...


@runtime_checkable
class Forking(Drafter, Protocol):
    def fork(self) -> Drafter:
        """A drafter over the same model with an empty context of its own (one per sequence)."""
        ...


@runtime_checkable
class Guided(Drafter, Protocol):
    def propose_guided(self, anchor: int, gamma: int, params: SamplingParams, key: mx.array | None, guide,
                       limit: int) -> Proposal:
        """Up to `limit` proposals under the grammar `guide` (grammar.Guide), which consumes them."""
        ...
