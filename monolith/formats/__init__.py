"""Numbers and bytes only (numpy, no MLX): NVFP4, FP8, compressed-tensors, MLX layout."""

from .codecs import (
    bf16_bits_to_f32,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    f32_to_bf16_bits,
    pack_nibbles,
    unpack_nibbles,
)
from .compressed import from_compressed_nvfp4, quantize_compressed_nvfp4, tensor_scale_from_global
from .fp8 import dequantize_fp8, encode_fp8, quantize_fp8
from .mlx_layout import fp8_to_words, mxfp8_unit_scales, nvfp4_to_words, words_to_bytes
from .nvfp4 import BLOCK, FormatError, NVFP4Weight, check_nvfp4_shapes, dequantize_nvfp4, quantize_nvfp4
from .stfile import SafetensorsFile, write_safetensors

__all__ = [
    "BLOCK",
    "FormatError",
    "NVFP4Weight",
    "SafetensorsFile",
    "bf16_bits_to_f32",
    "check_nvfp4_shapes",
    "dequantize_fp8",
    "encode_fp8",
    "dequantize_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_decode",
    "e4m3_encode",
    "f32_to_bf16_bits",
    "fp8_to_words",
    "from_compressed_nvfp4",
    "mxfp8_unit_scales",
    "nvfp4_to_words",
    "pack_nibbles",
    "quantize_compressed_nvfp4",
    "quantize_fp8",
    "quantize_nvfp4",
    "tensor_scale_from_global",
    "unpack_nibbles",
    "words_to_bytes",
    "write_safetensors",
]
