"""The drafter over the target checkpoint's own MTP head (models/mtp.py, `--draft mtp`;
docs/drafts.md 6).

The head's row t pairs the target's hidden state h_t with the embedding of the token
x_{t+1} that follows it, at position t, over the head's own KV cache. The drafter taps
two rows of every committed target row r: the embedding of its token x_r
(EMBEDDING_TAP) and its hidden state (HIDDEN_TAP). At a proposal with anchor x_n (n
rows observed), the rows observed since the last proposal go through the head in one
step, each paired with the next row's token embedding and the last one with the
anchor's; so the head's cache then holds exactly the n committed rows. The last row's
output gives proposal 1, and each later proposal is one more one-row step over the
previous step's output and proposal. Those speculative rows are dropped at the next
proposal (the cache rewinds to the committed rows), whatever the round kept: the kept
rows come back as target rows.

Proposals are drawn from the head's logits filtered by the request's sampling params
(q = that filtered distribution; one-hot under greedy params), so rejection sampling
keeps the target's distribution. It forks (one context per sequence of a batch; each
drafts alone) and proposes under a grammar. It cannot resume (snapshot() is None): a
prompt-cache hit is not taken, every prompt is prefilled whole.
"""

from __future__ import annotations

import mlx.core as mx

from ..models.dspark import Proposal
from ..models.qwen3_5 import EMBEDDING_TAP, FINAL_NORM_TAP
from ..sampling import NEG_INF, SamplingParams, allowed, filtered_logits

# The target hidden state the head reads: the last layer's output AFTER the target's final
# norm, as vLLM and llama.cpp feed it at inference (speculators' training data takes it
# before that norm); docs/drafts.md 6 says why.
HIDDEN_TAP = FINAL_NORM_TAP
MAX_PROPOSALS = 8  # the head chains any number of steps; a round's proposals stop here


class MTPDrafter:
    """A `Drafter` (drafter.py) over an `MTPHead`, also Forking and Guided."""

    def __init__(self, head, max_proposals: int = MAX_PROPOSALS):
        self.head = head
        self.taps = [EMBEDDING_TAP, HIDDEN_TAP]
        self.sequential = True  # each proposal is one more head forward (scheduler.py's cost model)
        self.max_proposals = max_proposals
        self.cache = None
        self.pending: list[mx.array] = []  # features observed since the last proposal
        self.last: mx.array | None = None  # the latest committed row's features
        self.committed = 0

    def __repr__(self) -> str:
        return f"MTPDrafter(max_proposals={self.max_proposals})"

    def fork(self) -> MTPDrafter:
        return MTPDrafter(self.head, self.max_proposals)

    def start(self, max_context: int) -> None:
        self.cache = self.head.make_cache(max_context, self.max_proposals + 1)
        self.pending, self.last = [], None
        self.committed = 0  # the head's cache rows that pair committed rows (the rest: the last proposal's)

    def observe(self, features: mx.array) -> None:
        if self.cache is None:
            raise RuntimeError("call drafter.start(max_context) before observe/propose")
        self.pending.append(features)

    def arrays(self) -> list[mx.array]:
        return ([] if self.cache is None else self.cache.arrays()) + self.pending

    def snapshot(self):
        return None  # cannot resume

    def restore(self, snapshot, rows: int) -> bool:
        return False

    def _first_step(self, anchor) -> tuple[mx.array, mx.array]:
        """The rows observed since the last proposal through the head (the latest committed
        row again when there are none), the last one paired with `anchor`: (its output
        [1, H], its logits F32 [V])."""
        if self.cache is None:
            raise RuntimeError("call drafter.start(max_context) before observe/propose")
        if self.pending:
            rows, start = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending), self.committed
        elif self.last is not None:  # proposing again from the same rows
            rows, start = self.last, self.committed - 1
        else:
            raise RuntimeError("the drafter has observed no rows to propose from")
        self.cache.rewind(start)  # drop the last proposal's rows
        h = self.head.args.hidden_size
        embedded = mx.concatenate([rows[1:, :h], self.head.target.embed_tokens(_ids([anchor]))])
        out, logits = self.head.step(rows[:, h:], embedded, self.cache)
        self.pending, self.last, self.committed = [], rows[-1:], self.cache.offset
        return out[-1:], logits[-1]

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
