"""Test helper: a plain numpy (float64) DSpark / DFlash draft written from docs/drafts.md
sections 1-3, independent of monolith.models.dspark, as the reference the MLX draft must
match. It reads a checkpoint directory (a source checkpoint, or a pack unpacked back
to one: quantized matrices are dequantized, so an NVFP4 pack is compared on the
weights it actually holds) and parses the config itself (section 3 conventions).

RoPE frequencies come from transformers (the registry reference), fed only the fields
a qwen3 draft uses: inherited target-only fields (partial_rotary_factor, mrope) are
not passed on, as the loader rules say.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from monolith.checkpoint import open_checkpoint


def rms_norm(x, w, eps):
    """Plain-weight RMSNorm (draft norms are w, not 1 + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def rope_frequencies(layer_cfg: dict, head_dim: int) -> tuple[np.ndarray, float]:
    """(inv_freq [head_dim / 2], cos/sin scaling) from transformers' RoPE init functions."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**(layer_cfg.get("rope_scaling") or {}), **(layer_cfg.get("rope_parameters") or {})}
    rope.setdefault("rope_theta", layer_cfg.get("rope_theta"))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope["rope_type"] = rope_type
    rope.pop("type", None)
    cfg = Qwen3Config(hidden_size=layer_cfg["hidden_size"], num_attention_heads=layer_cfg["num_attention_heads"],
                      head_dim=head_dim, max_position_embeddings=layer_cfg.get("max_position_embeddings", 4096),
                      rope_parameters=rope)
    if rope_type == "default":
        inv = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        return inv, 1.0
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv.double().numpy(), float(scaling)


def apply_rope(x, positions, inv_freq, scaling):
    """x [T, heads, d] rotate-half RoPE at absolute positions [T] (full head width)."""
    angles = positions[:, None].astype(np.float64) * inv_freq[None]
    emb = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(emb)[:, None] * scaling, np.sin(emb)[:, None] * scaling
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class ReferenceDraft:
    def __init__(self, ckpt_dir, target_embed=None, target_lm_head=None):
        path = Path(ckpt_dir)
        cfg = json.loads((path / "config.json").read_text())
        ckpt = open_checkpoint(path)
        self.w = {m: ckpt.dequantize(m).astype(np.float64) for m in ckpt.modules()}
        for t in ckpt.tensor_names():
            if t.endswith((".bias", "norm.weight")):
                self.w[t.removesuffix(".weight")] = ckpt.read_float(t).astype(np.float64)
        self.d2t = ckpt.read("d2t").astype(np.int64) if ckpt.has("d2t") else None

        # section 3: where each format keeps its settings
        if cfg.get("speculators_model_type") == "dspark":
            layer_cfg = cfg["transformer_layer_config"]
            self.taps = [i - 1 for i in cfg["aux_hidden_state_layer_ids"]]  # aux ids = DeepSpec id + 1
            settings = cfg
        elif "dflash_config" in cfg:
            layer_cfg, settings = cfg, {**cfg, **cfg["dflash_config"]}
            self.taps = list(settings["target_layer_ids"])
        else:
            layer_cfg, settings = cfg, cfg
            self.taps = list(cfg["target_layer_ids"])
        self.block_size = settings["block_size"]
        self.mask = settings["mask_token_id"]
        self.sample_from_anchor = settings.get("sample_from_anchor", "dflash_config" not in cfg)
        self.embedding_scale = (cfg.get("dflash_config") or {}).get("input_embedding_scale", 1.0)
        self.rank = settings.get("markov_rank", 0) or 0
        self.head_type = settings.get("markov_head_type", "vanilla")
        self.confidence = bool(settings.get("enable_confidence_head"))
        self.confidence_with_markov = bool(settings.get("confidence_head_with_markov"))
        self.heads = layer_cfg["num_attention_heads"]
        self.kv_heads = layer_cfg["num_key_value_heads"]
        self.head_dim = layer_cfg["head_dim"]
        self.eps = layer_cfg.get("rms_norm_eps", 1e-6)
        self.layers = layer_cfg["num_hidden_layers"]
        # the block mask, docs/drafts.md section 3: a sliding layer sees the last sliding_window
        # context rows (Qwen3Config keeps the window only with use_sliding_window); its block
        # is causal in speculators unless sliding_window_non_causal; elsewhere is_causal /
        # dflash_config.causal decide, else the sliding layers are the causal ones
        types = layer_cfg.get("layer_types") or ["full_attention"] * self.layers
        window = layer_cfg.get("sliding_window") if layer_cfg.get("use_sliding_window") else None
        self.windows = [window if t == "sliding_attention" else None for t in types]
        if cfg.get("speculators_model_type"):
            self.causal = [w is not None and not cfg.get("sliding_window_non_causal", False) for w in self.windows]
        else:
            flag = cfg.get("is_causal", (cfg.get("dflash_config") or {}).get("causal"))
            self.causal = [t == "sliding_attention" if flag is None else flag for t in types]
        self.inv_freq, self.rope_scaling = rope_frequencies(layer_cfg, self.head_dim)
        self.embed = self.w.get("embed_tokens", target_embed)
        self.lm_head = self.w.get("lm_head", target_lm_head)

    # -- backbone (section 1)

    def context(self, features):
        """C = hidden_norm(fc(features))."""
        return rms_norm(features @ self.w["fc"].T, self.w["hidden_norm"], self.eps)

    def hidden(self, features, anchor):
        """Final-normed hidden states [B, H] of the block after len(features) context rows."""
        n, b = features.shape[0], self.block_size
        c = self.context(features.astype(np.float64))
        x = self.embed[[anchor] + [self.mask] * (b - 1)] * self.embedding_scale
        ctx_pos, blk_pos = np.arange(n), n + np.arange(b)
        group = self.heads // self.kv_heads
        for i in range(self.layers):
            p = f"layers.{i}."
            window = self.windows[i]
            first = max(0, n - window) if window is not None else 0  # the last `window` context rows
            visible = np.ones((b, n - first + b), bool)
            if self.causal[i]:  # slot q sees block slots <= q
                visible[:, n - first:] = np.tril(np.ones((b, b), bool))
            h = rms_norm(x, self.w[p + "input_layernorm"], self.eps)

            def proj(name, inp, heads, p=p):
                return (inp @ self.w[p + "self_attn." + name].T).reshape(inp.shape[0], heads, self.head_dim)

            q = apply_rope(rms_norm(proj("q_proj", h, self.heads), self.w[p + "self_attn.q_norm"], self.eps),
                           blk_pos, self.inv_freq, self.rope_scaling)
            k = np.concatenate([
                apply_rope(rms_norm(proj("k_proj", c, self.kv_heads), self.w[p + "self_attn.k_norm"], self.eps),
                           ctx_pos, self.inv_freq, self.rope_scaling)[first:],
                apply_rope(rms_norm(proj("k_proj", h, self.kv_heads), self.w[p + "self_attn.k_norm"], self.eps),
                           blk_pos, self.inv_freq, self.rope_scaling),
            ])
            v = np.concatenate([proj("v_proj", c, self.kv_heads)[first:], proj("v_proj", h, self.kv_heads)])
            out = np.zeros((b, self.heads, self.head_dim))
            for head in range(self.heads):
                kv = head // group
                scores = q[:, head] @ k[:, kv].T / np.sqrt(self.head_dim)
                scores = np.where(visible, scores, -np.inf)
                out[:, head] = softmax(scores) @ v[:, kv]
            x = x + out.reshape(b, -1) @ self.w[p + "self_attn.o_proj"].T
            h = rms_norm(x, self.w[p + "post_attention_layernorm"], self.eps)
            mlp = silu(h @ self.w[p + "mlp.gate_proj"].T) * (h @ self.w[p + "mlp.up_proj"].T)
            x = x + mlp @ self.w[p + "mlp.down_proj"].T
        return rms_norm(x, self.w["norm"], self.eps)

    # -- heads (section 2)

    def markov_bias(self, prev, h_k, state):
        """(B_k [V_draft], new rnn state) for previous target token `prev` and slot hidden h_k."""
        w2, e = self.w["markov_head.markov_w2"], self.w["markov_head.markov_w1"][prev]
        if self.head_type == "vanilla":
            return w2 @ e, state
        if self.head_type == "gated":
            gate_in = np.concatenate([h_k, e])
            g = sigmoid(self.w["markov_head.gate_proj"] @ gate_in + self.w["markov_head.gate_proj.bias"])
            return w2 @ (g * e), state
        z = np.concatenate([state, e, h_k])
        gate, cand, out = np.split(self.w["markov_head.joint_proj"] @ z + self.w["markov_head.joint_proj.bias"], 3)
        state = sigmoid(gate) * state + (1 - sigmoid(gate)) * np.tanh(cand)
        return w2 @ np.tanh(out), state

    def confidence_logit(self, prev, h_k):
        x = np.concatenate([h_k, self.w["markov_head.markov_w1"][prev]]) if self.confidence_with_markov else h_k
        return float(self.w["confidence_head.proj"][0] @ x + self.w["confidence_head.proj.bias"][0])

    def to_target(self, draft_id):
        return int(draft_id + self.d2t[draft_id]) if self.d2t is not None else int(draft_id)

    def propose(self, features, anchor, gamma, forced=None):
        """Greedy serial proposals (or the `forced` target-id tokens, teacher-forced).
        Returns U [gamma, V_draft], corrected logits [gamma, V_draft], tokens (target ids),
        confidences (or None)."""
        h = self.hidden(features, anchor)
        h = h[:gamma] if self.sample_from_anchor else h[1:gamma + 1]  # DFlash drops slot 0
        u = h @ self.lm_head.T
        prev, state = anchor, np.zeros(self.rank)
        logits, tokens, conf = [], [], []
        for k in range(gamma):
            row = u[k].copy()
            if self.rank:
                bias, state = self.markov_bias(prev, h[k], state)
                row += bias
            if self.confidence:
                conf.append(sigmoid(self.confidence_logit(prev, h[k])))
            token = self.to_target(int(np.argmax(row))) if forced is None else int(forced[k])
            logits.append(row)
            tokens.append(token)
            prev = token
        return u, np.array(logits), tokens, (np.array(conf) if self.confidence else None)
