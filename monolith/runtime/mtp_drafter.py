"""The drafter over the target checkpoint's own MTP head (models/mtp.py, `--draft mtp`;
docs/drafts.md 6).

The head's row t pairs the target's hidden state h_t with the embedding of the token
x_{t+1} that follows it, at position t, over the head's own KV cache. The drafter taps
two rows of every committed target row r: the embedding of its token x_r
(EMBEDDING_TAP) and its hidden state (HIDDEN_TAP). Observing rows stores their hidden
states and runs the head over every row whose next token is now known, so after n
observed rows the head's cache holds exactly the committed head rows 0..n-2 (row n-1
waits for its next token). A proposal with anchor x_n runs row n-1 paired with the
anchor; its output gives proposal 1, and each later proposal is one more one-row step
over the previous step's output and proposal. Those rows are dropped when the next rows
are observed or proposed from (the cache goes back to the committed rows), whatever the
round kept: the kept rows come back as target rows.

Proposals are drawn from the head's logits filtered by the request's sampling params
(q = that filtered distribution; one-hot under greedy params), so rejection sampling
keeps the target's distribution. It forks (one context per sequence of a batch; each
drafts alone) and proposes under a grammar. Its context is a `DraftContext` whose rows
are the head's K/V and the target's hidden states, so the prompt cache saves and
resumes it as it does a DSpark draft's.
"""

from __future__ import annotations

import mlx.core as mx

from ..models.cache import DraftContext, HybridCache, KVCache
from ..models.dspark import Proposal
from ..models.qwen3_5 import EMBEDDING_TAP, FINAL_NORM_TAP
from ..sampling import NEG_INF, SamplingParams, allowed, filtered_logits
from .drafter import Forking, Guided

# The target hidden state the head reads: the last layer's output AFTER the target's final
# norm, as vLLM and llama.cpp feed it at inference (speculators' training data takes it
# before that norm); docs/drafts.md 6 says why.
HIDDEN_TAP = FINAL_NORM_TAP
MAX_PROPOSALS = 8  # the head chains any number of steps; a round's proposals stop here


class MTPDrafter(Forking, Guided):
    """A `Drafter` (drafter.py) over an `MTPHead`, also Forking and Guided."""

    sequential = True  # each proposal is one more head forward (scheduler.py's cost model)

    def __init__(self, head, max_proposals: int = MAX_PROPOSALS):
        self.head = head
        self.taps = [EMBEDDING_TAP, HIDDEN_TAP]
        self.max_proposals = max_proposals
        self.context: DraftContext | None = None
        self.cache: HybridCache | None = None  # the head's KV (the context's first layer), to step the head

    def __repr__(self) -> str:
        return f"MTPDrafter(max_proposals={self.max_proposals})"

    def fork(self) -> MTPDrafter:
        return MTPDrafter(self.head, self.max_proposals)

    def make_context(self, max_context: int) -> DraftContext:
        """The context of one sequence: per committed row, the head's K/V (rows [0, offset
        - 1): the last row waits for its next token) and the target's hidden state (its two
        halves as keys and values, so that the prompt cache copies it as any row)."""
        a = self.head.args
        if a.hidden_size % 2:
            raise ValueError(f"the MTP drafter needs an even hidden size, got {a.hidden_size}")
        head = self.head.make_cache(max_context, self.max_proposals + 1).layers[0]
        return DraftContext([head, KVCache(1, a.hidden_size // 2, max_context + 1, self.head.dtype)], max_context)

    def start(self, max_context: int) -> None:
        self._use(self.make_context(max_context))

    def _use(self, context: DraftContext) -> None:
        self.context = context
        self.cache = HybridCache(context.layers[:1], context.max_context, self.max_proposals + 1)

    def observe(self, features: mx.array) -> None:
        """Store the rows' hidden states and run the head over every row whose next token
        is now known (all but the new last one, from the row before them on). The head's
        rows sit at plain positions, also after an image (docs/drafts.md 6.1)."""
        ctx = self._context()
        n, h, start = features.shape[0], self.head.args.hidden_size, ctx.offset
        hidden = features[:, h:]
        half = hidden.reshape(1, 1, n, h).astype(self.head.dtype)
        ctx.layers[1].write(start, half[..., :h // 2], half[..., h // 2:])
        ctx.offset = start + n
        if start:  # the previous last row meets its next token
            hidden = mx.concatenate([self._hidden(start - 1), hidden])
        embedded = features[:, :h] if start else features[1:, :h]  # each head row's next token
        if embedded.shape[0]:
            self._at(max(start - 1, 0))
            self.head.step(hidden[:-1], embedded, self.cache)

    def arrays(self) -> list[mx.array]:
        return [] if self.context is None else self.context.arrays()

    def snapshot(self):
        return self.context

    def restore(self, snapshot, rows: int) -> bool:
        if snapshot is None or snapshot.offset < rows or rows < 1:
            return False
        snapshot.restore(rows)
        self._use(snapshot)
        return True

    def _context(self) -> DraftContext:
        if self.context is None:
            raise RuntimeError("call drafter.start(max_context) before observe/propose")
        return self.context

    def _hidden(self, row: int) -> mx.array:
        """The target's hidden state of committed row `row`, [1, H]."""
        keys, values = self.context.layers[1].rows(row, row + 1)
        return mx.concatenate([keys, values], axis=-1).reshape(1, -1)

    def _at(self, rows: int) -> None:
        """Point the head's cache after its first `rows` rows (dropping any past them)."""
        self.cache.offset = self.cache.state_offset = self.cache.written = rows

    def _first_step(self, anchor) -> tuple[mx.array, mx.array]:
        """The last committed row through the head, paired with `anchor`: (its output
        [1, H], its logits F32 [V]); the last proposal's rows are dropped."""
        ctx = self._context()
        if not ctx.offset:
            raise RuntimeError("the drafter has observed no rows to propose from")
        self._at(ctx.offset - 1)
        out, logits = self.head.step(self._hidden(ctx.offset - 1), self.head.target.embed_tokens(_ids([anchor])),
                                     self.cache)
        return out, logits[-1]

    def _next_step(self, out: mx.array, token) -> tuple[mx.array, mx.array]:
        out, logits = self.head(out, _ids([token]), self.cache)
        return out, logits[-1]

    def propose(self, anchor: int, gamma: int, params: SamplingParams, key: mx.array | None) -> Proposal:
        """gamma proposals after `anchor`, one head step each (lazy)."""
        if not 1 <= gamma <= self.max_proposals:
            raise ValueError(f"gamma must be in [1, {self.max_proposals}], got {gamma}")
        if not params.greedy and key is None:
            raise ValueError("sampling with temperature > 0 needs a PRNG key (see key_chain)")
        keys = None if params.greedy else mx.random.split(key, gamma)
        out, logits = self._first_step(anchor)
        tokens, qs = [], []
        for k in range(gamma):
            if k:
                out, logits = self._next_step(out, tokens[-1])
            token, q = _draw(logits, params, None if keys is None else keys[k])
            tokens.append(token)
            qs.append(q)
        return Proposal(mx.concatenate(tokens), mx.stack(qs), None)

    def propose_guided(self, anchor: int, gamma: int, params: SamplingParams, key: mx.array | None, guide,
                       limit: int) -> Proposal:
        """Up to `limit` proposals legal under `guide` (grammar.Guide), which consumes them:
        a position the grammar forces takes its token without a draw and without counting
        against gamma; at most gamma others are drawn from the head's logits masked by the
        grammar (one host sync each). Ends after an end token."""
        if not params.greedy and key is None:
            raise ValueError("sampling with temperature > 0 needs a PRNG key (see key_chain)")
        keys = None if params.greedy else mx.random.split(key, max(limit, 1))
        vocab = self.head.args.vocab_size
        out = logits = None
        tokens, qs, drafted = [], [], 0
        for k in range(limit):
            forced = guide.forced()
            if forced is None and drafted == gamma:
                break
            if k == 0:
                out, logits = self._first_step(anchor)
            else:
                out, logits = self._next_step(out, tokens[-1])
            if forced is not None:
                token, q = forced, (mx.arange(vocab) == forced).astype(mx.float32)
            else:
                words = guide.words()
                masked = logits if words is None else mx.where(allowed(words, vocab), logits, NEG_INF)
                drawn, q = _draw(masked, params, None if keys is None else keys[k])
                token = int(drawn.item())
                drafted += 1
            guide.push(token)
            tokens.append(token)
            qs.append(q)
            if guide.ended:
                break
        if not tokens:
            return Proposal(mx.zeros((0,), mx.int32), mx.zeros((0, vocab), mx.float32), None)
        return Proposal(mx.array(tokens, mx.int32), mx.stack(qs), None)


def _ids(tokens) -> mx.array:
    """Token ids (ints or int32 arrays of one id) as int32 [n]."""
    return mx.concatenate([t.reshape(1).astype(mx.int32) if isinstance(t, mx.array) else mx.array([int(t)], mx.int32)
                           for t in tokens])


def _draw(logits: mx.array, params: SamplingParams, key) -> tuple[mx.array, mx.array]:
    """One proposal from the head's logits [V]: (int32 [1], its q [V], the filtered
    distribution it was drawn from: one-hot under greedy params)."""
    row = filtered_logits(logits, params)
    if params.greedy:
        token = mx.argmax(row)
    else:
        token = mx.random.categorical(row[None], axis=-1, key=key)[0]
    return token.reshape(1).astype(mx.int32), mx.softmax(row, axis=-1)
