"""E2M1 (FP4) and E4M3 (FP8) codecs in numpy, exact to the bit.

Decoding is a table lookup. Encoding rounds to nearest, ties to the even code,
by comparing against the exact midpoints between neighbouring representable
values (computed in float64, where every midpoint is exact).
"""

from __future__ import annotations

import numpy as np

E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
E4M3_ONE = 0x38


def _e2m1_table() -> np.ndarray:
    table = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)
    return table


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = (mantissa / 8.0) * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E2M1_TABLE = _e2m1_table()
E4M3_TABLE = _e4m3_table()

# Positive finite E4M3 values are increasing in their code (0x00..0x7E).
_E4M3_POS = E4M3_TABLE[:0x7F].astype(np.float64)
_E4M3_MIDPOINTS = (_E4M3_POS[:-1] + _E4M3_POS[1:]) / 2.0
_E2M1_MIDPOINTS = (E2M1_MAGNITUDES[:-1].astype(np.float64) + E2M1_MAGNITUDES[1:]) / 2.0


def _round_to_grid(magnitude: np.ndarray, midpoints: np.ndarray) -> np.ndarray:
    """Index of the nearest grid value; a value on a midpoint goes to the even index."""
    magnitude = np.asarray(magnitude)
    # atleast_1d: searchsorted returns a scalar for 0-d input, which cannot be indexed
    below = np.atleast_1d(np.searchsorted(midpoints, magnitude, side="left"))
    above = np.atleast_1d(np.searchsorted(midpoints, magnitude, side="right"))
    tie = above != below  # exactly on midpoints[below]
    index = above.copy()
    index[tie] = np.where(below[tie] % 2 == 0, below[tie], below[tie] + 1)
    return index.reshape(magnitude.shape)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """4-bit codes (one per element, values 0..15) -> float32."""
    return E2M1_TABLE[np.asarray(codes, dtype=np.uint8) & 0xF]


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float -> 4-bit codes, round half to even, saturating at +-6; the sign is kept
    for values that round to zero (tiny negatives give code 8, "-0")."""
    x = np.asarray(x, dtype=np.float32)
    magnitude = np.abs(x)
    # Count the midpoints below (all exact in float32); on a midpoint, round to the even index.
    index = np.zeros(x.shape, dtype=np.uint8)
    for i, mid in enumerate(_E2M1_MIDPOINTS.astype(np.float32)):
        index += (magnitude >= mid) if i % 2 else (magnitude > mid)
    return index | (np.signbit(x).astype(np.uint8) << 3)


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """uint8 E4M3 (float8_e4m3fn) bytes -> float32."""
    return E4M3_TABLE[np.asarray(codes, dtype=np.uint8)]


ENCODE_CHUNK = 1 << 22  # elements encoded at a time: the float64 temporaries stay ~100 MB


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float -> E4M3 bytes, round to nearest even, saturating at +-448; NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float32)
    flat = x.reshape(-1)
    codes = np.empty(flat.shape, dtype=np.uint8)
    for start in range(0, flat.size, ENCODE_CHUNK):
        part = flat[start : start + ENCODE_CHUNK]
        magnitude = np.minimum(np.abs(part).astype(np.float64), E4M3_MAX)
        out = _round_to_grid(np.nan_to_num(magnitude), _E4M3_MIDPOINTS).astype(np.uint8)
        out |= np.signbit(part).astype(np.uint8) << 7
        out[np.isnan(part)] = 0x7F
        codes[start : start + ENCODE_CHUNK] = out
    return codes.reshape(x.shape)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., K] 4-bit codes -> [..., K/2] bytes, the even element in the low nibble."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., K/2] bytes -> [..., K] 4-bit codes (low nibble first)."""
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 BF16 bit patterns -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 BF16 bit patterns, round to nearest even (NaN kept quiet)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded
