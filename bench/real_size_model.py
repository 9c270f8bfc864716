"""Qwen3.6-35B-A3B at its real size without its memory, for bench/primitives.py: the
model's own classes with weights that are zero-cost broadcast leaves in pack precision
(NVFP4 projections, experts, embedding and lm_head; BF16 routers), matrices in the
compute dtype as on Metal, and a cache that already holds `context` rows."""

from __future__ import annotations

import mlx.core as mx

from monolith.models.layers import Experts, Linear
from monolith.models.qwen3_5 import Qwen3_5Moe
from monolith.models.target_args import ModelArgs
from monolith.models.weights import model_arrays

# Qwen3.6-35B-A3B text_config (docs/target.md)
CONFIG = {
    "vocab_size": 248320, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25}, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "full_attention_interval": 4,
}
TOTAL_LAYERS = 40
PERIOD = 4
BF16_ENTRIES = ("mlp.gate", "shared_expert_gate")  # kept unquantized, as in ModelOpt NVFP4 exports



def leaf(shape, dtype) -> mx.array:
    """An evaluated array of `shape` that holds one element (a broadcast view): a graph leaf."""
    x = mx.broadcast_to(mx.zeros((), dtype), shape)
    mx.eval(x)
    return x


class ShapeWeights:
    """The weights interface of models/weights.PackWeights, at real shapes, in pack
    precision, as leaves that take no memory."""

    def __init__(self, dtype):
        self.dtype = dtype

    def dense_summary(self) -> str:
        return "pack-precision"  # a Mac keeps pack precision

    def _nvfp4(self, name, shape, cls):
        *lead, n, k = shape
        return cls(leaf((*lead, n, k // 8), mx.uint32), "nvfp4", scales=leaf((*lead, n, k // 16), mx.uint8),
                   tensor_scale=leaf((*lead, n), mx.float32), shape=shape, dtype=self.dtype)

    def linear(self, name, shape=None):
        if name.endswith(BF16_ENTRIES):
            return Linear(leaf(shape, mx.bfloat16), "bf16", shape=shape, dtype=self.dtype)
        return self._nvfp4(name, shape, Linear)

    def experts(self, name, shape=None):
        return self._nvfp4(name, shape, Experts)

    def has_linear(self, name):
        return True

    def tensor(self, name, shape=None, dtype=None):
        return leaf(shape, dtype or mx.float32)


def as_on_metal(model, dtype) -> None:
    """layers._PackMatrix upcasts quantized-matmul activations to F32 on the CPU only:
    take the Metal choice (the compute dtype) for every matrix of the model."""
    for obj in model_objects(model):
        if isinstance(obj, (Linear, Experts)) and obj.mode is not None:
            obj.kernel_dtype = dtype
            obj.tensor_scale = leaf(obj.tensor_scale.shape, dtype)


def model_objects(obj, seen=None):
    """Every monolith object a model holds (itself included), recursively."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, mx.array):
        return
    seen.add(id(obj))
    yield obj
    children = obj if isinstance(obj, (list, tuple)) else (
        vars(obj).values() if type(obj).__module__.startswith("monolith.") else ())
    for child in children:
        yield from model_objects(child, seen)


def build_model(layers: int, dtype):
    config = dict(CONFIG, num_hidden_layers=layers)
    args = ModelArgs.from_config(config, "qwen3_5_moe")
    model = Qwen3_5Moe(args, ShapeWeights(dtype))
    as_on_metal(model, dtype)
    mx.eval(model_arrays(model))
    return model


def make_cache(model, context: int):
    cache = model.make_cache(context + 8)
    mx.eval(cache.arrays())
    cache.offset = cache.state_offset = cache.written = context  # rows already there
    return cache
