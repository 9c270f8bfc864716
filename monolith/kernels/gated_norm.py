"""GDN output norm (docs/target.md, gated DeltaNet step 8): rmsnorm(o) * w * silu(z) per
value head, F32 math, cast once to z's dtype (the compute dtype). z may be a column range
of a wider array (the fused in_proj output) so no slice has to be made contiguous first.
"""

from __future__ import annotations

import mlx.core as mx

from .kernel import Launch, MetalKernel, threads_for, use_metal

PER_THREAD = 8
KERNEL = MetalKernel("monolith_gated_rms_norm", "gated_rms_norm.metal", ("o", "z_src", "weight", "eps"), ("out",))


@mx.compile
def _gate(normed, z):
    z32 = z.astype(mx.float32)
    return (normed * (z32 * mx.sigmoid(z32))).astype(z.dtype)


def _z(o, z, z_offset):
    heads, dim = o.shape[-2:]
    if z.shape[:-1] != o.shape[:-2] or z.shape[-1] < z_offset + heads * dim:
        raise ValueError(f"gated_rms_norm: z {z.shape} does not hold {heads * dim} columns at {z_offset} "
                         f"for o {o.shape}")
    return heads, dim


def reference(o: mx.array, z: mx.array, weight: mx.array, eps: float, z_offset: int = 0) -> mx.array:
    heads, dim = _z(o, z, z_offset)
    if z_offset or z.shape[-1] != heads * dim:
        z = z[..., z_offset:z_offset + heads * dim]
    y = _gate(mx.fast.rms_norm(o.astype(mx.float32), weight, eps), z.reshape(o.shape))
    return y.reshape(*o.shape[:-2], heads * dim)


def launch(o, z, weight, eps, z_offset=0) -> Launch:
    heads, dim = _z(o, z, z_offset)
    rows = o.size // (heads * dim)
    threads = threads_for(dim)
    if -(-dim // threads) > PER_THREAD:
        raise ValueError(f"gated_rms_norm: head dims up to {PER_THREAD * threads} are supported")
    return Launch(inputs=(o, z, weight, float(eps)), grid=(threads, heads, rows), threadgroup=(threads, 1, 1),
                  output_shapes=((*o.shape[:-2], heads * dim),), output_dtypes=(z.dtype,),
                  template=(("T", z.dtype), ("H", heads), ("D", dim), ("ZW", z.shape[-1]), ("Z0", z_offset)))


def metal(o, z, weight, eps, z_offset=0) -> mx.array:
    return KERNEL(launch(o, z, weight, eps, z_offset))[0]


def gated_rms_norm(o: mx.array, z: mx.array, weight: mx.array, eps: float, z_offset: int = 0) -> mx.array:
    """o [..., Hv, Dv] (F32 from gated_delta_update); z [..., W] with the gate at columns
    [z_offset, z_offset + Hv*Dv); weight [Dv] F32 (plain). Returns [..., Hv*Dv] in z's dtype."""
    if use_metal():
        return metal(o, z, weight, eps, z_offset)
    return reference(o, z, weight, eps, z_offset)
