"""mlx-lm's own Qwen3.5/3.6 models (mlx_lm.models.qwen3_5_moe and qwen3_5) at the
published widths, for bench/calibration.py: their MLX primitives per decode step and per
prefill chunk, counted as bench/primitives.py counts monolith's, and what their 4-bit
checkpoints read and compute.

- The model is mlx-lm's class, quantized as `mlx_lm.convert -q` does (affine, 4 bits,
  group 64; the MoE router and shared-expert gate at 8 bits, mlx-lm's quant_predicate),
  then every parameter is swapped for a zero-cost broadcast leaf of its shape and dtype
  (BF16 where the checkpoint is BF16): nothing of the 35B or 27B is materialized.
- A few layers at real width: 4 layers and 8 layers, one period of [GDN, GDN, GDN,
  attention] being the difference; the published depth = 4 layers + (depth / 4 - 1)
  periods, as bench/primitives.py scales ours.
- The graph one step builds, as mlx-lm's generate_step builds it (the forward, the last
  row's log-softmax and the greedy pick, the caches' new state), counted with
  bench.primitives.count: every node, with mx.fast ops as the one primitive each is on
  Metal (bench.primitives.metal_primitives) and mlx-lm's gated-delta Metal kernel as one
  node (on a CPU mlx-lm takes its ops fallback, a Python loop over the rows).
- A prefill chunk: mlx-lm's prefill_step_size rows (2048) with only the caches' state
  evaluated (the chunk's logits are never computed).
"""

from __future__ import annotations

from dataclasses import asdict

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from bench.primitives import count, metal_primitives, opaque
from bench.real_size_model import leaf
from monolith.synth.presets import PRESETS

PERIOD = 4
GROUP_SIZE, BITS = 64, 4
PREFILL_STEP = 2048  # mlx_lm.generate's prefill_step_size
MODELS = {"Qwen3.6-35B-A3B": "qwen3.6-35b-a3b", "Qwen3.6-27B": "qwen3.6-27b"}  # -> monolith.synth preset


def text_config(model: str, layers: int | None = None) -> dict:
    """The model's published text_config (monolith.synth's preset of its widths)."""
    p = asdict(PRESETS[MODELS[model]])
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "rms_norm_eps", "vocab_size", "full_attention_interval",
            "intermediate_size", "max_position_embeddings")
    tc = {k: p[k] for k in keys}
    tc.update(tie_word_embeddings=False, rope_parameters={
        "type": "default", "rope_theta": p["rope_theta"], "partial_rotary_factor": p["partial_rotary_factor"],
        "mrope_section": PRESETS[MODELS[model]].mrope_section})
    if model.endswith("A3B"):
        tc.update({k: p[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                     "shared_expert_intermediate_size")})
    if layers is not None:
        tc["num_hidden_layers"] = layers
    return tc


def build(model: str, layers: int):
    """mlx-lm's model of `layers` layers at the published widths, 4-bit, weights as leaves."""
    from mlx_lm.models import qwen3_5, qwen3_5_moe

    moe = model.endswith("A3B")
    module = qwen3_5_moe if moe else qwen3_5
    kind = "qwen3_5_moe" if moe else "qwen3_5"
    net = module.Model(module.ModelArgs.from_dict({"model_type": kind, "text_config": text_config(model, layers)}))
    special = net.quant_predicate

    def quantizable(path, m):
        if not hasattr(m, "to_quantized") or m.weight.shape[-1] % GROUP_SIZE:
            return False
        return special(path, m) if special else True

    nn.quantize(net, group_size=GROUP_SIZE, bits=BITS, class_predicate=quantizable)
    net.update(tree_map(lambda a: leaf(a.shape, a.dtype if a.dtype == mx.uint32 else mx.bfloat16),
                        net.parameters()))
    return net


def cache_at(net, context: int) -> list:
    """mlx-lm's cache for `net` holding `context` rows (leaves)."""
    cache = net.make_cache()
    for layer, c in zip(net.layers, cache):
        if layer.is_linear:
            g = layer.linear_attn
            c[0] = leaf((1, g.conv_kernel_size - 1, g.conv_dim), mx.bfloat16)
            c[1] = leaf((1, g.num_v_heads, g.head_v_dim, g.head_k_dim), mx.float32)
        else:
            a = layer.self_attn
            rows = (context // 256 + 2) * 256  # KVCache grows in steps of 256
            c.keys = leaf((1, a.num_key_value_heads, rows, a.head_dim), mx.bfloat16)
            c.values = leaf((1, a.num_key_value_heads, rows, a.head_dim), mx.bfloat16)
            c.offset = context
    return cache


def cache_arrays(cache) -> list:
    out = []
    for c in cache:
        out += [c.keys, c.values] if hasattr(c, "keys") else [a for a in c.cache if a is not None]
    return out


def gated_delta_kernel(q, k, v, g, beta, state, mask=None):
    """mlx-lm's gated-delta Metal kernel as the one node it is on Metal."""
    b, t, hv, dv = v.shape
    return tuple(opaque([q, k, v, g, beta, state, mask], [(b, t, hv, dv), state.shape], [q.dtype, state.dtype]))


def graph_count(net, rows: int, context: int, decode: bool) -> int:
    """Primitives of one decode step (rows = 1, with its sampling) or one prefill chunk."""
    from mlx_lm.models import gated_delta

    cache = cache_at(net, context)
    saved = gated_delta.gated_delta_ops  # what a CPU takes where Metal runs the kernel
    gated_delta.gated_delta_ops = gated_delta_kernel
    try:
        with metal_primitives():
            logits = net(mx.zeros((1, rows), mx.int32), cache=cache)
            outputs = []
            if decode:
                last = logits[:, -1, :]
                logprobs = last - mx.logsumexp(last, axis=-1, keepdims=True)
                outputs = [mx.argmax(logprobs, axis=-1), logprobs]
            return count(*outputs, *cache_arrays(cache))[0]
    finally:
        gated_delta.gated_delta_ops = saved


def at_depth(small: float, large: float, depth: int) -> float:
    """A quantity at `depth` layers from its values at PERIOD and 2 * PERIOD layers."""
    return small + (depth // PERIOD - 1) * (large - small)


def weight_bytes(net, top_k: int, experts: int) -> float:
    """Weights one decode step reads: routed experts top_k of `experts`, the embedding's
    one row, everything else whole."""
    total = 0.0
    for name, a in tree_flatten(net.parameters()):
        size = a.nbytes
        if ".switch_mlp." in name:
            size *= top_k / experts
        elif "embed_tokens" in name:
            size /= a.shape[0]
        total += size
    return total


def matmul_params(net, top_k: int, experts: int) -> float:
    """Multiply-adds per row of the decoder's matrices (routed experts: top_k of them;
    not the embedding gather, not lm_head, which a prefill chunk skips)."""
    total = 0.0
    for name, m in net.named_modules():
        if "embed_tokens" in name or name.endswith("lm_head") or not hasattr(m, "bits"):
            continue
        out_dim, words = m.weight.shape[-2], m.weight.shape[-1]
        per = out_dim * words * 32 // m.bits
        total += per * (top_k if ".switch_mlp." in name else 1)
    return total


def measure(model: str, contexts=(1024,)) -> dict:
    """Counts, bytes and FLOP terms of `model` at its published depth."""
    tc = text_config(model)
    depth = tc["num_hidden_layers"]
    top_k, experts = tc.get("num_experts_per_tok", 1), tc.get("num_experts", 1)
    nets = {n: build(model, n) for n in (PERIOD, 2 * PERIOD)}

    def deep(fn):
        return at_depth(fn(nets[PERIOD]), fn(nets[2 * PERIOD]), depth)

    gdn = sum((i + 1) % tc["full_attention_interval"] != 0 for i in range(depth))
    attn = depth - gdn
    conv_dim = 2 * tc["linear_num_key_heads"] * tc["linear_key_head_dim"] + \
        tc["linear_num_value_heads"] * tc["linear_value_head_dim"]
    recurrent = tc["linear_num_value_heads"] * tc["linear_value_head_dim"] * tc["linear_key_head_dim"]
    return {
        "model": model, "depth": depth, "gdn_layers": gdn, "attention_layers": attn,
        "decode_primitives": {str(c): round(deep(lambda n, c=c: graph_count(n, 1, c, True))) for c in contexts},
        "prefill_chunk_primitives": round(deep(lambda n: graph_count(n, PREFILL_STEP, 0, False))),
        "weight_bytes": deep(lambda n: weight_bytes(n, top_k, experts)),
        "matmul_params_per_row": deep(lambda n: matmul_params(n, top_k, experts)),
        # the F32 recurrent state and the BF16 conv state, each read and written once a step
        "state_bytes": gdn * 2 * (recurrent * 4 + (tc["linear_conv_kernel_dim"] - 1) * conv_dim * 2),
        "kv_bytes_per_row": attn * 2 * tc["num_key_value_heads"] * tc["head_dim"] * 2,  # K and V, BF16
        "attention_flops_per_pair": attn * 4 * tc["num_attention_heads"] * tc["head_dim"],  # QK^T and PV
        "gdn_flops_per_row": gdn * 8 * recurrent,  # decay, read, update, output of the state
    }
