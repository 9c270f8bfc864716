"""A differentiable MLX mirror of monolith.models.dspark for training the demo draft
(draft.py), over a flat dict of F32 parameters with DeepSpec names: many blocks per
sequence in one forward (block_layout's additive mask), the slot and confidence losses,
and fake_nvfp4, the values the NVFP4 export decodes to (quantization-aware training).
"""

from __future__ import annotations

import mlx.core as mx
import model as M
import numpy as np

from monolith.formats.codecs import (
    E2M1_MAGNITUDES,
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
)
from monolith.formats.nvfp4 import BLOCK
from monolith.synth.draft_config import DraftSizes

EPS = 1e-6


def init_draft(h: int, vocab: int, s: DraftSizes, seed: int) -> dict:
    """The trainable params with DeepSpec names (the target's embedding and lm_head, which
    the runtime binds, stay frozen: target_files.frozen_target)."""
    rng = np.random.default_rng(seed + 2)
    P = {}

    def lin(name, out, inp, gain=1.0):
        P[name] = mx.array(rng.standard_normal((out, inp), dtype=np.float32) * np.float32(gain / np.sqrt(inp)))

    lin("fc.weight", h, len(s.target_layer_ids) * h)
    P["hidden_norm.weight"] = mx.ones((h,))
    qd, kvd = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    for i in range(s.num_layers):
        ly = f"layers.{i}"
        P[f"{ly}.input_layernorm.weight"] = mx.ones((h,))
        P[f"{ly}.post_attention_layernorm.weight"] = mx.ones((h,))
        lin(f"{ly}.self_attn.q_proj.weight", qd, h)
        lin(f"{ly}.self_attn.k_proj.weight", kvd, h)
        lin(f"{ly}.self_attn.v_proj.weight", kvd, h)
        lin(f"{ly}.self_attn.o_proj.weight", h, qd, 0.5)
        P[f"{ly}.self_attn.q_norm.weight"] = mx.ones((s.head_dim,))
        P[f"{ly}.self_attn.k_norm.weight"] = mx.ones((s.head_dim,))
        lin(f"{ly}.mlp.gate_proj.weight", s.intermediate_size, h)
        lin(f"{ly}.mlp.up_proj.weight", s.intermediate_size, h)
        lin(f"{ly}.mlp.down_proj.weight", h, s.intermediate_size, 0.5)
    P["norm.weight"] = mx.ones((h,))
    P["markov_head.markov_w1.weight"] = mx.array(rng.standard_normal((vocab, s.markov_rank), dtype=np.float32) * 0.1)
    P["markov_head.markov_w2.weight"] = mx.zeros((vocab, s.markov_rank))
    P["confidence_head.proj.weight"] = mx.zeros((1, h + s.markov_rank))
    P["confidence_head.proj.bias"] = mx.zeros((1,))
    return P


def block_layout(L: int, anchors: np.ndarray, bsz: int):
    """Positions [n*B] and additive mask [n*B, L + n*B] for blocks anchored at `anchors`."""
    n = anchors.size
    pos = (anchors[:, None] + np.arange(bsz)[None]).reshape(-1)
    ctx_ok = np.arange(L)[None, :] < np.repeat(anchors, bsz)[:, None]
    blk = np.repeat(np.arange(n), bsz)
    blk_ok = blk[:, None] == blk[None, :]
    mask = np.where(np.concatenate([ctx_ok, blk_ok], axis=1), 0.0, -1e9).astype(np.float32)
    return pos.astype(np.int32), mask


def draft_forward(P, frozen, feats, x_tokens, pos, mask, s: DraftSizes, rope_theta: float):
    """feats [B, L, n*H] (target taps), x_tokens [B, N] block inputs (anchor / mask ids),
    pos [N] block positions, mask [N, L + N] -> final-normed hidden [B, N, H]."""
    b_, L, _ = feats.shape
    n = x_tokens.shape[1]
    nh, kvh, d = s.num_heads, s.num_kv_heads, s.head_dim
    c = mx.fast.rms_norm(feats @ P["fc.weight"].T, P["hidden_norm.weight"], EPS)
    x = frozen["embed_tokens"][x_tokens]
    ctx_pos = mx.arange(L)

    def rope_at(t, positions):  # t [B, heads, T, d]; per-row positions
        inv = 1.0 / (rope_theta ** (mx.arange(0, d, 2).astype(mx.float32) / d))
        ang = positions.astype(mx.float32)[:, None] * inv[None]
        cos, sin = mx.cos(ang), mx.sin(ang)
        t1, t2 = t[..., :d // 2], t[..., d // 2:]
        return mx.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1)

    for i in range(s.num_layers):
        ly = f"layers.{i}.self_attn"
        hx = mx.fast.rms_norm(x, P[f"layers.{i}.input_layernorm.weight"], EPS)
        q = (hx @ P[f"{ly}.q_proj.weight"].T).reshape(b_, n, nh, d)
        kv_in = mx.concatenate([c, hx], axis=1)
        k = (kv_in @ P[f"{ly}.k_proj.weight"].T).reshape(b_, L + n, kvh, d)
        v = (kv_in @ P[f"{ly}.v_proj.weight"].T).reshape(b_, L + n, kvh, d).transpose(0, 2, 1, 3)
        q = rope_at(mx.fast.rms_norm(q, P[f"{ly}.q_norm.weight"], EPS).transpose(0, 2, 1, 3), pos)
        k = rope_at(mx.fast.rms_norm(k, P[f"{ly}.k_norm.weight"], EPS).transpose(0, 2, 1, 3),
                    mx.concatenate([ctx_pos, pos]))
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=d ** -0.5, mask=mask)
        x = x + o.transpose(0, 2, 1, 3).reshape(b_, n, nh * d) @ P[f"{ly}.o_proj.weight"].T
        m = f"layers.{i}.mlp"
        hx = mx.fast.rms_norm(x, P[f"layers.{i}.post_attention_layernorm.weight"], EPS)
        x = x + (M.silu(hx @ P[f"{m}.gate_proj.weight"].T) * (hx @ P[f"{m}.up_proj.weight"].T)) @ \
            P[f"{m}.down_proj.weight"].T
    return mx.fast.rms_norm(x, P["norm.weight"], EPS)


def draft_loss(P, frozen, feats, x_tokens, prev, labels, soft_ids, soft_p, pos, mask, weights, s, rope_theta,
               hard: float = 0.0):
    """Distillation CE against the target's top-TOPK distribution (draft.TOPK; soft_ids, soft_p) per slot,
    plus `hard` x CE against the target's argmax (labels: what greedy acceptance asks for);
    accuracy and the confidence head's target: argmax == labels."""
    h = draft_forward(P, frozen, feats, x_tokens, pos, mask, s, rope_theta)
    e = P["markov_head.markov_w1.weight"][prev]
    logits = h @ frozen["lm_head"].T + e @ P["markov_head.markov_w2.weight"].T
    logq = logits - mx.logsumexp(logits, -1, keepdims=True)
    ce = -(soft_p * mx.take_along_axis(logq, soft_ids, -1)).sum(-1)
    if hard:
        ce = ce - hard * mx.take_along_axis(logq, labels[..., None], -1)[..., 0]
    loss = (ce * weights).sum() / weights.sum()
    correct = mx.stop_gradient((mx.argmax(logits, -1) == labels).astype(mx.float32))
    conf_in = mx.stop_gradient(mx.concatenate([h, e], axis=-1))
    z = (conf_in @ P["confidence_head.proj.weight"].T)[..., 0] + P["confidence_head.proj.bias"]
    bce = mx.mean(mx.logaddexp(0.0, z) - correct * z)
    return loss + 0.1 * bce, (ce.mean(), correct.mean(), bce)


E2M1_GRID = mx.array(E2M1_MAGNITUDES)
E2M1_MIDPOINTS = [float(m) for m in (E2M1_MAGNITUDES[:-1] + E2M1_MAGNITUDES[1:]) / 2]  # exact in float32


def quantized(name: str) -> bool:
    """The trainable matrices the NVFP4 export quantizes and QAT trains through (Markov
    W1, norms and the confidence head stay BF16; embedding and lm_head are the target's)."""
    return name.endswith("_proj.weight") or name in ("fc.weight", "markov_head.markov_w2.weight")


def fake_nvfp4(w: mx.array) -> mx.array:
    """w [N, K] -> the values its ModelOpt NVFP4 export decodes to (monolith.formats.nvfp4:
    tensor scale amax / (6 * 448), E4M3 block scales per 16 columns, E2M1 codes rounded
    half to even), with a straight-through gradient: quantization-aware training."""
    n, k = w.shape
    tensor_scale = mx.max(mx.abs(w)) / (E2M1_MAX * E4M3_MAX)
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    amax = mx.max(mx.abs(blocks), axis=-1, keepdims=True)
    scale = mx.clip(mx.where(amax == 0, 1.0, amax / (E2M1_MAX * tensor_scale)), E4M3_MIN_SUBNORMAL, E4M3_MAX)
    divisor = mx.from_fp8(mx.to_fp8(scale), mx.float32) * tensor_scale
    x = mx.clip(mx.where(divisor == 0, 0.0, blocks / divisor), -E2M1_MAX, E2M1_MAX)  # an all-zero matrix stays zero
    mag = mx.abs(x)
    index = sum(((mag >= m) if i % 2 else (mag > m)).astype(mx.int32) for i, m in enumerate(E2M1_MIDPOINTS))
    q = (mx.where(x < 0, -1.0, 1.0) * E2M1_GRID[index] * divisor).reshape(n, k)
    return w + mx.stop_gradient(q - w)
