"""The draft's heads (docs/drafts.md section 2): the Markov head, a low-rank bias on
each slot's logits from the token drawn before it, and the confidence head, each
proposal's chance to survive. Both run in float32; the draft model (dspark.py) drives
them slot after slot."""

from __future__ import annotations

import mlx.core as mx

from .layers import Embedding, FusedLinear, Linear
from .weights import PackWeights


def dense(linear: Linear | FusedLinear) -> mx.array:
    """The float32 [N, K] matrix of a (small) linear entry, dequantized if needed."""
    if isinstance(linear, FusedLinear):
        return mx.concatenate([dense(p) for p in linear.parts])
    if linear.mode is None:
        return linear.weight.astype(mx.float32)
    mode, group_size, bits = linear.mode
    w = mx.dequantize(linear.weight, linear.scales, group_size=group_size, bits=bits, mode=mode, dtype=mx.float32)
    return w * linear.tensor_scale.astype(mx.float32)[:, None]


class MarkovHead:
    """Low-rank bias B_k on slot k's logits from the previous token (docs/drafts.md 2): vanilla
    W2 @ W1[prev]; gated W2 @ (sigmoid(gate_proj([h ; e])) * e); rnn over the block with
    joint_proj([s ; e ; h]) -> gate, candidate, output. Runs in float32. The parts of
    gate_proj / joint_proj that read h are applied to all slots at once (`prepare`)."""

    def __init__(self, w: PackWeights, head_type: str, rank: int, hidden: int, target_vocab: int, draft_vocab: int):
        self.head_type, self.rank = head_type, rank
        self.w1 = Embedding(w.linear("markov_head.markov_w1", (target_vocab, rank)), mx.float32)
        self.w2 = w.linear("markov_head.markov_w2", (draft_vocab, rank))
        r, h = rank, hidden
        if head_type == "gated":
            g = dense(w.linear("markov_head.gate_proj", (r, h + r)))  # input [h ; e]
            self.from_h, self.from_e = g[:, :h].T, g[:, h:].T
            self.bias = _bias(w, "markov_head.gate_proj.bias", r)
        elif head_type == "rnn":
            j = dense(w.linear("markov_head.joint_proj", (3 * r, 2 * r + h)))  # input [s ; e ; h]
            self.from_s, self.from_e, self.from_h = j[:, :r].T, j[:, r:2 * r].T, j[:, 2 * r:].T
            self.bias = _bias(w, "markov_head.joint_proj.bias", 3 * r)

    def prepare(self, h: mx.array) -> mx.array | None:
        """The per-slot part that depends on the block's hidden states h [k, H] only."""
        if self.head_type == "vanilla":
            return None
        return h.astype(mx.float32) @ self.from_h + self.bias

    def initial_state(self, rows: int = 1) -> mx.array | None:
        return mx.zeros((rows, self.rank), mx.float32) if self.head_type == "rnn" else None

    def step(self, e: mx.array, pre: mx.array | None, state: mx.array | None):
        """Slot biases [..., V_draft] from e = W1[prev] [..., r] and this slot's `prepare`
        rows [..., r] (one per sequence)."""
        if self.head_type == "vanilla":
            return self.w2(e), state
        if self.head_type == "gated":
            return self.w2(mx.sigmoid(pre + e @ self.from_e) * e), state
        gate, cand, out = mx.split(pre + state @ self.from_s + e @ self.from_e, 3, axis=-1)
        gate = mx.sigmoid(gate)
        state = gate * state + (1 - gate) * mx.tanh(cand)
        return self.w2(mx.tanh(out)), state

    def block_bias(self, prev_ids: mx.array, h: mx.array) -> mx.array:
        """Teacher-forced biases [k, V_draft] for given previous tokens (target ids) [k]."""
        pre, state, rows = self.prepare(h), self.initial_state(), []
        e = self.w1(prev_ids)
        for k in range(prev_ids.shape[0]):
            bias, state = self.step(e[k:k + 1], None if pre is None else pre[k:k + 1], state)
            rows.append(bias)
        return mx.concatenate(rows)


class ConfidenceHead:
    """logit_k = w . [h_k ; W1[prev_k]] + b (or w . h_k + b without the Markov input)."""

    def __init__(self, w: PackWeights, hidden: int, rank: int):
        proj = dense(w.linear("confidence_head.proj", (1, hidden + rank)))[0]
        self.from_h, self.from_e = proj[:hidden], proj[hidden:] if rank else None
        self.bias = _bias(w, "confidence_head.proj.bias", 1)

    def logits(self, h: mx.array, e: mx.array | None) -> mx.array:
        out = h.astype(mx.float32) @ self.from_h + self.bias
        return out if self.from_e is None else out + e @ self.from_e


def _bias(w: PackWeights, name: str, size: int) -> mx.array:
    return w.tensor(name, (size,), mx.float32) if name in w.entries else mx.zeros((size,), mx.float32)
