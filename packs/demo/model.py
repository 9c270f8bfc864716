"""A differentiable MLX mirror of monolith.models.qwen3_5 (Qwen3_5Moe) for training,
batched [B, T], over a flat dict of F32 parameters named as in the checkpoint
(`model.language_model.*`, `lm_head.weight`). Experts are stacked per layer
(`...mlp.experts.{gate,up,down}_proj` [E, out, in]) and split at export.

Math = /docs/target.md: zero-centred RMSNorms (1 + w), GDN with causal depthwise conv,
l2-normed q/k, gated delta rule (monolith.kernels.gated_delta: the fast op on Metal, a
chunked form in plain differentiable ops on the CPU), gated attention with partial
rotate-half RoPE, MoE with softmax -> top-k -> renormalize and a sigmoid-gated shared
expert. The MoE runs every expert densely and masks the router weights (E is small here).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from monolith.kernels import gated_delta

LM = "model.language_model"


def layer_prefix(i: int) -> str:
    return f"{LM}.layers.{i}"


def init_params(p, seed: int) -> dict[str, mx.array]:
    """Fresh parameters for Preset p (MoE). Output projections scaled by 1/sqrt(2L)."""
    rng = np.random.default_rng(seed)
    h, out_gain = p.hidden_size, (2 * p.num_hidden_layers) ** -0.5
    P: dict[str, np.ndarray] = {}

    def lin(name, out, inp, gain=1.0):
        P[name] = rng.standard_normal((out, inp), dtype=np.float32) * np.float32(gain / np.sqrt(inp))

    P[f"{LM}.embed_tokens.weight"] = rng.standard_normal((p.vocab_size, h), dtype=np.float32)
    for i, kind in enumerate(p.layer_types):
        pre = layer_prefix(i)
        P[f"{pre}.input_layernorm.weight"] = np.zeros(h, np.float32)
        P[f"{pre}.post_attention_layernorm.weight"] = np.zeros(h, np.float32)
        if kind == "linear_attention":
            la = f"{pre}.linear_attn"
            kd, vd = p.linear_num_key_heads * p.linear_key_head_dim, p.linear_num_value_heads * p.linear_value_head_dim
            hv, cd = p.linear_num_value_heads, 2 * kd + vd
            lin(f"{la}.in_proj_qkv.weight", cd, h)
            lin(f"{la}.in_proj_z.weight", vd, h)
            lin(f"{la}.in_proj_b.weight", hv, h)
            lin(f"{la}.in_proj_a.weight", hv, h)
            P[f"{la}.conv1d.weight"] = rng.standard_normal((cd, 1, p.linear_conv_kernel_dim), dtype=np.float32) * \
                np.float32(p.linear_conv_kernel_dim ** -0.5)
            P[f"{la}.dt_bias"] = np.zeros(hv, np.float32)
            P[f"{la}.A_log"] = np.log(rng.uniform(1.0, 16.0, size=hv)).astype(np.float32)
            P[f"{la}.norm.weight"] = np.ones(p.linear_value_head_dim, np.float32)
            lin(f"{la}.out_proj.weight", h, vd, out_gain)
        else:
            sa = f"{pre}.self_attn"
            qd, kvd = p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim
            lin(f"{sa}.q_proj.weight", 2 * qd, h)
            lin(f"{sa}.k_proj.weight", kvd, h)
            lin(f"{sa}.v_proj.weight", kvd, h)
            lin(f"{sa}.o_proj.weight", h, qd, out_gain)
            P[f"{sa}.q_norm.weight"] = np.zeros(p.head_dim, np.float32)
            P[f"{sa}.k_norm.weight"] = np.zeros(p.head_dim, np.float32)
        mlp, e, im, s = f"{pre}.mlp", p.num_experts, p.moe_intermediate_size, p.shared_expert_intermediate_size
        lin(f"{mlp}.gate.weight", e, h, 0.1)
        P[f"{mlp}.experts.gate_proj"] = rng.standard_normal((e, im, h), dtype=np.float32) / np.float32(np.sqrt(h))
        P[f"{mlp}.experts.up_proj"] = rng.standard_normal((e, im, h), dtype=np.float32) / np.float32(np.sqrt(h))
        P[f"{mlp}.experts.down_proj"] = rng.standard_normal((e, h, im), dtype=np.float32) * \
            np.float32(out_gain / np.sqrt(im))
        lin(f"{mlp}.shared_expert.gate_proj.weight", s, h)
        lin(f"{mlp}.shared_expert.up_proj.weight", s, h)
        lin(f"{mlp}.shared_expert.down_proj.weight", h, s, out_gain)
        lin(f"{mlp}.shared_expert_gate.weight", 1, h)
    P[f"{LM}.norm.weight"] = np.zeros(h, np.float32)
    lin("lm_head.weight", p.vocab_size, h)
    return {k: mx.array(v) for k, v in P.items()}


def rms(x, w, eps, zero_centred=True):
    return mx.fast.rms_norm(x, (1.0 + w) if zero_centred else w, eps)


def silu(x):
    return x * mx.sigmoid(x)


def gdn(P, pre, x, p):
    b_, t, _ = x.shape
    hk, hv, dk, dv, kk = (p.linear_num_key_heads, p.linear_num_value_heads, p.linear_key_head_dim,
                          p.linear_value_head_dim, p.linear_conv_kernel_dim)
    kd = hk * dk
    m = x @ P[f"{pre}.in_proj_qkv.weight"].T
    w = P[f"{pre}.conv1d.weight"][:, 0, :]  # [C, K]; w[:, K-1] multiplies the current row
    padded = mx.pad(m, [(0, 0), (kk - 1, 0), (0, 0)])
    c = sum(padded[:, j:j + t] * w[:, j] for j in range(kk))
    c = silu(c)
    q = c[..., :kd].reshape(b_, t, hk, dk)
    k = c[..., kd:2 * kd].reshape(b_, t, hk, dk)
    v = c[..., 2 * kd:].reshape(b_, t, hv, dv)
    q = q * mx.rsqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk ** -0.5
    k = k * mx.rsqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    z = (x @ P[f"{pre}.in_proj_z.weight"].T).reshape(b_, t, hv, dv)
    beta = mx.sigmoid(x @ P[f"{pre}.in_proj_b.weight"].T)
    a = x @ P[f"{pre}.in_proj_a.weight"].T
    g = -mx.exp(P[f"{pre}.A_log"]) * mx.logaddexp(a + P[f"{pre}.dt_bias"], 0.0)
    o, _ = gated_delta(q, k, v, mx.exp(g), beta)
    o = rms(o, P[f"{pre}.norm.weight"], p.rms_norm_eps, zero_centred=False) * silu(z)
    return o.reshape(b_, t, -1) @ P[f"{pre}.out_proj.weight"].T


def rope_parts(t, p, offsets):
    """Rotate t [B, heads, T, d]: its rows split into len(offsets) equal parts, part i at
    positions offsets[i], offsets[i] + 1, ..."""
    rope = lambda part, offset: mx.fast.rope(part, p.rotary_dim, traditional=False, base=p.rope_theta,  # noqa: E731
                                             scale=1.0, offset=offset)
    if len(offsets) == 1:
        return rope(t, offsets[0])
    return mx.concatenate([rope(part, o) for part, o in zip(mx.split(t, len(offsets), axis=2), offsets)], axis=2)


def attention(P, pre, x, p, mask="causal", offsets=(0,), context=None):
    """Gated attention of x [B, T, H] over itself, or over [context, x] when `context`
    [B, T, H] gives rows that only serve as keys and values; `mask` "causal" or additive
    [T, keys]; `offsets` the keys' positions (rope_parts), the queries' the last one."""
    b_, t, _ = x.shape
    n, kv, d = p.num_attention_heads, p.num_key_value_heads, p.head_dim
    qg = (x @ P[f"{pre}.q_proj.weight"].T).reshape(b_, t, n, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(b_, t, n * d)
    kx = x if context is None else mx.concatenate([context, x], axis=1)
    k = (kx @ P[f"{pre}.k_proj.weight"].T).reshape(b_, kx.shape[1], kv, d)
    v = (kx @ P[f"{pre}.v_proj.weight"].T).reshape(b_, kx.shape[1], kv, d)
    q = rms(q, P[f"{pre}.q_norm.weight"], p.rms_norm_eps).transpose(0, 2, 1, 3)
    k = rms(k, P[f"{pre}.k_norm.weight"], p.rms_norm_eps).transpose(0, 2, 1, 3)
    q, k = rope_parts(q, p, offsets[-1:]), rope_parts(k, p, offsets)
    o = mx.fast.scaled_dot_product_attention(q, k, v.transpose(0, 2, 1, 3), scale=d ** -0.5, mask=mask)
    return (o.transpose(0, 2, 1, 3).reshape(b_, t, n * d) * mx.sigmoid(gate)) @ P[f"{pre}.o_proj.weight"].T


def moe(P, pre, x, p):
    """Returns (output, load-balancing loss)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    probs = mx.softmax(x @ P[f"{pre}.gate.weight"].T, axis=-1)
    kth = mx.sort(mx.stop_gradient(probs), axis=-1)[:, -p.num_experts_per_tok][:, None]
    mask = probs >= kth
    wts = mx.where(mask, probs, 0.0)
    wts = wts / wts.sum(-1, keepdims=True)
    g = x[None] @ P[f"{pre}.experts.gate_proj"].transpose(0, 2, 1)  # [E, N, I]
    u = x[None] @ P[f"{pre}.experts.up_proj"].transpose(0, 2, 1)
    y = (silu(g) * u) @ P[f"{pre}.experts.down_proj"].transpose(0, 2, 1)  # [E, N, H]
    routed = (y * wts.T[..., None]).sum(0)
    se = f"{pre}.shared_expert"
    shared = (silu(x @ P[f"{se}.gate_proj.weight"].T) * (x @ P[f"{se}.up_proj.weight"].T)) @ P[f"{se}.down_proj.weight"].T
    shared = shared * mx.sigmoid(x @ P[f"{pre}.shared_expert_gate.weight"].T)
    aux = p.num_experts * (mx.stop_gradient(mask.astype(mx.float32)).mean(0) * probs.mean(0)).sum() / \
        p.num_experts_per_tok
    return (routed + shared).reshape(shape), aux


def forward(P, tokens, p, taps=()):
    """tokens [B, T] int32 -> (logits [B, T, V], {tap id: residual output [B, T, H]}, aux loss)."""
    x = P[f"{LM}.embed_tokens.weight"][tokens]
    tapped, aux = {}, 0.0
    for i, kind in enumerate(p.layer_types):
        pre = layer_prefix(i)
        h = rms(x, P[f"{pre}.input_layernorm.weight"], p.rms_norm_eps)
        if kind == "linear_attention":
            x = x + gdn(P, f"{pre}.linear_attn", h, p)
        else:
            x = x + attention(P, f"{pre}.self_attn", h, p)
        h = rms(x, P[f"{pre}.post_attention_layernorm.weight"], p.rms_norm_eps)
        m, a = moe(P, f"{pre}.mlp", h, p)
        x, aux = x + m, aux + a
        if i in taps:
            tapped[i] = x
    logits = rms(x, P[f"{LM}.norm.weight"], p.rms_norm_eps) @ P["lm_head.weight"].T
    return logits, tapped, aux / p.num_hidden_layers


def export_values(P) -> dict[str, np.ndarray]:
    """Checkpoint-named float32 arrays (experts split per expert)."""
    out = {}
    for name, v in P.items():
        arr = np.array(v.astype(mx.float32))
        if ".mlp.experts." in name:
            base, leaf = name.rsplit(".", 1)
            for e in range(arr.shape[0]):
                out[f"{base}.{e}.{leaf}.weight"] = arr[e]
        else:
            out[name] = arr
    return out
