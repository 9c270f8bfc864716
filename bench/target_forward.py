"""Target forward: T=1 and T=8 time by context length, bytes touched, MLX primitives
per forward, and plain decode tok/s beside mlx-lm's qwen3_5_moe on the same weights.

    python -m bench.target_forward [--contexts 128,512,2048] [--repeats 5] [--decode-tokens 32]
                                   [--preset bench-forward] [--dtype float32]
Prints tables and writes bench/results/target_forward.json. Sizes are parameters, so the
same script runs at real size on a Mac (`--pack DIR` to use an existing pack).
On the Linux CPU, MLX's GatherMM runs only in float32: BF16-weight runs use float32
compute there.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from bench.common import PRESETS, bytes_touched, count_primitives
from monolith.models.layers import whole_graphs
from monolith.runtime.calibrate import median_seconds
from monolith.runtime.prefill import prefill

WARMUP_STEPS = 4
def forward_table(model, manifest, contexts, repeats, dtype_bytes) -> list[dict]:
    rows_out = []
    vocab = model.args.vocab_size
    for context in contexts:
        cache = model.make_cache(context + 16)
        prompt = mx.random.randint(0, vocab, (context,), key=mx.random.key(context)).astype(mx.int32)
        prefill(model, prompt, cache, chunk_size=512)
        mx.eval(cache.arrays())
        snap = cache.snapshot()
        row = {"context": context}
        for t in (1, 8):
            tokens = mx.random.randint(0, vocab, (t,), key=mx.random.key(t)).astype(mx.int32)

            def step():
                cache.restore(snap)
                logits, _ = model(tokens, cache)
                mx.eval(logits, cache.arrays())

            row[f"t{t}_ms"] = median_seconds(step, repeats) * 1e3
            cache.restore(snap)
            with whole_graphs():
                logits, _ = model(tokens, cache)
            row[f"t{t}_primitives"] = count_primitives(logits, *cache.arrays())
            row[f"t{t}_bytes"] = bytes_touched(manifest, model.args, t, context, dtype_bytes)
            mx.eval(logits)
        rows_out.append(row)
    return rows_out


def ours_decode(model, prompt, steps: int) -> float:
    cache = model.make_cache(len(prompt) + steps + WARMUP_STEPS + 16)
    logits = prefill(model, mx.array(prompt, dtype=mx.int32), cache)
    token = mx.argmax(logits).reshape(1).astype(mx.int32)
    for _ in range(WARMUP_STEPS):
        logits, _ = model(token, cache)
        token = mx.argmax(logits[-1]).reshape(1).astype(mx.int32)
        mx.eval(token)
    start = time.perf_counter()
    for _ in range(steps):
        logits, _ = model(token, cache)
        token = mx.argmax(logits[-1]).reshape(1).astype(mx.int32)
        mx.eval(token)
    return steps / (time.perf_counter() - start)


def mlx_lm_decode(path: Path, prompt, steps: int, dtype, quantize: bool) -> float:
    from mlx_lm.models import cache as lm_cache
    from mlx_lm.utils import load_model as lm_load

    model, _ = lm_load(path)
    model.set_dtype(dtype)  # same compute dtype as ours (the CPU GatherMM runs only in float32)
    if quantize:
        import mlx.nn as nn

        nn.quantize(model, group_size=16, bits=4, mode="nvfp4",
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and not p.endswith(("mlp.gate", "shared_expert_gate", "embed_tokens")))
    cache = lm_cache.make_prompt_cache(model)
    logits = model(mx.array(prompt, dtype=mx.int32)[None], cache=cache)
    token = mx.argmax(logits[0, -1]).reshape(1, 1)
    for _ in range(WARMUP_STEPS):
        logits = model(token, cache=cache)
        token = mx.argmax(logits[0, -1]).reshape(1, 1)
        mx.eval(token)
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(token, cache=cache)
        token = mx.argmax(logits[0, -1]).reshape(1, 1)
        mx.eval(token)
    return steps / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-forward", choices=sorted(PRESETS))
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=3, help="alternations of ours vs mlx-lm decode")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "target_forward.json")
    args = ap.parse_args()

    from monolith.models import load_model
    from monolith.pack import build_pack, read_manifest
    from monolith.synth import Preset, write_target

    work = Path(tempfile.mkdtemp(prefix="monolith-bench-"))
    preset = Preset(**PRESETS[args.preset])
    bf16_src = write_target(work / "bf16", preset=preset, format="bf16", expert_layout="fused")
    report = {"machine": platform.platform(), "mlx": mx.__version__, "preset": PRESETS[args.preset],
              "dtype": args.dtype, "tables": {}, "decode": []}
    contexts = [int(c) for c in args.contexts.split(",")]
    dtype_bytes = 4 if args.dtype == "float32" else 2
    for label, quantization in (("bf16", "none"), ("nvfp4", "nvfp4")):
        pack = build_pack(bf16_src, work / f"pack-{label}", quantization=quantization)
        model = load_model(pack, dtype=args.dtype)
        table = forward_table(model, read_manifest(pack), contexts, args.repeats, dtype_bytes)
        report["tables"][label] = table
        print(f"\n{label} weights, {args.dtype} compute")
        print(f"{'context':>8} {'T=1 ms':>8} {'T=8 ms':>8} {'T=8/T=1':>8} {'prims T=1':>10} {'prims T=8':>10} "
              f"{'MB T=1':>8} {'MB T=8':>8}")
        for r in table:
            print(f"{r['context']:>8} {r['t1_ms']:8.2f} {r['t8_ms']:8.2f} {r['t8_ms'] / r['t1_ms']:8.2f} "
                  f"{r['t1_primitives']:>10} {r['t8_primitives']:>10} {r['t1_bytes']['total'] / 1e6:8.2f} "
                  f"{r['t8_bytes']['total'] / 1e6:8.2f}")

    prompt = list(range(3, 3 + 64))
    dtype = getattr(mx, args.dtype)
    print(f"\nplain decode tok/s, {args.decode_tokens} tokens after a 64-token prompt (alternating, medians)")
    print(f"{'weights':>8} {'monolith':>9} {'mlx-lm':>8} {'ratio':>6}")
    for label, quantization in (("bf16", "none"), ("nvfp4", "nvfp4")):
        model = load_model(work / f"pack-{label}", dtype=args.dtype)
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(ours_decode(model, prompt, args.decode_tokens))
            theirs.append(mlx_lm_decode(bf16_src, prompt, args.decode_tokens, dtype, quantization == "nvfp4"))
        o, t = statistics.median(ours), statistics.median(theirs)
        report["decode"].append({"weights": label, "monolith_tok_s": o, "mlx_lm_tok_s": t, "ratio": o / t})
        print(f"{label:>8} {o:9.1f} {t:8.1f} {o / t:6.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
