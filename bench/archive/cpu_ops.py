"""exp through pow on this backend (monolith.models.layers.fast_exp): MLX's exp, its
sigmoid and softmax, and MLX's scaled_dot_product_attention against the ops the runtime
uses instead, at the shapes of a speculative round of the bundled demo pair (8 rows a
sequence; the draft's MLP is 768 wide; 4 query heads over 2 key heads of 64).

    python -m bench.archive.cpu_ops [--repeats 300]
Prints a table and writes bench/archive/results/cpu_ops.json and .md: milliseconds per call
(medians of 5 timings of --repeats calls, each evaluated), the ratio, and the largest
relative difference of the results. On Linux, MLX's CPU wheel computes exp as a scalar
polynomial whose fused multiply-adds are calls into libm; pow is one libm call.

Archived, a finished study: the runtime computes exp through pow on the CPU
(monolith.models.layers.fast_exp), and bench/archive/results/cpu_ops.md, which
models/layers.py and docs/operations.md cite, says by how much.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.common import machine, machine_note, write
from monolith.models import layers


def timed(fn, repeats: int) -> float:
    mx.eval(fn())  # warm-up: compiles the compiled ones
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            mx.eval(fn())
        runs.append((time.perf_counter() - start) / repeats)
    return statistics.median(runs) * 1e3


def pairs() -> list[tuple[str, object, object]]:
    """(what, MLX's op, the runtime's), each a function of no arguments."""
    x = mx.random.normal((32, 2 * 768), key=mx.random.key(0)) * 3
    mx.eval(x)
    out = [("exp 32 x 1536 (the op itself)", lambda: mx.exp(x), lambda: mx.power(2.0, x * layers.LOG2_E))]
    for rows in (8, 32):
        x = mx.random.normal((rows, 2 * 768), key=mx.random.key(rows)) * 3
        mx.eval(x)
        out.append((f"swiglu {rows} x 768", lambda x=x: layers._swiglu_exp(x), lambda x=x: layers._swiglu_pow(x)))
    for length in (128, 512, 2048):
        k1, k2 = mx.random.split(mx.random.key(length))
        q = mx.random.normal((1, 4, 8, 64), key=k1)
        cache = mx.random.normal((2, 1, 2, length + 64, 64), key=k2)  # keys are a prefix of a cache buffer
        keys, values = cache[0, :, :, :length], cache[1, :, :, :length]
        mx.eval(q, cache)
        for mask in (None, "causal"):  # the draft's block (DSpark) / the target's verify
            out.append((f"attention 8 rows over {length} keys, mask {mask}",
                        lambda q=q, k=keys, v=values, m=mask: mx.fast.scaled_dot_product_attention(
                            q, k, v, scale=0.125, mask=m),
                        lambda q=q, k=keys, v=values, m=mask: layers.attention(q, k, v, 0.125, m)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")  # bench/archive/results
    args = ap.parse_args(argv)
    rows = []
    for what, theirs, ours in pairs():
        a, b = np.array(theirs(), np.float64), np.array(ours(), np.float64)
        diff = float(np.abs(a - b).max() / np.abs(a).max())
        exp_ms, pow_ms = timed(theirs, args.repeats), timed(ours, args.repeats)
        rows.append({"op": what, "mlx_ms": exp_ms, "runtime_ms": pow_ms, "ratio": pow_ms / exp_ms,
                     "max_rel_diff": diff})
        print(f"{what}: MLX {exp_ms:.3f} ms, runtime {pow_ms:.3f} ms ({pow_ms / exp_ms:.2f}), diff {diff:.1e}",
              flush=True)
    table = "\n".join(["| op | MLX ms | runtime ms | runtime / MLX | max rel diff |", "|---|---|---|---|---|"]
                      + [f"| {r['op']} | {r['mlx_ms']:.3f} | {r['runtime_ms']:.3f} | {r['ratio']:.2f} | "
                         f"{r['max_rel_diff']:.1e} |" for r in rows])
    m = machine()
    notes = [machine_note(m), f"fast_exp() here: {layers.fast_exp()} (the runtime's ops are MLX's own where False)",
             f"medians of 5 timings of {args.repeats} evaluated calls each"]
    print(table)
    write({"machine": m, "notes": notes, "rows": rows}, "cpu_ops", table, args.out)


if __name__ == "__main__":
    main()
