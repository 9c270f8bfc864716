"""The rounds of one sequence, the one decode loop of every decoder:
prefill (with taps when a drafter reads them), then rounds of draft -> schedule ->
verify -> accept -> commit. Plain decoding is rounds that never draft.

Positions: after the prefill the cache holds the P prompt rows and the first token, the
anchor, sits at position P outside the cache. A round verifies [anchor, x_1..x_l] in
one target forward (rows P'..P'+l), accepts a <= l proposals, emits x_1..x_a and the
bonus, and commits the a + 1 rows [anchor, x_1..x_a]: the KV offset moves past them,
the gated DeltaNet states are replayed from the pre-verify snapshot over exactly those
rows (`HybridCache.commit`), and the drafter observes their tap features. The bonus is
the next anchor.

A plain round is a one-row step (no draft). Plain steps are pipelined: the next step is
queued before the current token is read (`mx.async_eval`), so the host's work on token
t overlaps the device's on token t+1, and across rounds too: a run ends with the next
step already queued (`Queued`; dropped, and its row rewound, if no round takes it), so
each token costs one host sync. Without a drafter every round is one plain step (each
token reaches the caller as it is read); with one, a `Fallback` may make rounds plain
(the drafter observes the rows such rounds commit in one batch before it next drafts,
`sync_drafter`) while the recent rounds emit fewer tokens than a round costs in plain
steps at the sequence's context (fallback.Fallback; the break-even is a CostCurve of the
context, calibrate.measure_cost_curve); its switches go into the round's stats.

Limits: a round never emits more tokens than max_tokens or the context allow (the
sequence, prompt + output, stays within max_context, as in plain decoding), so the
block shrinks near the end and committed rows never pass max_context - 1; a stop token
ends the output where it is read, and nothing after it is emitted.

Under a grammar (`guide`, grammar.Guide): the first token and every bonus are sampled
from the target's rows masked by the grammar; the drafter proposes along the grammar
(`propose_guided`: each proposal legal given the ones before it, a position the grammar
forces taken without a draw); the verify rows are masked by the grammar along the same
path, and acceptance compares the masked distributions, so the output follows plain
constrained sampling exactly. Rejected proposals are rolled back in the guide. A guide
that waits for the token that starts it (`Guide.starts_after`: a call's `<tool_call>`
under tool_choice "auto", `</think>` before a response format), without a budget, is
`waiting`: until that token the rounds run unguided (pipelined plain steps, drafting in
the chained batch, the fallback), a round that emits it is cut there as a stop token cuts
the output (the rows after it rewound), and the guide engages with it as the anchor.
Once engaged, rounds never fall back to plain steps, and drafting reads each drawn
proposal (one host sync per drawn token). Without a drafter, the tokens the grammar
forces after the anchor are the proposals (one-hot q: always accepted), so a forced run
costs one forward (jump-forward); the next token is drawn from the masked row after it.

Host syncs: one per round, the read of [x_1..x_l, a, bonus]. The draft and the commit
are queued with mx.async_eval as soon as their graphs exist, so the GPU works while the
host builds the next stage (as plain decoding overlaps its steps; on MLX's CPU stream
async_eval returns only once the queue is nearly drained, so there little overlaps).
The threshold and cost schedulers add one when the drafter has a confidence head (the
verify's row count depends on the confidences), and `profile=True` evaluates each stage
before the next (to time draft, verify and commit separately) at the price of two more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..models.cache import Snapshot
from ..sampling import filtered_probs, key_chain, mask_logits, sample
from .accept import accept_greedy, accept_sampled
from .batch import Forward, Peers, Propose, Steps, drive
from .drafter import Drafter, Guided, Proposal
from .events import TokenLogprob
from .fallback import Fallback
from .generation import Generation
from .logprobs import (
    logprob_arrays,
    read_logprob,
    read_verify_logprobs,
    verify_logprobs,
)
from .prefill import prefill_rows
from .scheduler import ALONE, FixedScheduler, Scheduler
from .stats import SpecStats

PLAIN_RUN = 8  # plain steps a fallback round runs at most (tokens reach the caller per round)


@dataclass
class Block:
    """A round in flight: the proposals chosen for verification, then what the verify
    forward left for the commit."""

    proposal: Proposal | None  # None when no proposal fits (one row left)
    confidence: np.ndarray | None  # as the scheduler read it, or None
    proposed: mx.array  # int32 [l]: the proposals verified
    accept_key: mx.array | None
    snapshot: Snapshot | None = None  # the GDN states before the verify
    features: mx.array | None = None  # tap features of the l + 1 verified rows
    plain: bool = False  # a Fallback chose a one-row round: no draft
    logprob_arrays: tuple = ()  # with logprobs: per verified row, see Rounds.verify
    masks: np.ndarray | None = None  # under a grammar: the verify rows' masks (Guide.masks)

    @property
    def size(self) -> int:
        return self.proposed.shape[0]

    def arrays(self) -> list[mx.array]:
        p = self.proposal
        return [self.proposed] + ([] if p is None else [a for a in (p.q, p.confidence) if a is not None])


@dataclass(frozen=True)
class Queued:
    """A plain step in flight past a run of plain rounds: the anchor's row is in the
    cache (`snapshot`: the GDN states without it), its tap features and the sampled
    next token are lazy."""

    token: mx.array  # int32 [1]
    features: mx.array
    snapshot: Snapshot | None  # taken only for the step queued past a run
    logprob: tuple = ()  # plain.logprob_arrays of the token, with logprobs


@dataclass(frozen=True)
class RoundResult:
    tokens: list[int]  # emitted: the accepted proposals then the bonus (accepted + 1 tokens)
    proposed: int  # l, proposals verified
    accepted: int  # a
    logprobs: list[TokenLogprob] | None = None  # per token, under the target's raw distribution (with logprobs)


class Rounds:
    """One sequence: the target's cache, the drafter's context, the anchor; `prefill`
    once, then `round` until done (decoder.py runs them)."""

    def __init__(self, model, drafter: Drafter | None, generation: Generation, max_context: int, gamma: int = 0,
                 scheduler: Scheduler | None = None, cache=None):
        """`drafter` None: plain decoding, every round a plain step (under a grammar, the
        tokens it forces after the anchor are verified with it: jump-forward); `gamma`:
        the proposals per round, 1..drafter.max_proposals (drafter.check_gamma). Of the
        `generation`: its sampling `params`; its `logprobs` (None: off; k: with the k
        likeliest) make every emitted token carry its TokenLogprob from the target's row
        that chose it; its `guide` (grammar.Guide) constrains the output (see the module
        doc); its emitter's `cancelled()` stops the prefill between chunks, and its
        `images` come with the prefill's rows. `fallback` (a fallback.Fallback, None:
        none) is the decoder's to set, for a drafting sequence without a grammar;
        `profile` (set it before the first round) times each round's stages at the price
        of more host syncs."""
        guide, params = generation.guide, generation.params
        if guide is not None and drafter is not None and not isinstance(drafter, Guided):
            raise ValueError(f"{drafter!r} cannot propose under a grammar (no propose_guided)")
        self.model, self.drafter, self.generation, self.params = model, drafter, generation, params
        self.taps = tuple(drafter.taps) if drafter is not None else ()
        self.max_context = max_context
        self.gamma = gamma
        self.scheduler = scheduler or FixedScheduler()
        self.fallback: Fallback | None = None
        self.unobserved: list[mx.array] = []  # tap features of rows plain rounds committed
        self.queued: Queued | None = None  # a plain step queued for the next plain round
        self.profile = False
        self.keys = None if params.greedy else key_chain(params.seed)
        self.cache = model.make_cache(max_context) if cache is None else cache
        self.stats = None  # plain decoding: no speculation to measure
        if drafter is not None:
            self.stats = SpecStats(self.gamma if guide is None else 2 * self.gamma)  # forced positions come on top
        self.anchor: int | None = None
        self.logprobs = generation.logprobs
        self.first_logprob: TokenLogprob | None = None  # the prefill's token's
        self.guide = guide
        self.waiting = None  # a guide that engages at its start token (the module doc)
        if guide is not None and guide.waiting and guide.budget is None:
            self.guide, self.waiting = None, guide
        if drafter is not None:
            drafter.start(max_context)

    def _key(self) -> mx.array | None:
        return None if self.keys is None else next(self.keys)

    def prefill(self, tokens: Sequence[int], chunk_size: int = 512) -> int | None:
        """`prefill_steps` alone."""
        return drive(self.prefill_steps(tokens, chunk_size))

    def prefill_steps(self, tokens: Sequence[int], chunk_size: int = 512, stops: Sequence[int] = (),
                      on_stop: Callable[[int], None] | None = None) -> Steps:
        """`prefill_rows` over `tokens` (the prompt past the cached rows; with the
        generation's images, their real ids), every row's features handed to the drafter;
        return the first generated token (the first anchor), or None when the generation
        was cancelled between chunks (the cache and the drafter then hold the rows
        prefilled so far)."""
        row = yield from prefill_rows(self.model, tokens, self.cache, chunk_size, stops, self.drafter, on_stop,
                                      self.generation)
        if row is None:
            return None
        token = sample(row if self.guide is None else mask_logits(row, self.guide.words()), self.params, self._key())
        self.first_logprob = read_logprob((token, *logprob_arrays(row, token, self.logprobs)))
        self.anchor = int(token.item())
        if self.guide is not None:
            self.guide.push(self.anchor)
        elif self.starts_guide(self.anchor):
            self.engage()
        return self.anchor

    def starts_guide(self, token: int) -> bool:
        """`token` is the waiting guide's start token."""
        return self.waiting is not None and token == self.waiting.starts_after

    def engage(self) -> None:
        """The anchor started the waiting guide: from here every round is guided."""
        self.waiting.push(self.anchor)
        self.guide, self.waiting = self.waiting, None

    def round(self, max_new: int) -> RoundResult:
        """One round emitting at most `max_new` tokens (and never past max_context), alone."""
        return drive(self.round_steps(max_new))

    def round_steps(self, max_new: int) -> Steps:
        """`round` as a generator of its draft block and forwards (batch.py). Without a
        drafter or a grammar: one plain step, the next one queued (each token reaches the
        caller as it is read)."""
        if self.drafter is None and self.guide is None:  # plain decoding: one pipelined step
            return (yield from self.run_plain_steps(1, True))
        started = time.perf_counter()
        block = yield from self.draft_steps(max_new)
        if block.plain:
            return (yield from self.plain_steps(max_new))
        if self.profile:
            mx.eval(block.arrays())
        else:
            mx.async_eval(block.proposed)  # the draft runs while the host builds the verify
        drafted = time.perf_counter()
        verdict = yield from self.verify_steps(block)
        mx.eval(verdict, *block.logprob_arrays)
        read = np.array(verdict)  # the round's one host sync
        verified = time.perf_counter()
        result = self.commit(block, read)
        if self.profile:
            mx.eval(self.cache.arrays())
        else:  # the commit runs while the host hands out the tokens and builds the next draft; the
            # kept rows' features reach the draft's context with the next proposal (packed in a batch)
            mx.async_eval(self.cache.arrays(), self.unobserved)
        committed = time.perf_counter()
        if self.stats is not None:
            self.stats.record(result.proposed, result.accepted,
                              (drafted - started, verified - drafted, committed - verified) if self.profile else None)
        return result

    @property
    def committed(self) -> int:
        """Rows committed to the cache (a queued step's row is not)."""
        return self.cache.offset - (self.queued is not None)

    def plain_steps(self, max_new: int) -> Steps:
        """The plain rounds a Fallback chose, up to its next probe (at most PLAIN_RUN, and
        within max_new and the context), as one result: `run_plain`, queueing the next
        step when the Fallback says the next round is plain too."""
        n = max(1, min(max_new, self.max_context - self.committed - 1, PLAIN_RUN, self.fallback.plain_run()))
        self.fallback.skip(n - 1)
        return (yield from self.run_plain_steps(n, self.fallback.plain_next(self.committed + n)))

    def run_plain(self, n: int, queue_next: bool) -> RoundResult:
        """`run_plain_steps` alone."""
        return drive(self.run_plain_steps(n, queue_next))

    def run_plain_steps(self, n: int, queue_next: bool) -> Steps:
        """n one-row steps, pipelined (the next step is queued before the
        current token is read), no tapes; their tap features wait in `unobserved` for the
        drafter. Starts from a queued step if there is one; `queue_next` leaves the step
        after the last one queued (when the context has room for its row)."""
        cache, taps = self.cache, self.taps

        def step(token: mx.array, snapshot: Snapshot | None = None) -> Steps:
            logits, features = yield Forward(self.model, token, cache, taps)
            token = sample(logits[-1], self.params, self._key())
            logprob = logprob_arrays(logits[-1], token, self.logprobs)
            token = token.reshape(1).astype(mx.int32)
            mx.async_eval(token, features, *logprob)
            return Queued(token, features, snapshot, logprob)

        cut = self.waiting is not None  # the step after the guide's start token is rewound
        pending = self.queued or (yield from step(mx.array([self.anchor], dtype=mx.int32)))
        self.queued, tokens, logprobs = None, [], []
        for i in range(n):
            current, pending = pending, None
            if i + 1 < n:
                pending = yield from step(current.token, cache.snapshot() if cut else None)
            elif queue_next and cache.offset + 1 < self.max_context:
                pending = self.queued = yield from step(current.token, cache.snapshot())
            tokens.append(int(current.token.item()))
            logprobs.append(read_logprob((current.token, *current.logprob)))
            if self.drafter is not None:
                self.unobserved.append(current.features)
            if self.starts_guide(tokens[-1]):
                if pending is not None:
                    cache.restore(pending.snapshot)
                self.queued = None
                break
        self.anchor = tokens[-1]
        if self.starts_guide(self.anchor):
            self.engage()
        if self.stats is not None:
            self.stats.plain_rounds += len(tokens)
        return RoundResult(tokens, 0, 0, logprobs if self.logprobs is not None else None)

    # The round's stages, separately (the benchmarks time and count each one).

    def draft(self, max_new: int) -> Block:
        """`draft_steps` alone."""
        return drive(self.draft_steps(max_new))

    def draft_steps(self, max_new: int) -> Steps:
        """Draft and schedule: the proposals to verify (lazy, except the confidences a
        scheduler reads)."""
        if self.anchor is None:
            raise RuntimeError("prefill before the first round")
        room = min(max_new, self.max_context - self.committed - 1)
        if room < 1:
            raise ValueError(f"no room for a round: max_new={max_new}, {self.committed} rows committed "
                             f"of max_context={self.max_context}")
        if self.drafter is None:  # under a grammar (round_steps runs plain steps without one)
            return self.forced_block(room)
        gamma = min(self.gamma, room - 1)  # the bonus is always emitted
        draft_key, accept_key = self._key(), self._key()
        peers = ALONE
        if gamma and (self.fallback is not None or self.scheduler.uses_peers):
            peers = yield Peers()
        if gamma and self.fallback is not None and self.guide is None and not self.speculate(peers):
            return Block(None, None, mx.zeros((0,), mx.int32), accept_key, plain=True)
        self.sync_drafter()  # drops a queued plain step
        guide = self.guide
        if gamma and guide is None and self.drafter.sequential:
            gamma = min(gamma, self.scheduler.choose(gamma, None, peers, self.committed))  # a forward each: draft l
        if gamma == 0:  # one row left (or none chosen): a plain decode step
            return Block(None, None, mx.zeros((0,), mx.int32), accept_key,
                         masks=None if guide is None else guide.masks(0))
        if guide is None:
            proposal = yield Propose(self.drafter, self.anchor, gamma, self.params, draft_key)
            limit = gamma
        else:  # forced positions come on top of gamma, within twice gamma and the room
            limit = min(room - 1, 2 * self.gamma)
            proposal = yield Propose(self.drafter, self.anchor, gamma, self.params, draft_key, guide, limit)
            limit = proposal.tokens.shape[0]
            if limit == 0:
                return Block(None, None, mx.zeros((0,), mx.int32), accept_key, masks=guide.masks(0))
        confidence = None
        if self.scheduler.uses_confidence and proposal.confidence is not None:
            confidence = np.array(proposal.confidence[:limit], dtype=np.float32)
        l = min(limit, self.scheduler.choose(limit, confidence, peers, self.committed))
        proposed = proposal.tokens[:l].astype(mx.int32) if l else mx.zeros((0,), mx.int32)
        masks = None
        if guide is not None:
            guide.rollback(limit - l)
            masks = guide.masks(l)
        return Block(proposal, confidence, proposed, accept_key, masks=masks)

    def speculate(self, peers: tuple[int, int]) -> bool:
        """The Fallback's call at the sequence's context (a switch goes into the stats)."""
        drafts = self.fallback.speculate(peers, self.committed)
        if self.fallback.switch is not None and self.stats is not None:
            self.stats.switches.append(self.fallback.switch)
        return drafts

    def forced_block(self, room: int) -> Block:
        """Plain decoding under a grammar: the tokens the grammar forces after the anchor
        (up to the room before the bonus), verified with it in one forward, so a forced
        run costs one forward (jump-forward); their q is one-hot, so they are accepted."""
        guide, forced = self.guide, []
        while len(forced) < room - 1 and (token := guide.forced()) is not None:
            guide.push(token)
            forced.append(token)
        proposed = mx.array(forced, dtype=mx.int32) if forced else mx.zeros((0,), mx.int32)
        q = None
        if forced and not self.params.greedy:
            q = (mx.arange(self.model.args.vocab_size)[None] == proposed[:, None]).astype(mx.float32)
        proposal = Proposal(proposed, q, None) if forced else None
        return Block(proposal, None, proposed, self._key(), masks=guide.masks(len(forced)))

    def verify(self, block: Block) -> mx.array:
        """`verify_steps` alone."""
        return drive(self.verify_steps(block))

    def verify_steps(self, block: Block) -> Steps:
        """One target forward over [anchor, x_1..x_l] (GDN tapes recorded when there are
        proposals to reject, taps captured) and the acceptance test: [x_1..x_l, a, bonus]
        int32 (lazy)."""
        cache, l = self.cache, block.size
        block.snapshot = cache.snapshot(record=l > 0)  # a one-row round keeps its row: no replay
        rows = mx.concatenate([mx.array([self.anchor], dtype=mx.int32), block.proposed])
        logits, block.features = yield Forward(self.model, rows, cache, self.taps)
        raw = logits
        if block.masks is not None:
            logits = mask_logits(logits, block.masks)
        if self.params.greedy:
            verdict = accept_greedy(block.proposed, logits)
        else:
            q = block.proposal.q[:l] if l else mx.zeros((0, logits.shape[-1]), mx.float32)
            verdict = accept_sampled(block.proposed, filtered_probs(logits, self.params), q, block.accept_key)
        if self.logprobs is not None:
            block.logprob_arrays = verify_logprobs(raw, block.proposed, verdict[-1], self.logprobs)
        return mx.concatenate([block.proposed, verdict])

    def commit(self, block: Block, read: np.ndarray) -> RoundResult:
        """Keep the a + 1 rows [anchor, x_1..x_a] (`read` = the verify's result on the
        host): cache, drafter context, anchor, scheduler."""
        l = block.size
        accepted, bonus = int(read[l]), int(read[l + 1])
        tokens = [int(t) for t in read[:accepted]] + [bonus]
        logprobs = read_verify_logprobs(block.logprob_arrays, tokens) if block.logprob_arrays else None
        start = next((i for i, t in enumerate(tokens) if self.starts_guide(t)), None)
        if start is not None:  # cut at the guide's start token: it is the next anchor
            accepted, bonus, tokens = start, tokens[start], tokens[:start + 1]
            logprobs = logprobs[:start + 1] if logprobs is not None else None
        if self.guide is not None:
            self.guide.rollback(l - accepted)
            self.guide.push(bonus)
        self.cache.commit(block.snapshot, accepted + 1)
        self.anchor = bonus
        if self.drafter is not None:
            self.sync_drafter()  # rows in order
            self.drafter.observe(block.features[:accepted + 1])
        if block.proposal is not None and self.drafter is not None:
            self.scheduler.update(l, accepted, block.confidence)
            if self.fallback is not None:
                self.fallback.update(accepted + 1)
        if start is not None:
            self.engage()
        return RoundResult(tokens, l, accepted, logprobs)

    def sync_drafter(self) -> None:
        """Drop a queued plain step (its row leaves the cache) and hand the drafter the
        rows that plain (fallback) rounds committed, in one observe: before a drafted
        round, and before the cache and the drafter's context are kept."""
        if self.queued is not None:
            self.cache.restore(self.queued.snapshot)
            self.queued = None
        if self.unobserved and self.drafter is not None:
            rows, self.unobserved = self.unobserved, []
            self.drafter.observe(rows[0] if len(rows) == 1 else mx.concatenate(rows))
