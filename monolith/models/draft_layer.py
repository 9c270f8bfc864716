"""The draft's decoder layer (docs/drafts.md section 1): a Qwen3 layer with KV injection,
queries from the block only, keys/values from [context ; block], and the draft's RoPE
from its own config. The draft model (dspark.py) stacks them."""

from __future__ import annotations

import mlx.core as mx

from .cache import KVCache
from .draft_args import DraftArgs
from .layers import FusedLinear, Linear, attention, rms_norm
from .mixers import member
from .mlp import MLP
from .weights import PackWeights


def row_slice(linear: Linear | FusedLinear, start: int, stop: int) -> Linear | FusedLinear:
    """Rows [start, stop) of a (fused) linear entry as a linear of their own. MLX row
    slices share the parent's buffer, so this costs no weight memory."""
    if isinstance(linear, FusedLinear):
        parts, base = [], 0
        for p in linear.parts:
            a, b = max(start, base), min(stop, base + p.out_features)
            if a < b:
                parts.append(row_slice(p, a - base, b - base))
            base += p.out_features
        return parts[0] if len(parts) == 1 else FusedLinear(parts)
    scales = None if linear.scales is None else linear.scales[start:stop]
    tensor_scale = None if linear.tensor_scale is None else linear.tensor_scale[start:stop]
    return Linear(linear.weight[start:stop], linear.precision, scales, tensor_scale,
                  (stop - start, linear.shape[1]), linear.kernel_dtype)


class Rope:
    """Full-width rotate-half RoPE from the draft's config (plain or YaRN). YaRN's cos/sin
    factor multiplies both q and k, so it is folded into the attention scale."""

    def __init__(self, args: DraftArgs):
        self.dims = args.head_dim
        self.base = None if args.rope_inv_freq else args.rope_theta
        self.freqs = None if not args.rope_inv_freq else 1 / mx.array(args.rope_inv_freq, mx.float32)

    def __call__(self, x: mx.array, offsets: list[int]) -> mx.array:
        """x [S, heads, T, D]: sequence s at positions offsets[s].. (always an offset array:
        one sequence alone gets the same arithmetic as in a batch)."""
        return mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=1.0,
                            offset=mx.array(offsets, mx.int32), freqs=self.freqs)


class DraftLayer:
    """Qwen3 decoder layer with KV injection: queries from the block, keys/values from
    [context ; block] (the last `window` context rows of a sliding layer). A causal
    layer's slot k sees the block's slots <= k: MLX's "causal" mask aligns the queries
    with the last keys, which are the block's."""

    def __init__(self, args: DraftArgs, w: PackWeights, index: int, rope: Rope):
        p = f"layers.{index}."
        h, self.heads, self.kv_heads, self.head_dim = args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim
        self.q_rows, self.kv_rows = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv = w.linear(p + "self_attn.qkv", (self.q_rows + 2 * self.kv_rows, h))
        self.kv = row_slice(self.qkv, self.q_rows, self.q_rows + 2 * self.kv_rows)  # context rows need no q
        self.o_proj = w.linear(p + "self_attn.o_proj", (h, self.q_rows))
        self.q_norm = w.tensor(p + "self_attn.q_norm", (self.head_dim,), mx.float32)  # plain weights
        self.k_norm = w.tensor(p + "self_attn.k_norm", (self.head_dim,), mx.float32)
        self.input_layernorm = w.tensor(p + "input_layernorm", (h,), mx.float32)
        self.post_attention_layernorm = w.tensor(p + "post_attention_layernorm", (h,), mx.float32)
        self.mlp = MLP(w, p + "mlp.", h, args.intermediate_size)
        self.eps = args.rms_norm_eps
        self.scale = self.head_dim ** -0.5 * args.rope_attention_factor ** 2
        self.window = args.sliding_windows[index]
        self.block_mask = "causal" if args.block_causal[index] else None
        self.rope = rope

    def _keys_values(self, kv: mx.array, offsets: list[int]) -> tuple[mx.array, mx.array]:
        """[S, T, 2 * kv_rows] of S sequences at positions offsets[s].. -> k_norm'd, roped
        keys and values [S, kv_heads, T, head_dim]."""
        s, t = kv.shape[:2]
        k = kv[..., :self.kv_rows].reshape(s, t, self.kv_heads, self.head_dim)
        v = kv[..., self.kv_rows:].reshape(s, t, self.kv_heads, self.head_dim)
        k = self.rope(rms_norm(k, self.k_norm, self.eps).transpose(0, 2, 1, 3), offsets)
        return k, v.transpose(0, 2, 1, 3)

    def context_kv(self, kv: mx.array, offsets: list[int]) -> tuple[mx.array, mx.array]:
        """K/V of S sequences' context rows, n each, at positions offsets[s]..+n-1, from
        their projection kv = self.kv(C) [S, n, 2 * kv_rows]."""
        return self._keys_values(kv, offsets)

    def __call__(self, x: mx.array, caches: list[KVCache], offsets: list[int]) -> mx.array:
        """Packed blocks x [1, S * B, H]: block i (rows i*B..) at positions offsets[i].. over
        the context rows [0, offsets[i]) of caches[i]; its K/V go to the scratch rows
        [offset, offset + B). Projections, the q/k norms and RoPE and the MLP run over all
        blocks at once; the cache writes and the attention, per block."""
        s = len(caches)
        b = x.shape[1] // s
        qkv = self.qkv(rms_norm(x, self.input_layernorm, self.eps)).reshape(s, b, -1)
        q = qkv[..., :self.q_rows].reshape(s, b, self.heads, self.head_dim)
        q = self.rope(rms_norm(q, self.q_norm, self.eps).transpose(0, 2, 1, 3), offsets)
        k, v = self._keys_values(qkv[..., self.q_rows:], offsets)
        outs = []
        for i, (cache, offset) in enumerate(zip(caches, offsets)):
            one = member(i, s)
            keys, values = cache.update(one(k), one(v), offset)
            if self.window is not None and offset > self.window:
                keys, values = keys[:, :, offset - self.window:], values[:, :, offset - self.window:]
            o = attention(one(q), keys, values, self.scale, self.block_mask)
            outs.append(o.transpose(0, 2, 1, 3).reshape(1, b, self.q_rows))
        x = x + self.o_proj(outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1))
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm, self.eps))
