"""The DSpark / DFlash draft model (docs/drafts.md sections 1-3): DeepSpec-native, its NVFP4
export, speculators (reduced vocabulary, sliding window) and z-lab DFlash. Its arguments
are read in draft_args.py, its decoder layer is draft_layer.py's, its Markov and
confidence heads draft_heads.py's; monolith.models.loading.load_draft loads one from a pack.

The draft is a few Qwen3 decoder layers whose keys/values are [context ; block]. The
context rows are `hidden_norm(fc(target features))`, the same for every layer, so their
K/V are computed once, when the target commits them, and kept in a `DraftContext`. The
block is [anchor, mask x (B-1)] (times the input embedding scale) at positions
p..p+B-1 and only it makes queries. It sees every context row (a sliding-window layer:
the last `window`) and, per layer, the whole block or (a causal layer: speculators'
causal sliding window, vLLM's `causal`) only the block slots up to its own. Slot k
gives U_k = lm_head(h_k); a Markov head adds a bias that depends on the token drawn
before it, so proposals are drawn one after another, on the device (no host sync:
`propose` returns lazy arrays); a confidence head predicts each proposal's survival.
`forward_batch` runs the blocks of several sequences at once: packed through the
projections and MLPs, each attending over its own context.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..sampling import NEG_INF, SamplingParams, allowed, filtered_logits
from .cache import CacheError, DraftContext, KVCache
from .draft_args import DraftArgs
from .draft_heads import ConfidenceHead, MarkovHead
from .draft_layer import DraftLayer, Rope
from .layers import Embedding, rms_norm, run_now
from .weights import PackWeights

__all__ = ["Draft", "DraftContext", "Proposal"]


@dataclass(frozen=True)
class Proposal:
    """`tokens` int32 [gamma] (target ids); `q` float32 [gamma, V_target]: the filtered
    distribution each token was drawn from (one-hot when greedy); `confidence` float32
    [gamma] (probability that proposal k survives given that all before it did) or None."""

    tokens: mx.array
    q: mx.array
    confidence: mx.array | None


class Draft:
    def __init__(self, args: DraftArgs, weights: PackWeights, target, draft_to_target: mx.array | None):
        a, w = args, weights
        self.args, self.dtype = a, w.dtype
        self.pack_sha256: str | None = None  # the pack it was loaded from (loading.py)
        h, self.target_vocab = a.hidden_size, target.args.vocab_size
        if w.has_linear("embed_tokens"):
            self.embed_tokens = Embedding(w.linear("embed_tokens", (self.target_vocab, h)), self.dtype)
        else:  # bound to the target's (frozen copies in every real draft)
            self.embed_tokens = target.embed_tokens
        self.lm_head = w.linear("lm_head") if w.has_linear("lm_head") else target.lm_head
        self.draft_vocab = self.lm_head.out_features
        self.draft_to_target = draft_to_target
        self._draft_ids = None  # draft_to_target on the host, for grammar masks
        self.fc = w.linear("fc", (h, len(a.taps) * target.args.hidden_size))
        self.hidden_norm = w.tensor("hidden_norm", (h,), mx.float32)
        self.norm = w.tensor("norm", (h,), mx.float32)
        self.rope = Rope(a)
        self.layers = [DraftLayer(a, w, i, self.rope) for i in range(a.num_layers)]
        self.markov = None
        if a.markov_rank:
            self.markov = MarkovHead(w, a.markov_head_type, a.markov_rank, h, self.target_vocab, self.draft_vocab)
        self.confidence_head = None
        if a.confidence_head:
            self.confidence_head = ConfidenceHead(w, h, a.markov_rank if a.confidence_with_markov else 0)
        masks = mx.full((a.block_size - 1,), a.mask_token_id, mx.int32)
        self.mask_embeddings = self._block_input(masks)  # the same every round

    def _block_input(self, ids: mx.array) -> mx.array:
        x = self.embed_tokens(ids)
        if self.args.input_embedding_scale != 1:
            x = x.astype(mx.float32) * self.args.input_embedding_scale
        return x.astype(self.dtype)

    @property
    def taps(self) -> list[int]:
        return list(self.args.taps)

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def max_proposals(self) -> int:
        return self.args.block_size - (0 if self.args.sample_from_anchor else 1)

    # -- context

    def make_context(self, max_context: int) -> DraftContext:
        if max_context < 1:
            raise ValueError(f"max_context must be positive, got {max_context}")
        capacity = max_context + self.block_size
        a = self.args
        return DraftContext([KVCache(a.num_kv_heads, a.head_dim, capacity, self.dtype) for _ in self.layers],
                            max_context)

    def append_context(self, ctx: DraftContext, features: mx.array) -> None:
        """Append the target features [n, len(taps) * H] of the next n committed rows."""
        self.append_batch([(ctx, features)])

    def append_batch(self, items: list[tuple[DraftContext, mx.array]]) -> None:
        """`append_context` for several sequences at once, items (ctx, features): their
        rows are packed through fc and each layer's K/V projection, and each context
        takes its own at its own offset. Every item is checked before any changes."""
        width = self.fc.shape[1]
        if len({id(ctx) for ctx, _ in items}) != len(items):
            raise ValueError("two items of one context append share a context")
        for ctx, features in items:
            if features.ndim != 2 or features.shape[1] != width or features.shape[0] < 1:
                raise ValueError(f"features must be [n >= 1, {width}] (len(taps) x hidden), "
                                 f"got {tuple(features.shape)}")
            n = features.shape[0]
            if ctx.offset + n > ctx.max_context:
                raise CacheError(f"{n} context rows at offset {ctx.offset} exceed the draft context's "
                                 f"max_context={ctx.max_context}")
        rows = [features for _, features in items]
        packed = (rows[0] if len(rows) == 1 else mx.concatenate(rows)).astype(self.dtype)[None]
        c = rms_norm(self.fc(packed), self.hidden_norm, self.args.rms_norm_eps)
        lengths = [f.shape[0] for f in rows]
        starts = list(itertools.accumulate(lengths, initial=0))
        groups, index = self._append_groups(lengths, starts)
        offsets = [ctx.offset for ctx, _ in items]
        for i, layer in enumerate(self.layers):
            kv = layer.kv(c)
            for group in groups:
                if len(items) == 1:
                    part = kv
                elif len(group) == 1:
                    part = kv[:, starts[group[0]]:starts[group[0] + 1]]
                else:
                    part = kv[0][index]
                k, v = layer.context_kv(part, [offsets[j] for j in group])
                for g, j in enumerate(group):
                    one = (k, v) if len(group) == 1 else (k[g:g + 1, :, :lengths[j]], v[g:g + 1, :, :lengths[j]])
                    items[j][0].layers[i].update(*one, offsets[j])
        for ctx, n in zip((ctx for ctx, _ in items), lengths):
            ctx.offset += n

    def _append_groups(self, lengths: list[int], starts: list[int]) -> tuple[list[list[int]], mx.array | None]:
        """How append_batch runs the K/V norm and RoPE of items with these row counts
        (starting at these packed rows): the items of at most a block's rows (a round's
        kept rows) stacked as one group, each padded to the longest with copies of its own
        last row (`index` gathers them from the packed rows), and every longer item (a
        prefill chunk) alone."""
        short = [j for j, n in enumerate(lengths) if n <= self.block_size] if len(lengths) > 1 else []
        if len(short) < 2:
            return [[j] for j in range(len(lengths))], None
        width = max(lengths[j] for j in short)
        index = mx.array([[starts[j] + min(t, lengths[j] - 1) for t in range(width)] for j in short], mx.int32)
        return [short] + [[j] for j in range(len(lengths)) if j not in short], index

    # -- proposals

    def forward(self, ctx: DraftContext, anchor) -> mx.array:
        """Hidden states [B, H] after the final norm of the block [anchor, mask x (B-1)]
        at positions ctx.offset... (`anchor`: a target token id, int or int32 mx.array)."""
        return self.forward_batch([(ctx, anchor)])[0]

    def forward_batch(self, items: list[tuple[DraftContext, object]]) -> list[mx.array]:
        """`forward` for several sequences at once, items (ctx, anchor): their blocks are
        packed through the projections, norms and MLPs, and each attends over its own
        context. Returns each item's hidden states [B, H]."""
        if not items:
            raise ValueError("forward_batch needs at least one item")
        if len({id(ctx) for ctx, _ in items}) != len(items):
            raise ValueError("two items of one draft forward share a context")
        ids = [self._anchor(anchor) for _, anchor in items]
        anchors = self._block_input(ids[0] if len(ids) == 1 else mx.concatenate(ids))
        rows = [anchors] if len(items) == 1 else [anchors[i:i + 1] for i in range(len(items))]
        x = mx.concatenate([part for anchor in rows for part in (anchor, self.mask_embeddings)])[None]
        offsets = [ctx.offset for ctx, _ in items]
        for i, layer in enumerate(self.layers):
            x = layer(x, [ctx.layers[i] for ctx, _ in items], offsets)
            run_now(x)
        h = rms_norm(x, self.norm, self.args.rms_norm_eps)[0]
        b = self.block_size
        return [h] if len(items) == 1 else [h[i * b:(i + 1) * b] for i in range(len(items))]

    def _anchor(self, anchor) -> mx.array:
        """A target token id (int or int32 mx.array) as an int32 [1]."""
        if isinstance(anchor, mx.array):
            return anchor.reshape(1).astype(mx.int32)
        if not 0 <= int(anchor) < self.target_vocab:
            raise ValueError(f"anchor must be a token id in [0, {self.target_vocab}), got {anchor}")
        return mx.array([int(anchor)], mx.int32)

    def propose(self, ctx: DraftContext, anchor, gamma: int, params: SamplingParams,
                key: mx.array | None = None, hidden: mx.array | None = None) -> Proposal:
        """`gamma` proposals after `anchor` (at position ctx.offset), drawn serially from
        U_k + B_k(prev); lazy arrays (evaluating them is the caller's one sync). `hidden`:
        `forward(ctx, anchor)` when the caller ran it already (forward_batch)."""
        h = self.forward(ctx, anchor) if hidden is None else hidden
        return self.propose_batch([(anchor, gamma, h)], params, key)[0]

    def propose_batch(self, items: list[tuple[object, int, mx.array]], params: SamplingParams,
                      key: mx.array | None = None) -> list[Proposal]:
        """`propose` for several sequences whose blocks ran (forward_batch), items (anchor,
        gamma, hidden [block, H]): their lm_head rows, Markov chains and confidences run
        as one, slot after slot (a sequence with a smaller gamma takes its first ones:
        each slot depends only on those before it). Greedy only, or one sequence (a
        sampled one draws from its own key)."""
        if not items:
            raise ValueError("propose_batch needs at least one item")
        for _, gamma, _ in items:
            if not 1 <= gamma <= self.max_proposals:
                raise ValueError(f"gamma must be in [1, {self.max_proposals}], got {gamma}")
        if not params.greedy and key is None:
            raise ValueError("sampling with temperature > 0 needs a PRNG key (see key_chain)")
        if not params.greedy and len(items) > 1:
            raise ValueError("sampled proposals draw from each sequence's own key: one item at a time")
        first = 0 if self.args.sample_from_anchor else 1  # z-lab DFlash: slot 0 predicts nothing
        g = max(gamma for _, gamma, _ in items)
        h = mx.stack([hidden[first:first + g] for _, _, hidden in items])  # [B, g, H]
        u = self.lm_head(h).astype(mx.float32)
        anchors = [self._anchor(anchor) for anchor, _, _ in items]
        prev = anchors[0] if len(anchors) == 1 else mx.concatenate(anchors)
        if self.markov is None:
            logits = filtered_logits(u, params)
            tokens = self._draw(logits, params, key)
            prev_embeddings = None
        else:
            tokens, logits, prev_embeddings = self._markov_chain(u, h, prev, params, key)
        q = self._to_target(mx.softmax(logits, axis=-1))
        confidence = None
        if self.confidence_head is not None:
            confidence = mx.sigmoid(self.confidence_head.logits(h, prev_embeddings))

        def row(a: mx.array | None, i: int, n: int) -> mx.array | None:  # sequence i's first n slots
            if a is None:
                return None
            return a.reshape(a.shape[1:]) if len(items) == 1 and n == g else a[i, :n]

        return [Proposal(row(tokens, i, gamma), row(q, i, gamma), row(confidence, i, gamma))
                for i, (_, gamma, _) in enumerate(items)]

    def propose_guided(self, ctx: DraftContext, anchor, gamma: int, params: SamplingParams, key, guide,
                       limit: int, hidden: mx.array | None = None) -> Proposal:
        """Up to `limit` proposals after `anchor`, each legal under `guide` (grammar.Guide:
        words() / forced() / push()) given the ones before it, which the guide consumes
        (the caller rolls back what the round rejects). A position where the grammar
        allows one token takes it without a draw and without counting against `gamma`
        (and may lie past the draft's block); at most `gamma` others are drawn through
        the Markov chain from the draft's logits masked by the grammar, each read before
        the next position's mask exists (one host sync per drawn token). Ends after an
        end token, and early where the draft's vocabulary holds no allowed token.
        `hidden`: `forward(ctx, anchor)` when the caller ran it already."""
        if not params.greedy and key is None:
            raise ValueError("sampling with temperature > 0 needs a PRNG key (see key_chain)")
        first = 0 if self.args.sample_from_anchor else 1
        slots = min(limit, self.max_proposals)
        h = (self.forward(ctx, anchor) if hidden is None else hidden)[first:first + slots]
        u = self.lm_head(h).astype(mx.float32)
        m = self.markov
        pre, state = (m.prepare(h), m.initial_state()) if m is not None else (None, None)
        keys = None if params.greedy else mx.random.split(key, slots)
        prev = mx.array([int(anchor)], mx.int32)
        tokens, qs, embeddings, drafted, forced_at = [], [], [], 0, []
        for k in range(limit):
            forced = guide.forced()
            if forced is None and (drafted == gamma or k >= slots):
                break
            e = bias = None
            if m is not None and k < slots:
                e = m.w1(prev)
                bias, state = m.step(e, None if pre is None else pre[k:k + 1], state)
            if forced is not None:
                token, q = forced, mx.zeros((1, self.target_vocab), mx.float32)
                q[0, forced] = 1.0
            else:
                drawn = self._guided_draw(u[k:k + 1] if bias is None else u[k:k + 1] + bias, guide.words(),
                                          params, None if keys is None else keys[k])
                if drawn is None:
                    break
                token, q = drawn
                drafted += 1
            guide.push(token)
            prev = mx.array([token], mx.int32)
            forced_at.append(forced is not None)
            tokens.append(token)
            qs.append(q)
            embeddings.append(e)
            if guide.ended:  # an end token: nothing after it is emitted
                break
        q = mx.concatenate(qs) if tokens else mx.zeros((0, self.target_vocab), mx.float32)
        return Proposal(mx.array(tokens, mx.int32), q, self._guided_confidence(h, embeddings, forced_at))

    def _guided_draw(self, raw: mx.array, words, params: SamplingParams, key) -> tuple[int, mx.array] | None:
        """One drawn token of propose_guided from this slot's logits raw [1, V_draft] under the
        grammar's bitmask `words` (None: no constraint here, before it starts): (target id,
        its q row [1, V_target]), or None when the draft's reduced vocabulary holds no
        allowed token."""
        if words is not None:
            ok = allowed(words, self.target_vocab)
            if self.draft_to_target is not None:
                if not self._reaches(words):
                    return None
                ok = ok[self.draft_to_target]
            raw = mx.where(ok, raw, NEG_INF)
        row = filtered_logits(raw, params)
        token = int(self._draw(raw if params.greedy else row, params, key).item())
        return token, self._to_target(mx.softmax(row, axis=-1))

    def _guided_confidence(self, h: mx.array, embeddings: list, forced_at: list[bool]) -> mx.array | None:
        """The confidences of propose_guided's tokens: the head's over the ones on the block's
        slots h [slots, H] (with their W1[prev] rows `embeddings`), 1 past the block and
        wherever the grammar forced the token (a forced token always survives)."""
        n = len(forced_at)
        if self.confidence_head is None or not n:
            return None
        on_block = min(n, h.shape[0])
        e = mx.concatenate(embeddings[:on_block]) if self.markov is not None and embeddings[0] is not None else None
        c = mx.sigmoid(self.confidence_head.logits(h[:on_block], e))
        c = mx.concatenate([c, mx.ones((n - on_block,), c.dtype)]) if n > on_block else c
        return mx.where(mx.array(forced_at), 1.0, c)

    def _reaches(self, words) -> bool:
        """Whether the draft's reduced vocabulary holds a token the bitmask allows (host)."""
        if self._draft_ids is None:
            self._draft_ids = np.array(self.draft_to_target, dtype=np.int64)
        ids = self._draft_ids
        return bool(((np.asarray(words)[ids // 32] >> (ids % 32)) & 1).any())

    def _to_target(self, q: mx.array) -> mx.array:
        """Draft-vocabulary rows [..., V_draft] -> target-vocabulary rows [..., V_target]."""
        if self.draft_to_target is None:
            return q
        out = mx.zeros((*q.shape[:-1], self.target_vocab), mx.float32)
        out[..., self.draft_to_target] = q
        return out

    def _draw(self, logits: mx.array, params: SamplingParams, key) -> mx.array:
        """Draft ids from filtered logits [..., V_draft] -> target ids int32 [...]."""
        if params.greedy:
            ids = mx.argmax(logits, axis=-1)
        else:  # drawn over [k, V] rows: the draws a key gives do not depend on leading axes of 1
            rows = logits.reshape(-1, logits.shape[-1])
            ids = mx.random.categorical(rows, axis=-1, key=key).reshape(logits.shape[:-1])
        ids = ids.astype(mx.int32)
        return ids if self.draft_to_target is None else self.draft_to_target[ids]

    def _markov_chain(self, u, h, prev, params, key):
        """Serial sampling of B sequences at once: logits_k = U_k + B_k(prev), prev starting
        at the anchors [B]. Returns (tokens [B, k], filtered logits [B, k, V_draft],
        W1[prev_k] [B, k, r])."""
        m = self.markov
        b, slots = u.shape[:2]
        # every slot's rows [B, 1, ...]: one split of u (and of the prepared rows), no squeezes
        us = mx.split(u, slots, axis=1) if slots > 1 else [u]
        pre = m.prepare(h)
        pres = [None] * slots if pre is None else mx.split(pre, slots, axis=1) if slots > 1 else [pre]
        state = m.initial_state(b)
        state = None if state is None else state[:, None]
        keys = None if params.greedy else mx.random.split(key, slots)
        prev = prev[:, None]
        tokens, logits, embeddings = [], [], []
        for k in range(slots):
            e = m.w1(prev)
            bias, state = m.step(e, pres[k], state)
            raw = us[k] + bias
            row = filtered_logits(raw, params)
            # greedy: argmax of the raw row (the same id, without the one-hot mask in the chain)
            prev = self._draw(raw if params.greedy else row, params, None if keys is None else keys[k])
            tokens.append(prev)
            logits.append(row)
            embeddings.append(e)
        return tuple(mx.concatenate(parts, axis=1) for parts in (tokens, logits, embeddings))
