"""Speculative decoding with a drafter (dspark.md 4): prefill with taps, then rounds of
draft -> schedule -> verify -> accept -> commit.

Positions: after the prefill the cache holds the P prompt rows and the first token, the
anchor, sits at position P outside the cache. A round verifies [anchor, x_1..x_l] in
one target forward (rows P'..P'+l), accepts a <= l proposals, emits x_1..x_a and the
bonus, and commits the a + 1 rows [anchor, x_1..x_a]: the KV offset moves past them,
the gated DeltaNet states are replayed from the pre-verify snapshot over exactly those
rows (`HybridCache.commit`), and the drafter observes their tap features. The bonus is
the next anchor.

A `Fallback` may make a round a plain one-row step (no draft; the drafter observes the
rows such rounds commit in one batch before it next drafts, `sync_drafter`) while the
recent rounds emit fewer tokens than a round costs in plain steps (scheduler.Fallback;
the break-even is `measure_break_even`). Plain steps are pipelined as in decode.generate,
and across rounds too: when the next round will be plain as well, the run ends with the
next step already queued (`Queued`; dropped, and its row rewound, if no round takes it).

Limits: a round never emits more tokens than max_tokens or the context allow (the
sequence, prompt + output, stays within max_context, as in plain decoding), so the
block shrinks near the end and committed rows never pass max_context - 1; a stop token
ends the output where it is read, and nothing after it is emitted.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..models.cache import Snapshot
from .decode import GenerationResult, check_request
from .drafter import Drafter, Proposal
from ..sampling import SamplingParams, filtered_probs, key_chain, sample
from .scheduler import CostScheduler, Fallback, FixedScheduler, Scheduler, measure_costs
from .stats import SpecStats

DEFAULT_BLOCK_SIZE = 7  # proposals per round: 8 verify rows
PLAIN_RUN = 8  # plain steps a fallback round runs at most (tokens reach the caller per round)


def accept_greedy(proposed: mx.array, logits: mx.array) -> mx.array:
    """[a, bonus] (int32, lazy) for proposals [l] against the verify logits [l + 1, V]:
    a = the longest prefix with x_k == argmax(row k-1), bonus = argmax of row a."""
    target = mx.argmax(logits, axis=-1).astype(mx.int32)
    accepted = mx.sum(mx.cumprod((proposed == target[:-1]).astype(mx.int32)))
    return mx.stack([accepted, mx.take(target, accepted)]).astype(mx.int32)


def accept_sampled(proposed: mx.array, p: mx.array, q: mx.array, key: mx.array) -> mx.array:
    """[a, bonus] (int32, lazy) by rejection sampling: x_k (k = 1..l) is accepted with
    probability min(1, p(x_k) / q(x_k)), p = the target's filtered rows [l + 1, V], q =
    the draft's [l, V]; the bonus is drawn from normalize(max(p - q, 0)) at the first
    rejection (from p when that is empty) or from p's last row when all were accepted.
    The emitted tokens are then distributed exactly as sampling from p row by row."""
    l = proposed.shape[0]
    accept_key, bonus_key = mx.random.split(key)
    rows = mx.arange(l)
    p_x, q_x = p[rows, proposed], q[rows, proposed]
    u = mx.random.uniform(shape=(l,), key=accept_key)
    accepted = mx.sum(mx.cumprod((u * q_x < p_x).astype(mx.int32)))  # u < p/q, exactly, for q > 0
    p_a = mx.take(p, accepted, axis=0)
    q_a = mx.take(mx.concatenate([q, mx.zeros((1, q.shape[1]), q.dtype)]), accepted, axis=0)
    residual = mx.maximum(p_a - q_a, 0.0)
    residual = mx.where(mx.sum(residual) > 0, residual, p_a)
    bonus = mx.random.categorical(mx.log(residual), key=bonus_key)
    return mx.stack([accepted.astype(mx.int32), bonus.astype(mx.int32)])


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


@dataclass(frozen=True)
class RoundResult:
    tokens: list[int]  # emitted: the accepted proposals then the bonus (accepted + 1 tokens)
    proposed: int  # l, proposals verified
    accepted: int  # a


class SpeculativeDecoder:
    """One sequence: the target's cache, the drafter's context, the anchor; `prefill`
    once, then `round` until done. `generate_speculative` is the loop around it."""

    def __init__(self, model, drafter: Drafter, params: SamplingParams, max_context: int,
                 block_size: int | None = None, scheduler: Scheduler | None = None, profile: bool = False,
                 fallback: Fallback | None = None):
        self.model, self.drafter, self.params = model, drafter, params
        self.max_context = max_context
        self.gamma = check_block_size(block_size, drafter.max_proposals)
        self.scheduler = scheduler or FixedScheduler()
        self.fallback = fallback
        self.unobserved: list[mx.array] = []  # tap features of rows plain rounds committed
        self.queued: Queued | None = None  # a plain step queued for the next plain round
        self.profile = profile
        self.keys = None if params.greedy else key_chain(params.seed)
        self.cache = model.make_cache(max_context)
        self.stats = SpecStats(self.gamma)
        self.anchor: int | None = None
        drafter.start(max_context)

    def _key(self) -> mx.array | None:
        return None if self.keys is None else next(self.keys)

    def prefill(self, prompt: Sequence[int], chunk_size: int = 512) -> int:
        """Run the prompt in chunks, handing every row's features to the drafter; return
        the first generated token (the first anchor)."""
        tokens = mx.array(list(prompt), dtype=mx.int32)
        total = tokens.shape[0]
        cache, taps = self.cache, self.drafter.taps
        cache.check(total, limit=cache.max_context)
        for start in range(0, total, chunk_size):
            last = start + chunk_size >= total
            logits, features = self.model.forward(tokens[start:start + chunk_size], cache, taps=taps,
                                                  logits="last" if last else "none")
            self.drafter.observe(features)
            if not last:
                mx.eval(cache.arrays(), self.drafter.arrays())  # bound the graph, as model.prefill does
        self.anchor = int(sample(logits[-1], self.params, self._key()).item())
        return self.anchor

    def round(self, max_new: int) -> RoundResult:
        """One round emitting at most `max_new` tokens (and never past max_context)."""
        started = time.perf_counter()
        block = self.draft(max_new)
        if block.plain:
            return self.plain_steps(max_new)
        if self.profile:
            mx.eval(block.arrays())
        else:
            mx.async_eval(block.proposed)  # the draft runs while the host builds the verify
        drafted = time.perf_counter()
        read = np.array(self.verify(block))  # the round's one host sync
        verified = time.perf_counter()
        result = self.commit(block, read)
        if self.profile:
            mx.eval(self.cache.arrays())
        else:  # the commit runs while the host hands out the tokens and builds the next draft
            mx.async_eval(self.cache.arrays(), self.drafter.arrays(), self.unobserved)
        committed = time.perf_counter()
        self.stats.record(result.proposed, result.accepted,
                          (drafted - started, verified - drafted, committed - verified) if self.profile else None)
        return result

    @property
    def committed(self) -> int:
        """Rows committed to the cache (a queued step's row is not)."""
        return self.cache.offset - (self.queued is not None)

    def plain_steps(self, max_new: int) -> RoundResult:
        """The plain rounds a Fallback chose, up to its next probe (at most PLAIN_RUN, and
        within max_new and the context), as one result: `run_plain`, queueing the next
        step when the Fallback says the next round is plain too."""
        n = max(1, min(max_new, self.max_context - self.committed - 1, PLAIN_RUN, self.fallback.plain_run()))
        self.fallback.skip(n - 1)
        return self.run_plain(n, self.fallback.plain_next())

    def run_plain(self, n: int, queue_next: bool) -> RoundResult:
        """n one-row steps pipelined as decode.generate (the next step is queued before the
        current token is read), no tapes; their tap features wait in `unobserved` for the
        drafter. Starts from a queued step if there is one; `queue_next` leaves the step
        after the last one queued (when the context has room for its row)."""
        cache, taps = self.cache, self.drafter.taps

        def step(token: mx.array, snapshot: Snapshot | None = None) -> Queued:
            logits, features = self.model.forward(token, cache, taps=taps)
            token = sample(logits[-1], self.params, self._key()).reshape(1).astype(mx.int32)
            mx.async_eval(token, features)
            return Queued(token, features, snapshot)

        pending = self.queued or step(mx.array([self.anchor], dtype=mx.int32))
        self.queued, tokens = None, []
        for i in range(n):
            current = pending
            if i + 1 < n:
                pending = step(current.token)
            elif queue_next and cache.offset + 1 < self.max_context:
                self.queued = step(current.token, cache.snapshot())
            tokens.append(int(current.token.item()))
            self.unobserved.append(current.features)
        self.anchor = tokens[-1]
        self.stats.plain_rounds += n
        return RoundResult(tokens, 0, 0)

    # The round's stages, separately (the benchmarks time and count each one).

    def draft(self, max_new: int) -> Block:
        """Draft and schedule: the proposals to verify (lazy, except the confidences a
        scheduler reads)."""
        if self.anchor is None:
            raise RuntimeError("prefill before the first round")
        room = min(max_new, self.max_context - self.committed - 1)
        if room < 1:
            raise ValueError(f"no room for a round: max_new={max_new}, {self.committed} rows committed "
                             f"of max_context={self.max_context}")
        gamma = min(self.gamma, room - 1)  # the bonus is always emitted
        draft_key, accept_key = self._key(), self._key()
        if gamma and self.fallback is not None and not self.fallback.speculate():
            return Block(None, None, mx.zeros((0,), mx.int32), accept_key, plain=True)
        self.sync_drafter()  # drops a queued plain step
        if gamma == 0:  # one row left: a plain decode step
            return Block(None, None, mx.zeros((0,), mx.int32), accept_key)
        proposal = self.drafter.propose(self.anchor, gamma, self.params, draft_key)
        confidence = None
        if self.scheduler.uses_confidence and proposal.confidence is not None:
            confidence = np.array(proposal.confidence[:gamma], dtype=np.float32)
        l = min(gamma, self.scheduler.choose(gamma, confidence))
        proposed = proposal.tokens[:l].astype(mx.int32) if l else mx.zeros((0,), mx.int32)
        return Block(proposal, confidence, proposed, accept_key)

    def verify(self, block: Block) -> mx.array:
        """One target forward over [anchor, x_1..x_l] (GDN tapes recorded when there are
        proposals to reject, taps captured) and the acceptance test: [x_1..x_l, a, bonus]
        int32 (lazy)."""
        cache, l = self.cache, block.size
        cache.check(1 + l)
        block.snapshot = cache.snapshot(record=l > 0)  # a one-row round keeps its row: no replay
        rows = mx.concatenate([mx.array([self.anchor], dtype=mx.int32), block.proposed])
        logits, block.features = self.model.forward(rows, cache, taps=self.drafter.taps)
        if self.params.greedy:
            verdict = accept_greedy(block.proposed, logits)
        else:
            q = block.proposal.q[:l] if l else mx.zeros((0, logits.shape[-1]), mx.float32)
            verdict = accept_sampled(block.proposed, filtered_probs(logits, self.params), q, block.accept_key)
        return mx.concatenate([block.proposed, verdict])

    def commit(self, block: Block, read: np.ndarray) -> RoundResult:
        """Keep the a + 1 rows [anchor, x_1..x_a] (`read` = the verify's result on the
        host): cache, drafter context, anchor, scheduler."""
        l = block.size
        accepted, bonus = int(read[l]), int(read[l + 1])
        if accepted < l:  # else the forward's own states are those after all l + 1 rows
            self.cache.commit(block.snapshot, accepted + 1)
        self.sync_drafter()  # rows in order
        self.drafter.observe(block.features[:accepted + 1])
        self.anchor = bonus
        if block.proposal is not None:
            self.scheduler.update(l, accepted, block.confidence)
            if self.fallback is not None:
                self.fallback.update(accepted + 1)
        return RoundResult([int(t) for t in read[:accepted]] + [bonus], l, accepted)

    def sync_drafter(self) -> None:
        """Drop a queued plain step (its row leaves the cache) and hand the drafter the
        rows that plain (fallback) rounds committed, in one observe: before a drafted
        round, and before the cache and the drafter's context are kept."""
        if self.queued is not None:
            self.cache.restore(self.queued.snapshot)
            self.queued = None
        if self.unobserved:
            rows, self.unobserved = self.unobserved, []
            self.drafter.observe(rows[0] if len(rows) == 1 else mx.concatenate(rows))


def measure_break_even(model, drafter: Drafter, gamma: int, params: SamplingParams, context: int = 64,
                       repeats: int = 6) -> float:
    """A drafted round's cost in plain steps, as the decoder runs both (scheduler.Fallback's
    break-even): the time of `repeats` consecutive rounds (draft, verify of gamma + 1
    rows, commit) per round over the time of `repeats` chained runs of PLAIN_RUN pipelined
    plain steps per step, each after a warm-up, on a scratch decoder holding `context`
    random rows. Restarts the drafter: call it before the sequence's `drafter.start`."""
    prompt = mx.random.randint(0, model.args.vocab_size, (context,), key=mx.random.key(0)).tolist()
    decoder = SpeculativeDecoder(model, drafter, params, context + (repeats + 1) * (gamma + 1 + PLAIN_RUN) + 2,
                                 gamma, FixedScheduler())
    decoder.prefill(prompt)

    def seconds(run) -> float:
        run()  # warm-up
        mx.eval(decoder.cache.arrays())
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        mx.eval(decoder.cache.arrays(), decoder.unobserved)
        return time.perf_counter() - start

    round_seconds = seconds(lambda: decoder.round(gamma + 1)) / repeats
    step_seconds = seconds(lambda: decoder.run_plain(PLAIN_RUN, queue_next=True)) / (repeats * PLAIN_RUN)
    decoder.sync_drafter()
    return round_seconds / step_seconds


def check_block_size(block_size: int | None, max_proposals: int) -> int:
    """gamma: the proposals per round, default min(7, max_proposals)."""
    if block_size is None:
        return min(DEFAULT_BLOCK_SIZE, max_proposals)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= max_proposals:
        raise ValueError(f"the draft block size must be an integer in 1..{max_proposals} "
                         f"(the draft's proposals per block), got {block_size!r}")
    return block_size


def generate_speculative(
    model,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    max_tokens: int,
    params: SamplingParams,
    stop_ids: Iterable[int],
    max_context: int,
    prefill_chunk_size: int = 512,
    block_size: int | None = None,
    scheduler: Scheduler | None = None,
    on_token: Callable[[int], None] | None = None,
    on_round: Callable[[RoundResult, SpeculativeDecoder], None] | None = None,
    profile: bool = False,
    fallback: Fallback | None = None,
) -> GenerationResult:
    """`decode.generate` with a drafter: the same arguments, limits, stop handling and
    result, plus `result.speculative` (rounds, acceptance, stage seconds when profiled).
    A cost scheduler without timings is calibrated first (`measure_costs`, not timed).
    `on_round(result, decoder)` sees each round after its commit; a `fallback` turns
    rounds into plain one-row steps while drafting does not pay (scheduler.Fallback)."""
    prompt = check_request(prompt_ids, model.args.vocab_size, max_tokens, max_context, prefill_chunk_size)
    gamma = check_block_size(block_size, drafter.max_proposals)
    stops = frozenset(int(t) for t in stop_ids)
    if isinstance(scheduler, CostScheduler) and not scheduler.calibrated:
        scheduler.set_costs(*measure_costs(model, drafter, gamma, params))

    start = time.perf_counter()
    decoder = SpeculativeDecoder(model, drafter, params, max_context, gamma, scheduler, profile, fallback)
    emitted = [decoder.prefill(prompt, prefill_chunk_size)]
    first_at = time.perf_counter()

    def emit(token: int) -> bool:
        if on_token is not None:
            on_token(token)
        return True

    out, finish, read = run_rounds(decoder, emitted, min(max_tokens, max_context - len(prompt)), stops, emit,
                                   on_round)
    end = time.perf_counter()
    return GenerationResult(out, finish, len(prompt), first_at - start, end - first_at, read - 1, decoder.stats)


def run_rounds(decoder: SpeculativeDecoder, emitted: list[int], budget: int, stops: frozenset[int],
               on_token: Callable[[int], bool],
               on_round: Callable[[RoundResult, SpeculativeDecoder], None] | None = None) -> tuple[list[int], str, int]:
    """Hand out the tokens in `emitted` (the prefill's first one), then those of rounds,
    which `emitted` collects, each to `on_token`, until a stop token (not output: "stop"),
    `budget` output tokens ("length") or `on_token` returning False ("abort"). Returns
    (output, finish reason, tokens read, a stop token included)."""
    out: list[int] = []
    pending, read = list(emitted), 0
    while True:
        for token in pending:
            read += 1
            if token in stops:
                return out, "stop", read
            out.append(token)
            if not on_token(token):
                return out, "abort", read
        if len(out) >= budget:
            return out, "length", read
        result = decoder.round(budget - len(out))
        if on_round is not None:
            on_round(result, decoder)
        pending = result.tokens
        emitted += pending
