"""Qwen3.5 / Qwen3.6 hybrid targets: gated DeltaNet + gated attention decoder layers,
with a dense SwiGLU MLP (`Qwen3_5`, the 27B) or a routed MoE block (`Qwen3_5Moe`,
the 35B-A3B). The math is docs/target.md; weights come from a pack (weights.py), the
arguments from config.json (target_args.py); the mixers are mixers.py, the MLPs mlp.py.

A forward takes segments: T_i >= 1 new rows of each of several independent sequences,
each continuing at its own cache's offset (its rotary position: the offset plus the
cache's `position_delta`, or the multimodal positions a segment with images brings).
The rows of all segments are packed [sum T_i, H] through every linear (embedding,
projections, MLP / MoE, lm_head: the weight-bound part);
only the mixers (attention over a sequence's own KV, the gated DeltaNet's own conv and
recurrent state) run per segment on its slice of the rows. One sequence is one segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..kernels import add_rms_norm
from .cache import SPARE_ROWS, GDNState, HybridCache
from .kv_quant import kv_cache
from .layers import Embedding, rms_norm, run_now
from .mixers import Attention, GatedDeltaNet, Span
from .mlp import MLP, SparseMoeBlock
from .mrope import mrope_angles
from .target_args import ConfigError, ModelArgs

# Named taps, beside the decoder layer ids (each [T, hidden] in the compute dtype): what a
# drafter other than a layer-tapping one reads (runtime/mtp_drafter.py). Computed only
# when a segment asks for them.
EMBEDDING_TAP = "embedding"  # the row's token embedding: the first layer's input
FINAL_NORM_TAP = "final_norm"  # the last layer's output after the final norm: what lm_head scores
NAMED_TAPS = (EMBEDDING_TAP, FINAL_NORM_TAP)


@dataclass(frozen=True)
class Segment:
    """One sequence's part of a batched forward: `tokens` (int32 mx.array [T] or a list
    of ids) continuing at `cache.offset`, the decoder layers whose outputs to return
    (`taps`: layer ids or NAMED_TAPS), and which rows' logits: "all", the "last" row only, or "none".

    A segment with images (docs/target.md, "Images in the forward") brings `features`
    (rows: int indices into its T rows, values [len(rows), hidden]: the vision tower's
    merged features, which replace those rows' token embeddings) and/or `positions`
    ([3, T] ints: the temporal, height, width rotary positions of its rows, as
    models/mrope.py's rope_positions gives them for the whole prompt). After a segment with
    positions the cache's rows continue at index + (last position + 1 - rows so far)."""

    tokens: mx.array | list[int]
    cache: HybridCache
    taps: tuple[int, ...] = ()
    logits: str = "all"
    features: tuple | None = None
    positions: np.ndarray | None = None


class DecoderLayer:
    """One decoder layer of kind "linear_attention" or "full_attention", its pack entries
    under `prefix` (`model.layers.{i}.`, or the MTP head's `mtp.layers.{j}.`: models/mtp.py)."""

    def __init__(self, args: ModelArgs, w, prefix: str, kind: str, mlp):
        self.kind = kind
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
        spans.append(Span(start, start + n, cache.offset, cache.position_delta))
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
        self.kv_bits: int | None = None  # the attention layers' KV stored quantized to these bits (--kv-bits)
        self.pack_sha256: str | None = None  # the pack it was loaded from (loading.py): what saved states depend on
        self.dense_summary = weights.dense_summary()  # which matrices are dense F32 copies (the CPU)
        h = args.hidden_size
        self.owned = range(args.num_hidden_layers) if layers is None else layers
        if not (0 <= self.owned.start < self.owned.stop <= args.num_hidden_layers and self.owned.step == 1):
            raise ValueError(f"layers {self.owned} are not a run of the model's {args.num_hidden_layers} layers")
        self.layers = [DecoderLayer(args, weights, f"model.layers.{i}.", args.layer_types[i],
                                    self.make_mlp(weights, f"model.layers.{i}.mlp.")) for i in self.owned]
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
        """KV for max_context + spare_rows rows per attention layer (quantized to
        `kv_bits` when set), zero GDN states."""
        if max_context < 1:
            raise ValueError(f"max_context must be positive, got {max_context}")
        a = self.args
        layers = []
        for kind in a.layer_types[self.owned.start:self.owned.stop]:
            if kind == "full_attention":
                layers.append(kv_cache(a.num_key_value_heads, a.head_dim, max_context + spare_rows, self.dtype,
                                       self.kv_bits))
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
        x = self.embed_tokens(tokens[0] if len(tokens) == 1 else mx.concatenate(tokens))
        x = self._place_features(x, segments, spans)[None]
        wanted = {i for t in taps for i in t}
        embedded = x[0]
        read = any(s.logits != "none" for s in segments) or bool(wanted & {self.owned.stop - 1, FINAL_NORM_TAP})
        x, normed, tapped = self.run_layers(x, segments, spans, wanted, read)
        add_named_taps(tapped, wanted, embedded, normed)
        for s, span in zip(segments, spans):
            rows = span.stop - span.start
            delta = None if s.positions is None else int(s.positions.max()) + 1 - span.offset - rows
            s.cache.advance(rows, delta)
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
            self._check_images(s, tokens[-1].shape[0])
        spans = _spans([s.cache for s in segments], [ids.shape[0] for ids in tokens])
        return tokens, taps, [span if s.positions is None else span._replace(angles=mrope_angles(
            s.positions, self.args.rotary_dim, self.args.rope_theta, self.args.mrope_section))
            for s, span in zip(segments, spans)]

    def _check_images(self, s: Segment, rows: int) -> None:
        """A segment's features and positions fit its rows (ValueError before any work)."""
        if s.features is None and s.positions is None:
            return
        if len(self.owned) != self.args.num_hidden_layers or not self.head:
            raise ValueError("image features and multimodal positions need the whole model, not a pipeline stage")
        if s.positions is not None:
            positions = np.asarray(s.positions)
            if positions.shape != (3, rows) or positions.dtype.kind not in "iu":
                raise ValueError(f"positions must be ints [3, {rows}], got {positions.dtype} {positions.shape}")
            if self.args.mrope_section is None:
                raise ValueError("multimodal positions need mrope_interleaved true in rope_parameters")
        if s.features is not None:
            at, values = s.features
            at = np.asarray(at)
            if at.ndim != 1 or values.shape != (at.shape[0], self.args.hidden_size):
                raise ValueError(f"features must be (rows [n], values [n, {self.args.hidden_size}]), got "
                                 f"{at.shape} and {tuple(values.shape)}")
            if at.size and (at.min() < 0 or at.max() >= rows or np.unique(at).size != at.size):
                raise ValueError(f"feature rows must be distinct rows in [0, {rows})")

    def _place_features(self, x: mx.array, segments: list[Segment], spans: list[Span]) -> mx.array:
        """Packed token embeddings x [N, H] with the segments' image features in their rows."""
        placed = [(span.start + np.asarray(s.features[0], np.int64), s.features[1])
                  for s, span in zip(segments, spans) if s.features is not None and len(s.features[0])]
        if not placed:
            return x
        rows = mx.array(np.concatenate([at for at, _ in placed]).astype(np.int32))
        x[rows] = mx.concatenate([values.astype(x.dtype) for _, values in placed])
        return x

    def run_layers(self, x: mx.array, segments: list, spans: list[Span], wanted: set[int], read: bool = True):
        """The layers this model holds over packed rows x [1, N, H]: (their output, it
        normed by `exit_norm`, {tapped layer id: its output rows [N, H]}). `read` False: no
        one reads the last layer's output (a prefill chunk without logits or a tap of it),
        so it is left unevaluated and only its cache writes run when the cache is
        evaluated: the attention of those rows over the context, the output projection and
        the MLP never run (on the CPU, where run_now hands each layer over; a GPU
        evaluates the cache's graph alone anyway)."""
        eps = self.args.rms_norm_eps
        normed = rms_norm(x, self.layers[0].input_layernorm, eps)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.exit_norm]
        tapped, first = {}, self.owned.start
        for i, layer, next_norm in zip(self.owned, self.layers, next_norms):
            x, normed = layer(x, normed, [s.cache.layers[i - first] for s in segments], spans, next_norm)
            if read or i < self.owned.stop - 1:
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
        out = self.lm_head(picked[0] if len(picked) == 1 else mx.concatenate(picked)).astype(mx.float32)
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
        bad = [i for i in taps if i not in NAMED_TAPS and (not isinstance(i, int) or not 0 <= i < n)]
        if bad:
            raise ValueError(f"taps must be decoder layer ids in [0, {n}) or one of {NAMED_TAPS}, got {bad}")
        return list(taps)


def add_named_taps(tapped: dict, wanted: set, embedded: mx.array, normed: mx.array) -> None:
    """Put the NAMED_TAPS a forward was asked for into `tapped`: the token embeddings
    `embedded` [N, H] and the final-normed last layer outputs `normed` [1, N, H]."""
    if EMBEDDING_TAP in wanted:
        tapped[EMBEDDING_TAP] = embedded
    if FINAL_NORM_TAP in wanted:
        tapped[FINAL_NORM_TAP] = normed[0]


class Qwen3_5Moe(Qwen3_5):
    """The MoE target: the same layers with a routed MoE block as the MLP."""

    def make_mlp(self, weights, prefix: str):
        return SparseMoeBlock(self.args, weights, prefix)
