"""Qwen3.5 / Qwen3.6 hybrid targets: gated DeltaNet + gated attention decoder layers,
with a dense SwiGLU MLP (`Qwen3_5`, the 27B) or a routed MoE block (`Qwen3_5Moe`,
the 35B-A3B). The math is docs/target.md; weights come from a pack (weights.py).

A forward takes segments: T_i >= 1 new rows of each of several independent sequences,
each continuing at its own cache's offset. The rows of all segments are packed [sum T_i, H]
through every linear (embedding, projections, MLP / MoE, lm_head: the weight-bound part);
only the mixers (attention over a sequence's own KV, the gated DeltaNet's own conv and
recurrent state) run per segment on its slice of the rows. One sequence is one segment.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..checkpoint.config import QWEN3_5_MOE
from ..kernels import (
    add_rms_norm,
    attention_prologue,
    gated_delta,
    gated_delta_rows,
    gated_rms_norm,
    gdn_premix,
    moe_combine,
    moe_route,
    on_gpu,
    use_metal,
)
from .cache import SPARE_ROWS, GDNState, GDNTape, HybridCache, KVCache
from .layers import (
    Embedding,
    Linear,
    SwitchGLU,
    attention,
    cast,
    rms_norm,
    run_now,
    swiglu,
)


class ConfigError(ValueError):
    """config.json lacks a field the model needs, or asks for something unsupported."""


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    eos_token_ids: tuple[int, ...]
    intermediate_size: int | None = None  # dense MLP
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @classmethod
    def from_config(cls, config: dict, architecture: str, generation_config: dict | None = None,
                    where: str = "config.json") -> ModelArgs:
        """Read `text_config` (or the config itself when it has none)."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

        def need(name):
            if name not in text:
                raise ConfigError(f"{where}: the text config has no field {name!r}")
            return text[name]

        layers = need("num_hidden_layers")
        layer_types = text.get("layer_types") or [
            "full_attention" if (i + 1) % text.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(layers)
        ]
        unknown = sorted(set(layer_types) - {"full_attention", "linear_attention"})
        if len(layer_types) != layers or unknown:
            raise ConfigError(f"{where}: layer_types must list {layers} of full_attention/linear_attention"
                              + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"{where}: rope_type {rope['rope_type']!r} is not supported (only default RoPE)")
        theta = rope.get("rope_theta", text.get("rope_theta"))
        if theta is None:
            raise ConfigError(f"{where}: no rope_theta in rope_parameters or the text config")
        moe = architecture == QWEN3_5_MOE
        return cls(
            architecture=architecture,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_hidden_layers=layers,
            layer_types=tuple(layer_types),
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=need("num_key_value_heads"),
            head_dim=need("head_dim"),
            linear_num_key_heads=need("linear_num_key_heads"),
            linear_num_value_heads=need("linear_num_value_heads"),
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            linear_conv_kernel_dim=need("linear_conv_kernel_dim"),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            max_position_embeddings=text.get("max_position_embeddings"),
            eos_token_ids=_eos_ids(generation_config, text, config),
            intermediate_size=None if moe else need("intermediate_size"),
            num_experts=need("num_experts") if moe else None,
            num_experts_per_tok=need("num_experts_per_tok") if moe else None,
            moe_intermediate_size=need("moe_intermediate_size") if moe else None,
            shared_expert_intermediate_size=need("shared_expert_intermediate_size") if moe else None,
        )


def _eos_ids(*configs) -> tuple[int, ...]:
    """eos_token_id of the first config that has one (generation_config first)."""
    for cfg in configs:
        eos = (cfg or {}).get("eos_token_id")
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()


# ------------------------------------------------------------------------ segments


@dataclass(frozen=True)
class Segment:
    """One sequence's part of a batched forward: `tokens` (int32 mx.array [T] or a list
    of ids) continuing at `cache.offset`, the decoder layers whose outputs to return
    (`taps`), and which rows' logits: "all", the "last" row only, or "none"."""

    tokens: mx.array | list[int]
    cache: HybridCache
    taps: tuple[int, ...] = ()
    logits: str = "all"


class Span(NamedTuple):
    """Rows [start, stop) of the packed rows belong to one segment, whose first row is at
    position `offset` of its sequence."""

    start: int
    stop: int
    offset: int

    def of(self, x: mx.array) -> mx.array:
        """The span's rows of packed x [1, N, ...] (x itself when they are all of them)."""
        return x if self.start == 0 and self.stop == x.shape[1] else x[:, self.start:self.stop]


# ------------------------------------------------------------------------ mixers


class GatedDeltaNet:
    def __init__(self, args: ModelArgs, w, prefix: str):
        h = args.hidden_size
        self.hk, self.hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.kernel = args.linear_conv_kernel_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.eps = args.rms_norm_eps
        self.in_proj = w.linear(prefix + "in_proj", (self.conv_dim + self.value_dim + 2 * self.hv, h))
        self.out_proj = w.linear(prefix + "out_proj", (h, self.value_dim))
        # [C, 1, K] -> MLX conv1d weight [C_out, K, C_in / groups] (a contiguous view: the middle axis is 1)
        self.conv_weight = w.tensor(prefix + "conv1d", (self.conv_dim, 1, self.kernel), mx.float32).reshape(
            self.conv_dim, self.kernel, 1)
        self.neg_decay = -mx.exp(w.tensor(prefix + "A_log", (self.hv,), mx.float32))
        self.dt_bias = w.tensor(prefix + "dt_bias", (self.hv,), mx.float32)
        self.norm = w.tensor(prefix + "norm", (self.dv,), mx.float32)

    def __call__(self, x: mx.array, states: list[GDNState], spans: list[Span]) -> mx.array:
        """Packed rows x [1, N, H]; segment i owns rows spans[i] and continues states[i].
        Without Metal, segments of the same row count run stacked as one batch of the
        pre-mixer and the recurrence (their states stacked, then split back): the CPU pays
        per primitive, not per byte. On Metal each runs alone: stacking would copy every
        recurrent state each step (63 MB a sequence for the 35B), where bytes are the cost."""
        proj = self.in_proj(x)  # conv channels | z | b | a
        outs: list = [None] * len(spans)
        groups = [[i] for i in range(len(spans))] if use_metal() else _same_length(spans)
        for group in groups:
            members = [spans[i] for i in group]
            t = members[0].stop - members[0].start
            conv = _stack([states[i].conv for i in group])
            recurrent = _stack([states[i].recurrent for i in group])
            pre = gdn_premix(_stack_rows(proj, members), conv, self.conv_weight, self.neg_decay, self.dt_bias,
                             self.hk, self.dk, self.hv, self.dv)
            # value head h reads key head h // (Hv / Hk) inside the op; state [G, Hv, Dv, Dk]
            every = None
            if any(states[i].record for i in group) and not (use_metal() or on_gpu()):  # the CPU commits by slicing
                o, recurrent, every = gated_delta_rows(pre.q, pre.k, pre.v, pre.gamma, pre.beta, recurrent)
            else:
                o, recurrent = gated_delta(pre.q, pre.k, pre.v, pre.gamma, pre.beta, recurrent)
            for j, i in enumerate(group):
                state, one = states[i], member(j, len(group))
                state.conv = one(pre.window)[:, t:]  # the last K-1 pre-conv rows
                if t > SPARE_ROWS:  # a prefill chunk: copy them, or a restore point keeps the whole window alive
                    state.conv = mx.array(state.conv)
                if state.record:
                    state.tape = GDNTape(*(one(a) for a in (pre.window, pre.q, pre.k, pre.v, pre.gamma, pre.beta)),
                                         states=None if every is None else one(every))
                state.recurrent = one(recurrent)
                outs[i] = one(o)
        if len(outs) == 1:
            o = outs[0]
        elif len(groups) == 1 and _in_order(spans):  # one stacked group: back to packed rows
            o = o.reshape(1, -1, *o.shape[2:])
        else:
            o = mx.concatenate(outs, axis=1)
        return self.out_proj(gated_rms_norm(o, proj, self.norm, self.eps, z_offset=self.conv_dim))


def _same_length(spans: list[Span]) -> list[list[int]]:
    """Indices of the segments, grouped by row count (in order of first appearance)."""
    groups: dict[int, list[int]] = {}
    for i, span in enumerate(spans):
        groups.setdefault(span.stop - span.start, []).append(i)
    return list(groups.values())


def _in_order(spans: list[Span]) -> bool:
    return all(a.stop == b.start for a, b in itertools.pairwise(spans))


def _stack(arrays: list[mx.array]) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays)


def _stack_rows(x: mx.array, spans: list[Span]) -> mx.array:
    """The rows of equal-length spans of packed x [1, N, ...] as a batch [G, T, ...]."""
    if len(spans) == 1:
        return spans[0].of(x)
    if _in_order(spans):
        return x[:, spans[0].start:spans[-1].stop].reshape(len(spans), spans[0].stop - spans[0].start,
                                                           *x.shape[2:])
    return mx.concatenate([s.of(x) for s in spans])


def member(j: int, size: int):
    """Batch entry j of a stacked result (the result itself for a batch of one)."""
    return (lambda a: a) if size == 1 else (lambda a: a[j:j + 1])


class Attention:
    def __init__(self, args: ModelArgs, w, prefix: str):
        h = args.hidden_size
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        q_rows, kv_rows = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv = w.linear(prefix + "qkv", (2 * q_rows + 2 * kv_rows, h))  # per head: query | gate
        self.o_proj = w.linear(prefix + "o_proj", (h, q_rows))
        self.q_norm = w.tensor(prefix + "q_norm", (self.head_dim,), mx.float32)
        self.k_norm = w.tensor(prefix + "k_norm", (self.head_dim,), mx.float32)
        self.eps = args.rms_norm_eps
        self.rotary_dim, self.rope_theta = args.rotary_dim, args.rope_theta
        self.scale = self.head_dim ** -0.5

    def __call__(self, x: mx.array, caches: list[KVCache], spans: list[Span]) -> mx.array:
        """Packed rows x [1, N, H]; segment i owns rows spans[i] at positions spans[i].offset..
        and attends over caches[i]. Without Metal, the prologue of same-length segments
        runs stacked (each at its own offset); the cache update and SDPA are per segment."""
        qkv = self.qkv(x)
        outs: list = [None] * len(spans)
        for group in [[i] for i in range(len(spans))] if use_metal() else _same_length(spans):
            members = [spans[i] for i in group]
            t = members[0].stop - members[0].start
            offset = members[0].offset if len(group) == 1 else mx.array([m.offset for m in members], mx.int32)
            q, k, v, gate = attention_prologue(_stack_rows(qkv, members), self.q_norm, self.k_norm, offset,
                                               self.heads, self.kv_heads, self.head_dim, self.rotary_dim,
                                               self.rope_theta, self.eps)
            for j, i in enumerate(group):
                one = member(j, len(group))
                keys, values = caches[i].update(one(k), one(v), spans[i].offset)
                o = attention(one(q), keys, values, self.scale, "causal" if t > 1 else None)
                outs[i] = o.transpose(0, 2, 1, 3).reshape(1, t, -1) * one(gate)
        return self.o_proj(outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1))


# ----------------------------------------------------------------------- MLPs


class MLP:
    """Dense SwiGLU with fused gate|up rows."""

    def __init__(self, w, prefix: str, hidden: int, intermediate: int):
        self.gate_up = w.linear(prefix + "gate_up", (2 * intermediate, hidden))
        self.down = w.linear(prefix + "down_proj", (hidden, intermediate))

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(swiglu(self.gate_up(x)))

    def add_norm(self, x: mx.array, residual: mx.array, norm: mx.array, eps: float) -> tuple[mx.array, mx.array]:
        """(h = residual + self(x), rmsnorm(h) with the next norm's weight)."""
        return add_rms_norm(residual, self(x), norm, eps)


class SparseMoeBlock:
    def __init__(self, args: ModelArgs, w, prefix: str):
        h, e, i = args.hidden_size, args.num_experts, args.moe_intermediate_size
        self.top_k = args.num_experts_per_tok
        self.router = _f32_linear(w.linear(prefix + "gate", (e, h)))
        self.experts = SwitchGLU(w.experts(prefix + "experts.gate_up", (e, 2 * i, h)),
                                 w.experts(prefix + "experts.down", (e, h, i)))
        self.shared_expert = MLP(w, prefix + "shared_expert.", h, args.shared_expert_intermediate_size)
        self.shared_expert_gate = w.linear(prefix + "shared_expert_gate", (1, h))

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(expert ids [T, k], F32 weights [T, k]) from F32 router logits: softmax ->
        top-k -> renormalize."""
        return moe_route(self.router(cast(x, mx.float32)), self.top_k)

    def add_norm(self, x: mx.array, residual: mx.array, norm: mx.array, eps: float) -> tuple[mx.array, mx.array]:
        """(h = residual + moe(x), rmsnorm(h) with the next norm's weight): routed experts,
        sigmoid-gated shared expert, residual add and norm in one combine."""
        x = x.reshape(-1, x.shape[-1])
        indices, weights = self.route(x)
        return moe_combine(self.experts(x, indices), weights, self.shared_expert(x), self.shared_expert_gate(x),
                           residual, norm, eps)


def _f32_linear(linear: Linear) -> Linear:
    """An unquantized linear with its weight in F32 (the router: small, and its logits are
    F32), converted once at load rather than promoted in every matmul."""
    if linear.mode is not None or linear.weight.dtype == mx.float32:
        return linear
    return Linear(linear.weight.astype(mx.float32), linear.precision, shape=linear.shape)


# ----------------------------------------------------------------------- model


class DecoderLayer:
    def __init__(self, args: ModelArgs, w, index: int, mlp):
        prefix = f"model.layers.{index}."
        self.kind = args.layer_types[index]
        if self.kind == "linear_attention":
            self.mixer = GatedDeltaNet(args, w, prefix + "linear_attn.")
        else:
            self.mixer = Attention(args, w, prefix + "self_attn.")
        self.mlp = mlp
        self.input_layernorm = w.tensor(prefix + "input_layernorm", (args.hidden_size,), mx.float32)
        self.post_attention_layernorm = w.tensor(prefix + "post_attention_layernorm", (args.hidden_size,), mx.float32)
        self.eps = args.rms_norm_eps

    def __call__(self, x: mx.array, normed: mx.array, states: list, spans: list[Span], next_norm: mx.array):
        """(x, its input_layernorm), packed rows [1, N, H] -> (the layer's output, normed by
        `next_norm`: the next layer's input_layernorm or the final norm): each residual add is
        fused with the norm after it. states[i]: this layer's cache of segment i."""
        h, post = add_rms_norm(x, self.mixer(normed, states, spans), self.post_attention_layernorm, self.eps)
        return self.mlp.add_norm(post, h, next_norm, self.eps)


def _spans(caches: list, rows: list[int]) -> list[Span]:
    """Where each cache's rows lie in a packed forward, every cache checked first
    (CacheError before any work)."""
    for cache, n in zip(caches, rows):
        cache.check(n)
    spans, start = [], 0
    for cache, n in zip(caches, rows):
        spans.append(Span(start, start + n, cache.offset))
        start += n
    return spans


def _rows(x: mx.array, start: int, stop: int) -> mx.array:
    """Rows [start, stop) of x (x itself when that is all of them)."""
    return x if start == 0 and stop == x.shape[0] else x[start:stop]


class Qwen3_5:
    """The dense target. `model(tokens, cache, taps)` runs T >= 1 rows at cache.offset
    and returns (logits F32 [T, vocab], the residual-stream outputs of the decoder
    layers listed in `taps` concatenated [T, len(taps) * hidden], or None)."""

    def __init__(self, args: ModelArgs, weights, layers: range | None = None, head: bool = True):
        """`layers` (default all) and `head` (the embedding, final norm and lm_head): a
        pipeline stage holds a run of layers and, on rank 0 only, the head
        (runtime/pipeline.py); only the tensors it holds are read from the pack."""
        self.args = args
        self.dtype = weights.dtype
        self.dense_summary = weights.dense_summary()  # which matrices are dense F32 copies (the CPU)
        h = args.hidden_size
        self.owned = range(args.num_hidden_layers) if layers is None else layers
        if not (0 <= self.owned.start < self.owned.stop <= args.num_hidden_layers and self.owned.step == 1):
            raise ValueError(f"layers {self.owned} are not a run of the model's {args.num_hidden_layers} layers")
        self.layers = [DecoderLayer(args, weights, i, self.make_mlp(weights, f"model.layers.{i}.mlp."))
                       for i in self.owned]
        self.head = head
        # the norm after the last layer held: fused with its residual add (a stage that
        # ends early computes the next stage's first norm, which that stage does again)
        last = self.owned.stop == args.num_hidden_layers
        exit_name = "model.norm" if last else f"model.layers.{self.owned.stop}.input_layernorm"
        self.exit_norm = weights.tensor(exit_name, (h,), mx.float32)
        if not head:
            return
        self.norm = self.exit_norm if last else weights.tensor("model.norm", (h,), mx.float32)
        self.embed_tokens = Embedding(weights.linear("model.embed_tokens", (args.vocab_size, h)), self.dtype)
        if weights.has_linear("lm_head"):
            self.lm_head = weights.linear("lm_head", (args.vocab_size, h))
        elif args.tie_word_embeddings:
            self.lm_head = self.embed_tokens.table
        else:
            raise ConfigError(f"{weights.path}: the pack has no lm_head and the config does not tie embeddings")

    def make_mlp(self, weights, prefix: str):
        return MLP(weights, prefix, self.args.hidden_size, self.args.intermediate_size)

    def make_cache(self, max_context: int, spare_rows: int = SPARE_ROWS) -> HybridCache:
        """KV for max_context + spare_rows rows per attention layer, zero GDN states."""
        if max_context < 1:
            raise ValueError(f"max_context must be positive, got {max_context}")
        a = self.args
        layers = []
        for kind in a.layer_types[self.owned.start:self.owned.stop]:
            if kind == "full_attention":
                layers.append(KVCache(a.num_key_value_heads, a.head_dim, max_context + spare_rows, self.dtype))
            else:
                key_dim = a.linear_num_key_heads * a.linear_key_head_dim
                conv_dim = 2 * key_dim + a.linear_num_value_heads * a.linear_value_head_dim
                layers.append(GDNState(conv_dim, a.linear_conv_kernel_dim, a.linear_num_value_heads,
                                       a.linear_value_head_dim, a.linear_key_head_dim))
        return HybridCache(layers, max_context, spare_rows)

    def __call__(self, tokens, cache: HybridCache, taps=None) -> tuple[mx.array, mx.array | None]:
        return self.forward(tokens, cache, taps)

    def forward(self, tokens, cache: HybridCache, taps=None, logits: str = "all"):
        """`model(...)` with a choice of logits: "all" rows, the "last" row only
        ([1, vocab]), or "none" (prefill chunks). Taps are in the compute dtype."""
        return self.forward_batch([Segment(tokens, cache, tuple(taps or ()), logits)])[0]

    def forward_batch(self, segments: list[Segment]) -> list[tuple[mx.array | None, mx.array | None]]:
        """One forward over the packed rows of several sequences. Per segment, what
        `forward` gives: (logits F32 [rows, vocab] or None, taps [T, len(taps) * hidden] or
        None). Every segment is checked against its cache before any work; a segment whose
        cache took `snapshot(record=True)` records its tapes, the others do not."""
        tokens, taps, spans = self.layout(segments)
        x = self.embed_tokens(tokens[0] if len(tokens) == 1 else mx.concatenate(tokens))[None]
        x, normed, tapped = self.run_layers(x, segments, spans, {i for t in taps for i in t})
        for s, span in zip(segments, spans):
            s.cache.advance(span.stop - span.start)
        return [(logits, self._hidden(tapped, t, span)) for logits, t, span in
                zip(self._logits(normed[0], segments, spans), taps, spans)]

    def forward_stage(self, x: mx.array, caches: list, rows: list[int], wanted=()) -> tuple[mx.array, dict]:
        """A pipeline stage's share of a forward (runtime/pipeline.py): the packed rows x
        [1, N, H] entering this model's first layer, `rows[i]` of them cache i's ->
        (its last layer's output [1, N, H], {tapped layer id: output rows [N, H]})."""
        spans = _spans(caches, rows)
        if spans[-1].stop != x.shape[1]:
            raise ValueError(f"{spans[-1].stop} rows for the caches, {x.shape[1]} rows given")
        x, _, tapped = self.run_layers(x, [Segment(None, c) for c in caches], spans, set(wanted))
        for cache, n in zip(caches, rows):
            cache.advance(n)
        return x, tapped

    def layout(self, segments: list[Segment]) -> tuple[list[mx.array], list[list[int]], list[Span]]:
        """Check a batch before any work: (token ids, taps, packed spans) per segment."""
        if not segments:
            raise ValueError("forward_batch needs at least one segment")
        if len({id(s.cache) for s in segments}) != len(segments):
            raise ValueError("two segments of one forward share a cache")
        tokens, taps = [], []
        for s in segments:
            if s.logits not in ("all", "last", "none"):
                raise ValueError(f'logits must be "all", "last" or "none", got {s.logits!r}')
            tokens.append(self._tokens(s.tokens))
            taps.append(self._taps(s.taps))
        return tokens, taps, _spans([s.cache for s in segments], [ids.shape[0] for ids in tokens])

    def run_layers(self, x: mx.array, segments: list, spans: list[Span], wanted: set[int]):
        """The layers this model holds over packed rows x [1, N, H]: (their output, it
        normed by `exit_norm`, {tapped layer id: its output rows [N, H]})."""
        eps = self.args.rms_norm_eps
        normed = rms_norm(x, self.layers[0].input_layernorm, eps)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.exit_norm]
        tapped, first = {}, self.owned.start
        for i, layer, next_norm in zip(self.owned, self.layers, next_norms):
            x, normed = layer(x, normed, [s.cache.layers[i - first] for s in segments], spans, next_norm)
            run_now(x, normed)
            if i in wanted:
                tapped[i] = x[0]
        return x, normed, tapped

    def _hidden(self, tapped: dict, taps: list[int], span: Span) -> mx.array | None:
        if not taps:
            return None
        return mx.concatenate([_rows(tapped[i], span.start, span.stop) for i in taps], axis=-1)

    def _logits(self, normed: mx.array, segments: list[Segment], spans: list[Span]) -> list[mx.array | None]:
        """The lm_head over only the packed rows whose logits are wanted, split per segment."""
        wanted = []  # per segment: its rows of `normed`, or None
        for s, span in zip(segments, spans):
            if s.logits == "all":
                wanted.append((span.start, span.stop))
            else:
                wanted.append((span.stop - 1, span.stop) if s.logits == "last" else None)
        picked = [_rows(normed, *rows) for rows in wanted if rows is not None]
        if not picked:
            return [None] * len(segments)
        out = cast(self.lm_head(picked[0] if len(picked) == 1 else mx.concatenate(picked)), mx.float32)
        results, at = [], 0
        for rows in wanted:
            n = 0 if rows is None else rows[1] - rows[0]
            results.append(None if rows is None else _rows(out, at, at + n))
            at += n
        return results

    def _tokens(self, tokens) -> mx.array:
        if not isinstance(tokens, mx.array):
            ids = np.asarray(tokens, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= self.args.vocab_size):
                raise ValueError(f"token ids must be in [0, {self.args.vocab_size})")
            tokens = mx.array(ids.astype(np.int32))
        if tokens.ndim != 1 or tokens.shape[0] < 1:
            raise ValueError(f"tokens must be a 1-D array of at least one id, got shape {tuple(tokens.shape)}")
        return tokens if tokens.dtype == mx.int32 else tokens.astype(mx.int32)

    def _taps(self, taps) -> list[int]:
        if not taps:
            return []
        n = self.args.num_hidden_layers
        bad = [i for i in taps if not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise ValueError(f"taps must be decoder layer ids in [0, {n}), got {bad}")
        return list(taps)


class Qwen3_5Moe(Qwen3_5):
    """The MoE target: the same layers with a routed MoE block as the MLP."""

    def make_mlp(self, weights, prefix: str):
        return SparseMoeBlock(self.args, weights, prefix)
