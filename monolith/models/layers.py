"""Building blocks that read pack entries as stored: linears in every pack precision
(including fused groups split by precision), the embedding gather, stacked experts,
and the norms. Weights stay in pack precision; activations are the compute dtype.

Pack precisions and the MLX op that consumes them (docs/formats.md 4):
  nvfp4  uint32 words [N, K/8], E4M3 scales [N, K/16]  -> mode="nvfp4"
  fp8    uint32 words [N, K/4], E8M0 scales = 1.0       -> mode="mxfp8"
  bf16 / f16 / f32 matrix [N, K]                      -> plain matmul
Quantized entries carry an F32 per-row tensor scale that multiplies the output.
Experts use the gather forms (gather_qmm / gather_mm) of the same ops.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from typing import NamedTuple

import mlx.core as mx

from ..kernels import nvfp4_embedding, on_gpu

# pack precision -> (mode, group_size, bits) of MLX's quantized ops
QUANT_MODES = {"nvfp4": ("nvfp4", 16, 4), "fp8": ("mxfp8", 32, 8)}
# gather_qmm/gather_mm run faster on expert-sorted rows once there are this many
SORT_THRESHOLD = 64


pipeline_layers = True  # run_now hands each layer over (off inside whole_graphs)


@contextmanager
def whole_graphs():
    """Forwards built inside stay whole until something evaluates them (run_now waits):
    for counting a forward's MLX primitives from its outputs, and for comparing."""
    global pipeline_layers
    saved, pipeline_layers = pipeline_layers, False
    try:
        yield
    finally:
        pipeline_layers = saved


def run_now(*arrays) -> None:
    """On the CPU, start computing a layer's outputs while the host builds the next layer.
    MLX's CPU stream runs ops only once an eval submits them, so a forward evaluated at its
    end leaves the CPU idle while the host builds the graph, and the host idle while the
    CPU runs it; handing over each layer overlaps the two
    (bench/archive/results/layer_pipelining.md). On a GPU the graph is left whole for one eval."""
    if pipeline_layers and not on_gpu():
        mx.async_eval(*arrays)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Zero-centred RMSNorm with the stored (1 + w) in F32: computed in F32 (MLX
    promotes to the F32 weight), cast back to x's dtype."""
    return mx.fast.rms_norm(x, weight, eps).astype(x.dtype)


LOG2_E = math.log2(math.e)


def fast_exp() -> bool:
    """Does exp(x) run as 2 ** (x * log2(e)) here? On the CPU: the CPU wheels' exp (and the
    sigmoid and softmax built on it) is a scalar polynomial calling libm's fmaf, about 14
    ns a value, against about 6 for pow, which costs the speculative round's per-row
    activations and per-sequence attention most (bench/archive/results/cpu_ops.md). The results
    differ from exp by a few parts in 10^7. A GPU keeps exp, and so does BF16 compute."""
    return not on_gpu()


@mx.compile
def _swiglu_exp(gate_up: mx.array) -> mx.array:
    gate, up = mx.split(gate_up, 2, axis=-1)
    return gate * mx.sigmoid(gate) * up


@mx.compile
def _swiglu_pow(gate_up: mx.array) -> mx.array:
    gate, up = mx.split(gate_up, 2, axis=-1)
    return gate / (1 + mx.power(2.0, gate * -LOG2_E)) * up


def swiglu(gate_up: mx.array) -> mx.array:
    """silu(gate) * up from a fused [..., 2I] gate|up output (through pow with fast_exp()
    in F32: a BF16 x * log2(e) would lose the exponent's low bits)."""
    return _swiglu_pow(gate_up) if fast_exp() and gate_up.dtype == mx.float32 else _swiglu_exp(gate_up)


@functools.lru_cache(maxsize=64)
def _query_rows(group: int, t: int) -> mx.array:
    """[group * T, 1]: each grouped query row's index within its T queries (evaluated
    here, so the cached array holds data, not a graph, whichever thread uses it)."""
    rows = mx.tile(mx.arange(t), group)[:, None]
    mx.eval(rows)
    return rows


@mx.compile
def _exp_shifted(scores: mx.array, top: mx.array) -> mx.array:
    return mx.power(2.0, (scores - top) * LOG2_E)


class Quantized(NamedTuple):
    """Rows stored group-wise quantized (mx.quantize, affine): packed uint32 words [B,
    Hkv, L, D * bits / 32], scales and biases [B, Hkv, L, D / group_size]."""

    packed: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int

    @property
    def shape(self) -> tuple:
        """[B, Hkv, L] (the width is packed)."""
        return tuple(self.packed.shape[:3])

    def dequantize(self) -> mx.array:
        return mx.dequantize(self.packed, self.scales, self.biases, group_size=self.group_size, bits=self.bits)

    def matmul(self, x: mx.array, transpose: bool) -> mx.array:
        """x @ rows^T (transpose) or x @ rows, without dequantizing them."""
        return mx.quantized_matmul(x, self.packed, self.scales, self.biases, transpose=transpose,
                                   group_size=self.group_size, bits=self.bits)


def attention(q: mx.array, keys, values, scale: float, mask: str | None = None) -> mx.array:
    """mx.fast.scaled_dot_product_attention over q [B, H, T, D] and keys, values [B, Hkv,
    L, D] (grouped: query head h reads key head h // (H / Hkv)); mask None or "causal"
    (the T queries are the last T of the L positions). With fast_exp() and F32 inputs it
    runs as matmuls and a softmax through pow, which MLX's CPU fallback would run through
    exp; otherwise the fast op. `Quantized` keys and values (a quantized KV cache) run as
    quantized matmuls, never dequantized whole (on the CPU in F32, whose quantized
    kernels accumulate in the activation dtype: see _PackMatrix)."""
    quantized = isinstance(keys, Quantized)
    if not quantized and (not fast_exp() or q.dtype != mx.float32):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    if mask not in (None, "causal"):
        raise ValueError(f'mask must be None or "causal", got {mask!r}')
    b, heads, t, d = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    kernel = mx.float32 if quantized and mx.default_device() == mx.cpu else q.dtype
    grouped = (q * scale).astype(kernel).reshape(b, kv_heads, group * t, d)
    scores = keys.matmul(grouped, True) if quantized else grouped @ keys.swapaxes(-1, -2)
    if mask == "causal" and t > 1:  # key j (counted from the first query's own) <= query i
        scores = mx.where(mx.arange(t - length, t)[None] <= _query_rows(group, t), scores, -mx.inf)
    if fast_exp() and scores.dtype == mx.float32:
        e = _exp_shifted(scores, scores.max(axis=-1, keepdims=True))
        weights = e / e.sum(axis=-1, keepdims=True)
    else:
        weights = mx.softmax(scores, axis=-1, precise=True)
    out = values.matmul(weights, False) if quantized else weights @ values
    return out.astype(q.dtype).reshape(b, heads, t, d)


class _PackMatrix:
    """Arrays of one linear or experts entry, and the activation dtype its kernel takes.

    MLX 0.32's CPU kernels accumulate quantized matmuls in the activation dtype (a BF16
    NVFP4 GEMV at K=1024 is ~1% off) and run gather_mm only in F32, so on the CPU those
    kernels get F32 activations and the result is cast back; Metal takes the compute
    dtype as it is. The per-row tensor scale is applied in the kernel dtype (in BF16 its
    rounding, at most 2^-9, is one more rounding of the output)."""

    def __init__(self, weight, precision, scales=None, tensor_scale=None, shape=None, dtype=mx.float32,
                 gather=False):
        self.weight = weight
        self.precision = precision
        self.scales = scales
        self.mode = QUANT_MODES.get(precision)
        self.shape = tuple(shape) if shape is not None else tuple(weight.shape)  # logical ([E,] N, K)
        on_cpu = mx.default_device() == mx.cpu
        self.kernel_dtype = mx.float32 if on_cpu and (self.mode or gather) else dtype
        self.tensor_scale = None if tensor_scale is None else tensor_scale.astype(self.kernel_dtype)


class Linear(_PackMatrix):
    """One pack linear entry: y = x @ W^T, times the per-row tensor scale when quantized.
    The output has x's dtype."""

    def __init__(self, weight, precision, scales=None, tensor_scale=None, shape=None, dtype=mx.float32):
        super().__init__(weight, precision, scales, tensor_scale, shape, dtype)
        if self.mode is None:
            self.weight_t = weight.T  # a view; matmul reads it transposed

    @property
    def out_features(self) -> int:
        return self.shape[0]

    def __call__(self, x: mx.array) -> mx.array:
        if self.mode is None:
            return (x @ self.weight_t).astype(x.dtype)
        mode, group_size, bits = self.mode
        y = mx.quantized_matmul(x.astype(self.kernel_dtype), self.weight, self.scales, transpose=True,
                                group_size=group_size, bits=bits, mode=mode)
        return (y * self.tensor_scale).astype(x.dtype)


class FusedLinear:
    """A fused group whose members differ in precision, stored as NAME.0, NAME.1, ...:
    concatenating the parts' outputs in index order gives the whole fused output."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.shape = (sum(p.out_features for p in parts), parts[0].shape[1])

    @property
    def out_features(self) -> int:
        return self.shape[0]

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([p(x) for p in self.parts], axis=-1)


class Embedding:
    """Row gather from an embedding stored like a linear entry (BF16, or quantized rows
    dequantized after the gather and scaled by their row tensor scale: NVFP4 through
    monolith.kernels.nvfp4_embedding, other quantized modes with MLX ops)."""

    def __init__(self, table: Linear, dtype):
        self.table = table
        self.dtype = dtype

    def __call__(self, tokens: mx.array) -> mx.array:
        t = self.table
        if t.mode is None:
            return t.weight[tokens].astype(self.dtype)
        if t.precision == "nvfp4":  # the fused gather (monolith.kernels) takes 1-D ids
            rows = nvfp4_embedding(tokens.reshape(-1), t.weight, t.scales, t.tensor_scale, self.dtype)
            return rows if tokens.ndim == 1 else rows.reshape(*tokens.shape, -1)
        mode, group_size, bits = t.mode
        rows = mx.dequantize(t.weight[tokens], t.scales[tokens], group_size=group_size, bits=bits, mode=mode,
                             dtype=mx.float32)
        return (rows * t.tensor_scale[tokens][:, None]).astype(self.dtype)


class Experts(_PackMatrix):
    """A stacked experts entry [E, N, K] applied to per-row expert ids."""

    def __init__(self, weight, precision, scales=None, tensor_scale=None, shape=None, dtype=mx.float32):
        super().__init__(weight, precision, scales, tensor_scale, shape, dtype, gather=True)
        if self.mode is None and mx.default_device() == mx.cpu:
            # an F32 copy (see _PackMatrix) laid out [E, K, N]: the CPU gather_mm is ~5x
            # slower on the transposed view at 8 rows (0.35 vs 0.07 ms at 8 x 256 x 256)
            self.weight_t = mx.contiguous(weight.astype(self.kernel_dtype).swapaxes(-1, -2))
            self.weight = self.weight_t.swapaxes(-1, -2)
        elif self.mode is None:
            self.weight_t = weight.swapaxes(-1, -2)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """x [..., 1, K] broadcast against indices [...] -> [..., 1, N]."""
        xk = x.astype(self.kernel_dtype)
        if self.mode is None:
            y = mx.gather_mm(xk, self.weight_t, rhs_indices=indices, sorted_indices=sorted_indices)
            return y.astype(x.dtype)
        mode, group_size, bits = self.mode
        y = mx.gather_qmm(xk, self.weight, self.scales, rhs_indices=indices, transpose=True, group_size=group_size,
                          bits=bits, mode=mode, sorted_indices=sorted_indices)
        return (y * mx.expand_dims(self.tensor_scale[indices], -2)).astype(x.dtype)


class SwitchGLU:
    """Routed experts: down(silu(gate(x)) * up(x)) for each of the top-k experts of a row."""

    def __init__(self, gate_up: Experts, down: Experts):
        self.gate_up = gate_up
        self.down = down

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [T, H], indices [T, k] -> [T, k, H]."""
        t, k = indices.shape
        if t * k >= SORT_THRESHOLD:
            # group rows by expert so each expert's weights are read once
            flat = indices.flatten()
            order = mx.argsort(flat)
            inverse = mx.argsort(order)
            xs = mx.expand_dims(x[order // k], -2)  # [T*k, 1, H]
            ids = flat[order]
            y = self.down(swiglu(self.gate_up(xs, ids, True)), ids, True)
            return y.squeeze(-2)[inverse].reshape(t, k, -1)
        xs = mx.expand_dims(x, (-2, -3))  # [T, 1, 1, H]
        y = self.down(swiglu(self.gate_up(xs, indices)), indices)
        return y.squeeze(-2)
