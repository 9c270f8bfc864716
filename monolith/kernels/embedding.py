"""NVFP4 embedding gather with the per-row tensor scale (docs/drafts.md 3: omitting the scale
collapses a draft's acceptance).

Pack layout (docs/formats.md 4, layers.Linear): words uint32 [V, H/8] (eight E2M1 codes, first
in the lowest nibble), E4M3 scales uint8 [V, H/16], tensor_scale [V] (F32, or the
compute dtype as layers.Linear keeps it on Metal). Out [T, H] in the compute dtype.
"""

from __future__ import annotations

import mlx.core as mx

from .kernel import Launch, MetalKernel, threads_for, use_metal

KERNEL = MetalKernel("monolith_nvfp4_embedding", "nvfp4_embedding.metal",
                     ("tokens", "words", "scales", "tensor_scale"), ("out",))


def reference(tokens: mx.array, words: mx.array, scales: mx.array, tensor_scale: mx.array, dtype) -> mx.array:
    rows = mx.dequantize(words[tokens], scales[tokens], group_size=16, bits=4, mode="nvfp4", dtype=mx.float32)
    return (rows * tensor_scale[tokens][:, None]).astype(dtype)


def launch(tokens: mx.array, words: mx.array, scales: mx.array, tensor_scale: mx.array, dtype) -> Launch:
    n, row_words = tokens.shape[0], words.shape[1]
    if tokens.ndim != 1 or scales.shape != (words.shape[0], row_words // 2) or row_words % 2:
        raise ValueError(f"nvfp4_embedding: tokens [T], words [V, H/8], scales [V, H/16] expected, got "
                         f"{tokens.shape}, {words.shape}, {scales.shape}")
    return Launch(inputs=(tokens.astype(mx.int32), words, scales, tensor_scale), grid=(row_words, n, 1),
                  threadgroup=(threads_for(row_words), 1, 1), output_shapes=((n, row_words * 8),),
                  output_dtypes=(dtype,), template=(("T", dtype), ("WORDS", row_words)))


def metal(tokens, words, scales, tensor_scale, dtype) -> mx.array:
    return KERNEL(launch(tokens, words, scales, tensor_scale, dtype))[0]


def nvfp4_embedding(tokens: mx.array, words: mx.array, scales: mx.array, tensor_scale: mx.array,
                    dtype=mx.bfloat16) -> mx.array:
    """Rows `tokens` [T] of an NVFP4 table, dequantized and scaled: [T, H] in `dtype`."""
    if use_metal():
        return metal(tokens, words, scales, tensor_scale, dtype)
    return reference(tokens, words, scales, tensor_scale, dtype)
