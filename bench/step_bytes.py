"""Bytes per decode step and per verify round on the real 35B-A3B shapes, for
bench/primitives.py: weights touched (experts: the expected number of distinct experts
for the rows), recurrent/conv state read + written, KV read, and the activation traffic
of each fused region, reference against kernel."""

from __future__ import annotations

from bench.real_size_model import PERIOD, TOTAL_LAYERS, model_objects
from monolith.models.layers import Experts, Linear


def distinct_experts(rows: int, experts: int, k: int) -> float:
    """Expected distinct experts among rows * k picks (uniform routing)."""
    return experts * (1 - (1 - k / experts) ** rows)


def weight_bytes(model, rows: int) -> float:
    """Weights one forward of `rows` rows reads (routed experts: the distinct ones)."""
    a = model.args
    frac = distinct_experts(rows, a.num_experts, a.num_experts_per_tok) / a.num_experts
    total = 0.0
    for obj in model_objects(model):
        if isinstance(obj, Experts):
            total += frac * sum(x.nbytes for x in (obj.weight, obj.scales, obj.tensor_scale) if x is not None)
        elif isinstance(obj, Linear) and obj is not model.embed_tokens.table:
            total += sum(x.nbytes for x in (obj.weight, obj.scales, obj.tensor_scale) if x is not None)
    return total


def state_bytes(a, rows: int, context: int) -> float:
    """GDN recurrent and conv state read + written, KV read (context + rows) and written."""
    gdn = sum(1 for k in a.layer_types if k == "linear_attention")
    attn = len(a.layer_types) - gdn
    recurrent = a.linear_num_value_heads * a.linear_value_head_dim * a.linear_key_head_dim * 4
    conv = (a.linear_conv_kernel_dim - 1) * conv_dim(a) * 4
    kv_row = 2 * a.num_key_value_heads * a.head_dim * 2
    return gdn * 2 * (recurrent + conv) + attn * kv_row * (context + 2 * rows)


def conv_dim(a) -> int:
    return 2 * a.linear_num_key_heads * a.linear_key_head_dim + a.linear_num_value_heads * a.linear_value_head_dim


def fused_region_bytes(a, rows: int, s: int, kept: int | None = None) -> dict[str, tuple[float, float]]:
    """(reference, kernel) activation bytes of each fused region for one forward of `rows`
    rows (per model, all layers), from the op sequences in monolith/kernels: every
    materializing primitive reads its inputs and writes its output once; views are free.
    With `kept`, the commit (replay) of a verify round instead."""
    f = 4
    t, h = rows, a.hidden_size
    gdn = sum(1 for k in a.layer_types if k == "linear_attention")
    attn = len(a.layer_types) - gdn
    c, hk, dk, hv, dv, kc = conv_dim(a), a.linear_num_key_heads, a.linear_key_head_dim, \
        a.linear_num_value_heads, a.linear_value_head_dim, a.linear_conv_kernel_dim
    vd, n, kv, d, e, k = hv * dv, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.num_experts, \
        a.num_experts_per_tok
    if kept is not None:
        r = kept
        state = hv * dv * dk * f
        tape = r * (2 * hk * dk + hv * dv + 2 * hv) * f  # q, k, v, gamma, beta of the kept rows
        ref = state + tape + state + r * vd * f  # gated_delta_update also writes its (unused) output
        ker = state + tape - r * hk * dk * f + (kc - 1) * c * f + state + (kc - 1) * c * f  # no q; conv copied
        return {"gdn_replay": (gdn * ref, gdn * ker)}
    words, scales = t * h // 2, t * h // 16
    layers = len(a.layer_types)
    norm_ref = (t * h * s + h * f + t * h * f) + (t * h * f + t * h * s)  # rms_norm (F32 out), astype
    regions = {
        # Gather words, scales, tensor scale; dequantize; * scale; astype
        "nvfp4_embedding": (2 * words + 2 * scales + 2 * t * f + (words + scales + t * h * f)
                            + (2 * t * h * f + t * f) + (t * h * f + t * h * s),
                            words + scales + t * f + t * h * s),
        # astype, concatenate, conv1d, silu, rms_norm q and k, gates
        "gdn_premix": (gdn * ((t * c * s + t * c * f) + ((kc - 1) * c * f + t * c * f + (kc - 1 + t) * c * f)
                              + ((kc - 1 + t) * c * f + c * kc * f + t * c * f) + 2 * t * c * f
                              + 2 * 2 * t * hk * dk * f + (2 * t * hv * s + 2 * hv * f + 2 * t * hv * f)),
                       gdn * (t * (c + 2 * hv) * s + (kc - 1) * c * f + c * kc * f + 2 * hv * f
                              + t * c * f + 2 * t * hv * f + (kc - 1 + t) * c * f)),
        # rms_norm (F32 out), fused tail (F32 out), astype
        "gated_rms_norm": (gdn * ((2 * t * vd * f + dv * f) + (t * vd * f + t * vd * s + t * vd * f)
                                  + (t * vd * f + t * vd * s)),
                           gdn * (t * vd * f + t * vd * s + dv * f + t * vd * s)),
        # argpartition, take_along_axis, softmax
        "moe_router": (layers * ((t * e * f + t * e * 4) + t * k * (4 + f) + t * k * f + 2 * t * k * f),
                       layers * (t * e * f + t * k * 8)),
        # q/k rms_norm (F32 out) + astype + rope; sigmoid(gate); v is a view
        "attention_prologue": (attn * sum(t * m * d * (s + f + f + s + s + s) + d * f for m in (n, kv))
                               + attn * 2 * t * n * d * s,
                               attn * (t * (2 * n + 2 * kv) * d * s + 2 * d * f + t * (n + 2 * kv) * d * s
                                       + t * n * d * s)),
        # weights * experts, sum over k, sigmoid * shared, routed + shared, residual add; the
        # next norm (F32 out) + astype
        "moe_combine": (layers * (2 * t * k * h * s + (t * k * h * s + t * h * s) + 2 * t * s + 3 * t * h * s
                                  + 3 * t * h * s + 3 * t * h * s + norm_ref),
                        layers * (t * k * h * s + t * k * f + 2 * t * h * s + t * s + t * h * s + h * f
                                  + t * h * s)),
        # residual add, post-attention norm (F32 out) + astype
        "add_rms_norm": (layers * (3 * t * h * s + norm_ref), layers * (2 * t * h * s + h * f + 2 * t * h * s)),
    }
    return regions



def weight_bytes_total(models, rows: int) -> float:
    """Weights read by one forward over 40 layers (4 layers + 9 periods, with lm_head; the
    embedding rows are in the gather's region)."""
    w4, w8 = weight_bytes(models[PERIOD], rows), weight_bytes(models[2 * PERIOD], rows)
    return w4 + (TOTAL_LAYERS // PERIOD - 1) * (w8 - w4)
