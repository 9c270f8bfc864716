"""The target's two mixers (docs/target.md): the gated DeltaNet (linear attention with
a conv and recurrent state) and gated attention, each over packed rows: the rows of
several segments through one projection, then per segment (or per group of segments of
equal length, stacked) over its own state. `Span` says which rows are whose."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import mlx.core as mx

from ..kernels import (
    attention_prologue,
    attention_prologue_at,
    gated_delta,
    gated_delta_rows,
    gated_rms_norm,
    gdn_premix,
    on_gpu,
    use_metal,
)
from .cache import SPARE_ROWS, GDNState, GDNTape, KVCache
from .layers import attention
from .target_args import ModelArgs


class Span(NamedTuple):
    """Rows [start, stop) of the packed rows belong to one segment, whose first row is at
    index `offset` of its sequence (its KV row) and rotary position offset + `shift` (the
    cache's position delta after an image), or turns by `angles` [T, rotary_dim / 2] when
    the segment brings multimodal positions (models/mrope.py)."""

    start: int
    stop: int
    offset: int
    shift: int = 0
    angles: mx.array | None = None

    def of(self, x: mx.array) -> mx.array:
        """The span's rows of packed x [1, N, ...] (x itself when they are all of them)."""
        return x if self.start == 0 and self.stop == x.shape[1] else x[:, self.start:self.stop]


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


def _rotary_groups(spans: list[Span]) -> list[list[int]]:
    """The attention prologue's batches: each segment alone on Metal or when it brings its
    own rotary angles, otherwise the segments of equal row count together."""
    if use_metal():
        return [[i] for i in range(len(spans))]
    alone = [[i] for i, span in enumerate(spans) if span.angles is not None]
    if not alone:
        return _same_length(spans)
    rest = [i for i, span in enumerate(spans) if span.angles is None]
    return alone + [[rest[j] for j in g] for g in _same_length([spans[i] for i in rest])]


def _positions(members: list[Span]):
    """The rotary position of row 0: an int for one segment, int32 [G] for a stacked group."""
    if len(members) == 1:
        return members[0].offset + members[0].shift
    return mx.array([m.offset + m.shift for m in members], mx.int32)


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
        for group in _rotary_groups(spans):
            members = [spans[i] for i in group]
            t = members[0].stop - members[0].start
            if members[0].angles is not None:  # multimodal positions: the MLX reference rotary
                q, k, v, gate = attention_prologue_at(members[0].of(qkv), self.q_norm, self.k_norm,
                                                      members[0].angles, self.heads, self.kv_heads,
                                                      self.head_dim, self.eps)
            else:
                q, k, v, gate = attention_prologue(_stack_rows(qkv, members), self.q_norm, self.k_norm,
                                                   _positions(members), self.heads, self.kv_heads, self.head_dim,
                                                   self.rotary_dim, self.rope_theta, self.eps)
            for j, i in enumerate(group):
                one = member(j, len(group))
                keys, values = caches[i].update(one(k), one(v), spans[i].offset)
                o = attention(one(q), keys, values, self.scale, "causal" if t > 1 else None)
                outs[i] = o.transpose(0, 2, 1, 3).reshape(1, t, -1) * one(gate)
        return self.o_proj(outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1))


# ----------------------------------------------------------------------- MLPs
