"""The target's MLPs (docs/target.md): the dense SwiGLU (`MLP`, also the draft's) and the
routed mixture of experts with its shared expert (`SparseMoeBlock`). Each adds its output
to the residual and norms the sum for the next layer in one fused step (`add_norm`)."""

from __future__ import annotations

import mlx.core as mx

from ..kernels import add_rms_norm, moe_combine, moe_route
from .layers import Linear, SwitchGLU, swiglu
from .target_args import ModelArgs


class MLP:
    """Dense SwiGLU with fused gate|up rows."""

    def __init__(self, w, prefix: str, hidden: int, intermediate: int):
        self.gate_up = w.linear(prefix + "gate_up", (2 * intermediate, hidden))
        self.down = w.linear(prefix + "down_proj", (hidden, intermediate))

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(swiglu(self.gate_up(x)))

    def add_norm(self, x: mx.array, residual: mx.array, norm: mx.array, eps: float) -> tuple[mx.array, mx.array]:
        """(h = residual + self(x), rmsnorm(h) with the next norm's weight)."""
        return add_rms_norm(residual, self(x), norm, eps)


class SparseMoeBlock:
    def __init__(self, args: ModelArgs, w, prefix: str):
        h, e, i = args.hidden_size, args.num_experts, args.moe_intermediate_size
        self.top_k = args.num_experts_per_tok
        self.router = _f32_linear(w.linear(prefix + "gate", (e, h)))
        self.experts = SwitchGLU(w.experts(prefix + "experts.gate_up", (e, 2 * i, h)),
                                 w.experts(prefix + "experts.down", (e, h, i)))
        self.shared_expert = MLP(w, prefix + "shared_expert.", h, args.shared_expert_intermediate_size)
        self.shared_expert_gate = w.linear(prefix + "shared_expert_gate", (1, h))

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(expert ids [T, k], F32 weights [T, k]) from F32 router logits: softmax ->
        top-k -> renormalize."""
        return moe_route(self.router(x.astype(mx.float32)), self.top_k)

    def add_norm(self, x: mx.array, residual: mx.array, norm: mx.array, eps: float) -> tuple[mx.array, mx.array]:
        """(h = residual + moe(x), rmsnorm(h) with the next norm's weight): routed experts,
        sigmoid-gated shared expert, residual add and norm in one combine."""
        x = x.reshape(-1, x.shape[-1])
        indices, weights = self.route(x)
        return moe_combine(self.experts(x, indices), weights, self.shared_expert(x), self.shared_expert_gate(x),
                           residual, norm, eps)


def _f32_linear(linear: Linear) -> Linear:
    """An unquantized linear with its weight in F32 (the router: small, and its logits are
    F32), converted once at load rather than promoted in every matmul."""
    if linear.mode is not None or linear.weight.dtype == mx.float32:
        return linear
    return Linear(linear.weight.astype(mx.float32), linear.precision, shape=linear.shape)
