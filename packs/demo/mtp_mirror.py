"""A differentiable MLX mirror of monolith.models.mtp (the target's MTP head) for training
the demo head (mtp.py), over a flat dict of F32 parameters with the checkpoint's `mtp.*`
names (experts stacked per layer as in model.py, split at export). The decoder layer is
model.py's: its gated attention and MoE, over the target's Preset.

One step over rows t of a sequence (docs/drafts.md 6): e = rmsnorm(embed(x_{t+1})),
h = rmsnorm(hidden_t), x = mtp.fc([e, h]), the layer at position t, then mtp.norm and the
target's frozen lm_head: row t predicts x_{t+2}. The chained second step of row t reads
step 1's output at t as its hidden and x_{t+2} as its token, at position t + 1, over step
1's rows 0..t (what the runtime's head cache holds when it chains) and itself.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import model as M
import numpy as np

MTP = "mtp"
LAYER = "mtp.layers.0"
NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")  # zero-centred, as the target's


def init_mtp(p, seed: int) -> dict[str, mx.array]:
    """Fresh head parameters for the target Preset p: the layer as model.init_params makes
    a one-layer full-attention model's, fc [H, 2H], zero (scale 1) norms."""
    one = replace(p, num_hidden_layers=1, full_attention_interval=1)
    layer = M.init_params(one, seed + 5)
    pre = M.layer_prefix(0)
    P = {LAYER + k[len(pre):]: v for k, v in layer.items() if k.startswith(pre + ".")}
    h = p.hidden_size
    rng = np.random.default_rng(seed + 6)
    P[f"{MTP}.fc.weight"] = mx.array(rng.standard_normal((h, 2 * h), dtype=np.float32) / np.float32(np.sqrt(2 * h)))
    for norm in NORMS:
        P[f"{MTP}.{norm}.weight"] = mx.zeros((h,))
    return P


def fuse(P, frozen, hidden, tokens, p):
    """hidden [B, T, H] (the target's post-final-norm rows, or a step's output), tokens
    [B, T] (each row's next token) -> the layer's input [B, T, H]."""
    e = M.rms(frozen["embed_tokens"][tokens], P[f"{MTP}.pre_fc_norm_embedding.weight"], p.rms_norm_eps)
    h = M.rms(hidden, P[f"{MTP}.pre_fc_norm_hidden.weight"], p.rms_norm_eps)
    return mx.concatenate([e, h], axis=-1) @ P[f"{MTP}.fc.weight"].T


def layer(P, frozen, x, p, mask="causal", offsets=(0,), context=None):
    """The decoder layer, mtp.norm and the lm_head: (hidden' [B, T, H], logits, aux loss);
    `context`: earlier layer inputs its attention also reads (model.attention)."""
    norm = lambda rows: M.rms(rows, P[f"{LAYER}.input_layernorm.weight"], p.rms_norm_eps)  # noqa: E731
    x = x + M.attention(P, f"{LAYER}.self_attn", norm(x), p, mask, offsets, None if context is None else norm(context))
    m, aux = M.moe(P, f"{LAYER}.mlp", M.rms(x, P[f"{LAYER}.post_attention_layernorm.weight"], p.rms_norm_eps), p)
    out = M.rms(x + m, P[f"{MTP}.norm.weight"], p.rms_norm_eps)
    return out, out @ frozen["lm_head"].T, aux


def chain_mask(n: int) -> mx.array:
    """Additive [n, 2n] mask of the chained step over [step-1 rows, step-2 rows]: step-2
    row t sees step-1 rows <= t (the head's cache when it chains) and itself."""
    ok = np.concatenate([np.tril(np.ones((n, n), bool)), np.eye(n, dtype=bool)], axis=1)
    return mx.array(np.where(ok, 0.0, -1e9).astype(np.float32))


def mtp_forward(P, frozen, hidden, tokens, p, steps: int = 2):
    """hidden [B, n + steps - 1, H] and tokens [B, n + steps] of one sequence from row 0 ->
    per step k (1-based) the logits [B, n, V] of rows 0..n-1 (step k of row t predicts
    x_{t+k+1}) and the summed aux loss."""
    n = tokens.shape[1] - steps
    x1 = fuse(P, frozen, hidden[:, :n], tokens[:, 1:n + 1], p)
    out, logits, aux = layer(P, frozen, x1, p)
    results = [logits]
    if steps == 2:
        x2 = fuse(P, frozen, out, tokens[:, 2:n + 2], p)
        _, logits2, aux2 = layer(P, frozen, x2, p, chain_mask(n), (0, 1), context=x1)
        results.append(logits2)
        aux = aux + aux2
    elif steps != 1:
        raise ValueError(f"steps must be 1 or 2, got {steps}")
    return results, aux


def mtp_loss(P, frozen, hidden, tokens, soft_ids, soft_p, greedy, p, steps: int, weights, aux_coef: float):
    """Distillation: step k of row t against the served target's top-K distribution at row
    t + k (soft_ids, soft_p [B, L, K]); accuracy per step: argmax == the target's (greedy
    [B, L])."""
    results, aux = mtp_forward(P, frozen, hidden, tokens, p, steps)
    n = tokens.shape[1] - steps
    loss, ces, accs = aux_coef * aux, [], []
    for k, logits in enumerate(results, start=1):
        logq = logits - mx.logsumexp(logits, -1, keepdims=True)
        ce = -(soft_p[:, k:k + n] * mx.take_along_axis(logq, soft_ids[:, k:k + n], -1)).sum(-1).mean()
        loss = loss + weights[k - 1] * ce
        ces.append(ce)
        accs.append(mx.stop_gradient((mx.argmax(logits, -1) == greedy[:, k:k + n]).astype(mx.float32).mean()))
    return loss, (mx.stack(ces), mx.stack(accs))
