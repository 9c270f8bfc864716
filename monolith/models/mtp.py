"""The target checkpoint's own multi-token-prediction head (docs/drafts.md 6),
read from a target pack built with `--with-mtp` (docs/formats.md 5).

One MTP step, over T rows, row t pairing the target's hidden state at position p + t
with the embedding of the token that follows it:

    e = rmsnorm(embed(token), mtp.pre_fc_norm_embedding)
    h = rmsnorm(hidden,       mtp.pre_fc_norm_hidden)
    x = mtp.fc([e, h])                                  # embedding first
    x = decoder layer mtp.layers.0 (full attention, the target's MLP or MoE), at
        positions p.., over its own KV cache
    hidden' = rmsnorm(x, mtp.norm);  logits = lm_head(hidden')   # the target's lm_head

Steps chain: the next step reads the last row's hidden' and the token picked from its
logits, one row each, at the next position. The layer, its attention, MLP / MoE and norms
are the target's own classes (qwen3_5.DecoderLayer); only the wiring is here.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..pack import PackError
from .cache import SPARE_ROWS, HybridCache, KVCache
from .layers import rms_norm, run_now
from .qwen3_5 import DecoderLayer, Qwen3_5, _spans


class MTPHead:
    """The MTP head of `target` (a whole Qwen3_5 / Qwen3_5Moe with its head) from the
    PackWeights of the same --with-mtp pack."""

    def __init__(self, target: Qwen3_5, weights):
        if not target.head:
            raise ValueError("the MTP head needs a target that holds the embedding and lm_head")
        mtp = (weights.manifest.get("layout") or {}).get("mtp")
        if not mtp:
            raise PackError(f"{weights.path}: the pack has no MTP head (build the target pack with "
                            "`python -m monolith.pack build --with-mtp`)")
        if mtp.get("num_layers") != 1:
            raise PackError(f"{weights.path}: the MTP head has {mtp.get('num_layers')} layers; one is supported")
        args, h = target.args, target.args.hidden_size
        self.args, self.dtype, self.target = args, target.dtype, target
        self.fc = weights.linear("mtp.fc", (h, 2 * h))
        self.pre_fc_norm_embedding = weights.tensor("mtp.pre_fc_norm_embedding", (h,), mx.float32)
        self.pre_fc_norm_hidden = weights.tensor("mtp.pre_fc_norm_hidden", (h,), mx.float32)
        prefix = "mtp.layers.0."
        self.layer = DecoderLayer(args, weights, prefix, "full_attention", target.make_mlp(weights, prefix + "mlp."))
        self.norm = weights.tensor("mtp.norm", (h,), mx.float32)

    def make_cache(self, max_context: int, spare_rows: int = SPARE_ROWS) -> HybridCache:
        """The head's own KV for max_context + spare_rows rows (one attention layer)."""
        if max_context < 1:
            raise ValueError(f"max_context must be positive, got {max_context}")
        a = self.args
        return HybridCache([KVCache(a.num_key_value_heads, a.head_dim, max_context + spare_rows, self.dtype)],
                           max_context, spare_rows)

    def __call__(self, hidden: mx.array, tokens, cache: HybridCache) -> tuple[mx.array, mx.array]:
        """One step over T rows at cache.offset: hidden [T, H] (the target's, or the
        previous step's), tokens [T] (each row's next token) -> (hidden' [T, H] in the
        compute dtype, logits F32 [T, vocab]); the cache advances by T."""
        return self.step(hidden, self.target.embed_tokens(self.target._tokens(tokens)), cache)

    def step(self, hidden: mx.array, embedded: mx.array, cache: HybridCache) -> tuple[mx.array, mx.array]:
        """`head(hidden, tokens, cache)` with the tokens' embeddings `embedded` [T, H] (the
        target's embed_tokens rows, as its EMBEDDING_TAP gives them) in place of the ids."""
        rows = embedded.shape[0]
        if hidden.ndim != 2 or hidden.shape != (rows, self.args.hidden_size) or embedded.shape != hidden.shape:
            raise ValueError(f"hidden must be [{rows}, {self.args.hidden_size}] (one row per token), "
                             f"got {list(hidden.shape)}")
        eps = self.args.rms_norm_eps
        e = rms_norm(embedded.astype(self.dtype), self.pre_fc_norm_embedding, eps)
        h = rms_norm(hidden.astype(self.dtype), self.pre_fc_norm_hidden, eps)
        x = self.fc(mx.concatenate([e, h], axis=-1))[None]
        spans = _spans([cache], [rows])
        _, out = self.layer(x, rms_norm(x, self.layer.input_layernorm, eps), [cache.layers[0]], spans, self.norm)
        run_now(out)
        cache.advance(rows)
        return out[0], self.target.lm_head(out[0]).astype(mx.float32)

    def chain(self, hidden: mx.array, tokens, cache: HybridCache, steps: int,
              pick: Callable[[int, mx.array], int] | None = None) -> list[tuple[mx.array, mx.array]]:
        """`steps` chained steps: the first over the given rows, each next one over one row
        (the last row's hidden' and the token `pick(step, its logits [vocab])` chose:
        greedy by default) -> per step (hidden', logits) as __call__ gives them."""
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        pick = pick or (lambda _, logits: int(mx.argmax(logits).item()))
        results = [self(hidden, tokens, cache)]
        for step in range(1, steps):
            out, logits = results[-1]
            results.append(self(out[-1:], [pick(step, logits[-1])], cache))
        return results
