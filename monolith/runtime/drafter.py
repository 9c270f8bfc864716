"""The drafter interface the speculative round talks to (rounds.py, decoder.py, batch.py).

A drafter proposes the next tokens of one sequence from the target's tap features of
every committed row. The product has two: `draft_model.DraftModelDrafter`, over a DSpark /
DFlash draft model (monolith.models.dspark), and `mtp_drafter.MTPDrafter`, over the
target's own MTP head (models/mtp.py, `--draft mtp`); the tests' oracles (tests/oracles.py) and
bench's replay drafter subclass the same interface. A drafter owns its context. Its
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

Every drafter subclasses `Drafter`, which declares what a drafter can do with the
defaults of one that can do none of the optional things; a drafter overrides only what
it does. The callers read these attributes and call these methods, never probe:

    drafter.arrays()                        # the context state to evaluate between prefill
                                            #   chunks (default: none)
    drafter.snapshot() / restore(...)       # default None / False: it cannot resume, so every
                                            #   prompt is prefilled whole
    drafter.sequential                      # True: one draft forward per proposal (the MTP
                                            #   head), where a block drafter pays one for the
                                            #   block (default False): the cost scheduler counts
                                            #   that, and a round asks the scheduler for its
                                            #   block length before drafting (scheduler.py)
    drafter.make_context(max_context)       # a context it would hold, to size the caches
                                            #   (sizing.py; default None: it holds no arrays)
    drafter.draft                           # a draft model whose blocks a batch runs packed
                                            #   (batch.run_proposals: its forward_batch and
                                            #   propose_batch over each drafter's `context`,
                                            #   the block's `hidden` states passed to propose /
                                            #   propose_guided; default None: each proposes alone)
    drafter.append_together(drafters)       # the rows these drafters over one `draft` observed
                                            #   and hold back, appended in one packed call (the
                                            #   draft model's drafter holds rows back until its
                                            #   context is next used; default: nothing waits)

Two abilities are classes of their own (the caller checks with isinstance):

    d = drafter.fork()                      # `Forking`: a drafter over the same model with a
                                            #   context of its own; the decoder forks one per
                                            #   call, so sequences can share a batch. Without
                                            #   it the engine runs one sequence at a time.
    p = drafter.propose_guided(anchor, gamma, params, key, guide, limit)
                                            # `Guided`: under a grammar (grammar.Guide), up to
                                            #   `limit` proposals, each legal given the ones
                                            #   before it, which `guide` has consumed. Without
                                            #   it a grammar request is refused (rounds.py).

`taps` are the target decoder layers whose outputs the drafter reads (or the target's
named taps, models/qwen3_5.py NAMED_TAPS); `max_proposals` bounds gamma. A snapshot that
is a `models.cache.DraftContext` (the draft model's, the MTP head's) also lets the prompt
cache copy the context's rows into its saved states and back (prompt_cache.py).

A `Proposal` (monolith.models.dspark, the draft model's output) holds gamma
target-vocabulary tokens, their filtered draft distributions q (one-hot under greedy
params: rejection sampling needs q, greedy acceptance does not) and the confidences c_k
(probability that proposal k survives given that all before it did) or None. All of it
may stay lazy: the round reads it in its one host sync.
"""

from __future__ import annotations

import mlx.core as mx

from ..models.dspark import Proposal
from ..sampling import SamplingParams

__all__ = ["Drafter", "Forking", "Guided", "Proposal"]


class Drafter:
    """The drafter interface, with the defaults of a drafter that can do none of the
    optional things (the module's docstring)."""

    taps: list[int]
    max_proposals: int
    sequential = False  # one draft forward per proposal, not one per block
    draft = None  # a draft model whose blocks a batch runs packed (batch.run_proposals)
    context = None  # the drafter's context, which `draft`'s batched calls read

    def start(self, max_context: int) -> None:
        raise NotImplementedError

    def observe(self, features: mx.array) -> None:
        raise NotImplementedError

    def propose(self, anchor: int, gamma: int, params: SamplingParams, key: mx.array | None) -> Proposal:
        raise NotImplementedError

    def arrays(self) -> list[mx.array]:
        """The context state, to evaluate between prefill chunks (may be empty)."""
        return []

    def snapshot(self) -> object | None:
        """The context after the rows observed so far (None: this drafter cannot resume)."""

    def restore(self, snapshot: object, rows: int) -> bool:
        """Continue from `snapshot`'s first `rows` rows; False if it cannot."""
        return False

    def make_context(self, max_context: int):
        """An empty context of `max_context` rows, as this drafter holds one (sizing.py
        counts its bytes), or None: it holds no arrays."""

    def append_together(self, drafters: list[Drafter]) -> None:
        """Append the rows `drafters` (over this drafter's `draft`) hold back, in one
        packed call; a drafter that holds none back does nothing."""


class Forking(Drafter):
    """A drafter that forks (one context per sequence: sequences share a batch)."""

    def fork(self) -> Drafter:
        """A drafter over the same model with an empty context of its own (one per sequence)."""
        raise NotImplementedError


class Guided(Drafter):
    """A drafter that proposes under a grammar."""

    def propose_guided(self, anchor: int, gamma: int, params: SamplingParams, key: mx.array | None, guide,
                       limit: int) -> Proposal:
        """Up to `limit` proposals under the grammar `guide` (grammar.Guide), which consumes them."""
        raise NotImplementedError


DEFAULT_GAMMA = 7  # proposals per round: 8 verify rows


def check_gamma(gamma: int | None, max_proposals: int) -> int:
    """The proposals per round, default min(7, max_proposals)."""
    if gamma is None:
        return min(DEFAULT_GAMMA, max_proposals)
    if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= max_proposals:
        raise ValueError(f"the draft block size must be an integer in 1..{max_proposals} "
                         f"(the draft's proposals per block), got {gamma!r}")
    return gamma
