"""MLX primitives and bytes per decode step and per verify round on the real 35B-A3B
shapes: the model's forward and commit with monolith.kernels' MLX references (what runs
without Metal) against the same forward and commit with the fused kernels. Counts, never
times: on the Linux CPU neither path says anything about a Mac's speed, but the number of
primitives (dispatches) and the bytes do.

    python -m bench.primitives [--context 1024] [--rows 8] [--kept 4] [--dtype bfloat16]

How it counts (all of it on the graph MLX builds, before any evaluation):
- A few decoder layers of Qwen3.6-35B-A3B at real size (the model's own classes, with
  weights that are zero-cost broadcast leaves in pack precision: NVFP4 projections,
  experts, embedding and lm_head; BF16 routers), layers [GDN, GDN, GDN, attention]. One
  period of 4 layers is the difference between a 4- and an 8-layer model; 40 layers =
  4 layers + 9 periods.
- Nodes of the graph are counted with mx.export_to_dot ("shape=rectangle").
- As on a Mac, not as on this CPU: quantized matmuls take the compute dtype (no F32
  upcasts), and the fast ops that the CPU backend expands into fallback graphs
  (mx.fast.rms_norm / rope / scaled_dot_product_attention / gated_delta_update and
  nvfp4 mx.dequantize) count as the one primitive they are on Metal. mx.compile fuses as
  it does on both backends.
- mx.fast.metal_kernel cannot run without Metal: calling it raises "[metal_kernel] No
  Metal back-end." It does build inside mx.export_function tracing, as one CustomKernel
  node per call (checked below and in tests/test_kernels.py), but that tracing also
  expands the fast ops and disables mx.compile. So every kernel call counts as one
  primitive (a stand-in node with the kernel's inputs and outputs, built from the kernel's
  own Launch), plus the ops around it.
- Bytes: weights touched (experts: the expected number of distinct experts for the rows),
  recurrent/conv state read + written, KV read, and the activation traffic of the fused
  regions, assuming every materializing primitive reads its inputs and writes its output
  once (views are free), against one read + one write per kernel.
The model is built by bench/real_size_model.py, the bytes counted by bench/step_bytes.py.
Writes bench/results/primitives.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import re
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx

from bench.real_size_model import (
    CONFIG,
    PERIOD,
    TOTAL_LAYERS,
    build_model,
    leaf,
    make_cache,
)
from bench.step_bytes import (
    conv_dim,
    fused_region_bytes,
    state_bytes,
    weight_bytes_total,
)
from monolith.kernels import KERNELS
from monolith.kernels import kernel as kernel_module
from monolith.kernels.kernel import MetalKernel
from monolith.models.layers import whole_graphs
from monolith.models.target_args import ModelArgs

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ counting as on Metal


def opaque(inputs, shapes, dtypes) -> list[mx.array]:
    """One graph node (Depends) with these inputs and outputs of these shapes and dtypes."""
    placeholders = [leaf(tuple(s), d) for s, d in zip(shapes, dtypes)]
    arrays = [x for x in inputs if isinstance(x, mx.array)]
    return list(mx.depends(placeholders, arrays))


@contextlib.contextmanager
def metal_primitives():
    """mx.fast ops and nvfp4 dequantize as the single primitives they are on Metal."""
    fast = mx.fast
    saved = {name: getattr(fast, name) for name in ("rms_norm", "rope", "scaled_dot_product_attention",
                                                    "gated_delta_update")}
    saved_dequantize = mx.dequantize

    def rms_norm(x, weight, eps, **_):
        out = x.dtype if weight is None or weight.dtype == x.dtype else mx.float32  # MLX's promotion here
        return opaque([x, weight], [x.shape], [out])[0]

    def rope(x, dims, **kw):
        return opaque([x, kw.get("offset")], [x.shape], [x.dtype])[0]

    def sdpa(q, k, v, **kw):
        return opaque([q, k, v], [q.shape[:-1] + (v.shape[-1],)], [q.dtype])[0]

    def gdu(q, k, v, g, beta, initial_state=None, mask=None, **_):
        b, t, hv, dv = v.shape
        return tuple(opaque([q, k, v, g, beta, initial_state], [(b, t, hv, dv), (b, hv, dv, k.shape[-1])],
                            [v.dtype, mx.float32]))

    def dequantize(w, scales, biases=None, group_size=None, bits=None, mode="affine", dtype=mx.float32, **_):
        per_word = 32 // bits
        return opaque([w, scales], [w.shape[:-1] + (w.shape[-1] * per_word,)], [dtype])[0]

    fast.rms_norm, fast.rope, fast.scaled_dot_product_attention, fast.gated_delta_update = (
        rms_norm, rope, sdpa, gdu)
    mx.dequantize = dequantize
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(fast, name, fn)
        mx.dequantize = saved_dequantize


def count(*arrays) -> tuple[int, Counter]:
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    labels = re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue())
    return len(labels), Counter(labels)


# ------------------------------------------------------------------ the kernel path


@contextlib.contextmanager
def kernels_counted():
    """The model's own forward and commit with the Metal path of monolith.kernels chosen,
    every kernel call built as one primitive (metal_kernel cannot run here)."""
    saved_backend, saved_call = kernel_module.backend, MetalKernel.__call__

    def call(self, launch):
        return opaque(launch.inputs, launch.output_shapes, launch.output_dtypes)

    kernel_module.backend, MetalKernel.__call__ = (lambda: "metal"), call
    try:
        yield
    finally:
        kernel_module.backend, MetalKernel.__call__ = saved_backend, saved_call


def step_graph(model, tokens, context: int, kind: str, kept: int):
    """Output arrays of one decode step (kind "decode") or one verify round ("round":
    verify forward over the rows, then commit of `kept` rows)."""
    cache = make_cache(model, context)
    if kind == "decode":
        return [model.forward(tokens, cache, logits="last")[0]]
    snap = cache.snapshot(record=True)
    logits = model.forward(tokens, cache, logits="all")[0]
    cache.commit(snap, kept)
    return [logits, *[a for pair in cache.snapshot().states for a in pair]]


def primitives(models, path, rows, context, kind, kept):
    counts = {}
    for layers, model in models.items():
        tokens = mx.array(list(range(1, rows + 1)), dtype=mx.int32)
        with metal_primitives(), whole_graphs(), (kernels_counted() if path == "kernels" else contextlib.nullcontext()):
            counts[layers] = count(*step_graph(model, tokens, context, kind, kept))
    small, large = counts[PERIOD], counts[2 * PERIOD]
    period = large[0] - small[0]
    total = small[0] + (TOTAL_LAYERS // PERIOD - 1) * period
    labels = large[1] - small[1]
    return {"period": period, "total": total, "four_layers": small[0], "period_breakdown": dict(labels.most_common())}



# ------------------------------------------------------------------ checks


def kernel_nodes_when_traced(rows: int = 8) -> dict[str, int]:
    """Build every kernel call under mx.export_function tracing (where metal_kernel works
    without Metal) at real shapes and count its nodes: each must be one CustomKernel."""
    def dense(shape, dtype):  # the trace writes its constants: no broadcast views here
        x = mx.zeros(shape, dtype)
        mx.eval(x)
        return x

    a = ModelArgs.from_config(dict(CONFIG, num_hidden_layers=4), "qwen3_5_moe")
    c, hv, dv = conv_dim(a), a.linear_num_value_heads, a.linear_value_head_dim
    hk, dk = a.linear_num_key_heads, a.linear_key_head_dim
    bf, f32 = mx.bfloat16, mx.float32
    width = c + hv * dv + 2 * hv
    tape = (dense((1, 3 + rows, c), f32), dense((1, rows, hk, dk), f32), dense((1, rows, hv, dv), f32),
            dense((1, rows, hv), f32), dense((1, rows, hv), f32), dense((1, hv, dv, dk), f32))
    args = {  # each kernel of monolith.kernels.KERNELS at real shapes
        # (a slice of the vocabulary: the trace writes its constants to a file)
        "embedding": (dense((rows,), mx.int32), dense((1024, 256), mx.uint32), dense((1024, 128), mx.uint8),
                      dense((1024,), f32), bf),
        "premix": (dense((1, rows, width), bf), dense((1, 3, c), f32), dense((c, 4), f32), dense((hv,), f32),
                   dense((hv,), f32), hk, dk, hv, dv),
        "gated_norm": (dense((1, rows, hv, dv), f32), dense((1, rows, width), bf), dense((dv,), f32), 1e-6, c),
        "router": (dense((rows, 256), f32), 8),
        "attention": (dense((1, rows, 36 * 256), bf), dense((256,), f32), dense((256,), f32), 5,
                      16, 2, 256, 64, 1e7, 1e-6),
        "combine": (dense((rows, 8, 2048), bf), dense((rows, 8), f32), dense((rows, 2048), bf),
                    dense((rows, 1), bf), dense((1, rows, 2048), bf), dense((2048,), f32), 1e-6),
        "add_norm": (dense((1, rows, 2048), bf), dense((1, rows, 2048), bf), dense((2048,), f32), 1e-6),
        "replay": (*tape, 4),
    }
    found = {}
    for kernel, module in KERNELS.items():
        name = Path(module.KERNEL.filename).stem  # its body's name, as the results name it

        def traced(module=module, args=args[kernel], name=name):
            outs = module.metal(*args)
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            found[name] = count(*outs)[1]
            return outs

        with tempfile.TemporaryDirectory() as tmp:
            mx.export_function(str(Path(tmp) / "k.mlxfn"), traced)
    return {name: dict(labels) for name, labels in found.items()}


# ------------------------------------------------------------------ main


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024, help="rows already in the cache")
    parser.add_argument("--rows", type=int, default=8, help="verify rows per round (anchor + proposals)")
    parser.add_argument("--kept", type=int, default=4, help="rows a round keeps (commit)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "primitives.json"))
    opts = parser.parse_args(argv)
    dtype = getattr(mx, opts.dtype)
    s = 2 if dtype == mx.bfloat16 else 4

    traced = kernel_nodes_when_traced()
    for name, labels in traced.items():
        if labels != {"CustomKernel": 1}:
            raise SystemExit(f"{name}: traced as {labels}, not one CustomKernel node")

    models = {n: build_model(n, dtype) for n in (PERIOD, 2 * PERIOD)}
    results = {"config": "Qwen3.6-35B-A3B", "layers": TOTAL_LAYERS, "dtype": opts.dtype, "context": opts.context,
               "verify_rows": opts.rows, "kept_rows": opts.kept, "platform": platform.platform(),
               "mlx": mx.__version__, "kernel_nodes_when_traced": traced}
    for kind, rows in (("decode", 1), ("round", opts.rows)):
        ref = primitives(models, "reference", rows, opts.context, kind, opts.kept)
        ker = primitives(models, "kernels", rows, opts.context, kind, opts.kept)
        results[kind] = {"reference": ref, "kernels": ker,
                         "fewer_primitives": 1 - ker["total"] / ref["total"]}

    full = ModelArgs.from_config(dict(CONFIG, num_hidden_layers=TOTAL_LAYERS), "qwen3_5_moe")
    for kind, rows in (("decode", 1), ("round", opts.rows)):
        common = weight_bytes_total(models, rows) + state_bytes(full, rows, opts.context)
        regions = fused_region_bytes(full, rows, s)
        if kind == "round":  # the commit: replay of the kept rows from the pre-round state
            regions.update(fused_region_bytes(full, rows, s, kept=opts.kept))
        ref_act = sum(r for r, _ in regions.values())
        ker_act = sum(k for _, k in regions.values())
        results[kind]["bytes"] = {
            "weights_state_kv": common, "reference_fused_regions": ref_act, "kernel_fused_regions": ker_act,
            "reference_total": common + ref_act, "kernels_total": common + ker_act,
            "regions": {name: {"reference": r, "kernels": k} for name, (r, k) in regions.items()},
        }
    report(results)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {opts.out}")
    return results



def report(results: dict) -> None:
    gb = 1e9
    print(f"Qwen3.6-35B-A3B, {results['layers']} layers, {results['dtype']}, context {results['context']}; "
          f"round = verify {results['verify_rows']} rows + commit {results['kept_rows']}")
    print("MLX primitives counted as on Metal: fast ops and each kernel call = 1 primitive "
          "(metal_kernel does not run without Metal; traced, each call is one CustomKernel node)")
    print(f"\n{'':24s}{'reference':>12s}{'kernels':>12s}{'fewer':>9s}")
    for kind, label in (("decode", "decode step (T=1)"), ("round", "verify round")):
        r = results[kind]
        print(f"{label:24s}{r['reference']['total']:12d}{r['kernels']['total']:12d}"
              f"{100 * r['fewer_primitives']:8.1f}%")
        print(f"{'  per 4-layer period':24s}{r['reference']['period']:12d}{r['kernels']['period']:12d}")
    print(f"\n{'bytes (GB)':24s}{'reference':>12s}{'kernels':>12s}{'common':>12s}")
    for kind, label in (("decode", "decode step (T=1)"), ("round", "verify round")):
        b = results[kind]["bytes"]
        print(f"{label:24s}{b['reference_total'] / gb:12.4f}{b['kernels_total'] / gb:12.4f}"
              f"{b['weights_state_kv'] / gb:12.4f}")
        for name, v in b["regions"].items():
            print(f"{'  ' + name:24s}{v['reference'] / 1e6:10.2f}MB{v['kernels'] / 1e6:10.2f}MB")


if __name__ == "__main__":
    main()
