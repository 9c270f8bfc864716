"""--kv-bits: what the quantized KV cache saves and what it costs, against the cache as
computed (F32 by default; BF16, a Mac's, with --dtype bfloat16).

    python -m bench.kv_quant [--models demo,skeleton] [--contexts 8192,32768] [--tokens 512]
                             [--prefill-tokens 2048] [--bits 8,4] [--dtype float32|bfloat16]
                             [--out-dir bench/results]

Writes kv_quant.json/.md (F32) or kv_quant_bfloat16.json/.md.

The defaults (and --dtype bfloat16) run every point the results hold. The quality
columns are deterministic for a given machine and BLAS; the tok/s columns are only as
good as the machine was quiet, so the report records the load average over the run
(rerun on a quiet machine for speed). On Linux the script re-executes itself with
OpenBLAS preloaded, as serve does (monolith.blas; MONOLITH_OPENBLAS=0 keeps MLX's bundled
BLAS, about 30x slower products), and the report says which BLAS ran.

Per model and context N: the context (the demo's corpus text, tokenized, for the demo;
random ids for the skeleton) is prefilled once with the cache as computed; a greedy
continuation of --tokens tokens is decoded from it (decode tok/s), then for each --bits
the same context is prefilled again into a cache of those bits (what `--kv-bits` serves:
with several attention layers, a later layer reads rows computed through the quantized
earlier ones) and the continuation decoded from the same first token: greedy agreement
(tokens equal to the reference's, and the first that differs), and, teacher-forced over
the reference's tokens in one forward, top-1 agreement and the mean KL(reference ||
quantized) of the next-token distribution.
Prefill tok/s is timed on --prefill-tokens fresh tokens per setting. Memory: the bytes
a token takes in the target's KV caches (counted, and measured from the arrays held).

Models: the bundled demo target and a synthetic skeleton at Qwen3.6-35B-A3B's
attention widths (hidden 2048, 2 KV heads x 256, the gated DeltaNet at its widths) cut
to stay affordable on a 2-core CPU: 2 layers (a gated DeltaNet, then attention), 4
query heads instead of 16 (the KV side, which is what is quantized, is the 35B's), a
dense MLP of 1024, a 8192-token vocabulary, random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

from monolith.blas import describe, preload_openblas
from monolith.models import load_model
from monolith.models.cache import KVCache
from monolith.models.kv_quant import QuantizedKVCache
from monolith.runtime.prefill import prefill
from monolith.runtime.sizing import per_token_bytes

RESULTS = Path(__file__).parent / "results"
DTYPES = {"float32": "F32", "bfloat16": "BF16"}
# Qwen3.6-35B-A3B (docs/target.md): 10 attention layers of 2 KV heads x 256; 30 gated DeltaNet states
REAL_35B = {"attention_layers": 10, "kv_heads": 2, "head_dim": 256, "context": 262144,
            "gdn_state_bytes": 30 * 4 * (3 * 8192 + 32 * 128 * 128)}


def load_demo(dtype: str):
    from monolith.engine_setup import load_target
    from monolith.pack.demo import demo_pair
    from monolith.synth.tokenizer import corpus_text
    from monolith.tokenizer import load_tokenizer

    target, _ = demo_pair()
    model = load_target(target, dtype=dtype)
    ids = load_tokenizer(target).encode(corpus_text())

    def tokens(n: int, seed: int) -> list[int]:
        start = seed * 997 % len(ids)
        return [ids[(start + i) % len(ids)] for i in range(n)]

    return model, tokens


def load_skeleton(work: Path, dtype: str):
    from monolith.pack import build_pack
    from monolith.synth import write_target
    from monolith.synth.presets import Preset

    preset = Preset(hidden_size=2048, num_hidden_layers=2, full_attention_interval=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                    linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=1024, vocab_size=8192,
                    max_position_embeddings=262144)
    pack = build_pack(write_target(work / "skeleton", preset=preset, dense=True), work / "skeleton.pack",
                      role="target")
    model = load_model(pack, dtype=dtype)

    def tokens(n: int, seed: int) -> list[int]:
        return np.random.default_rng(seed).integers(0, preset.vocab_size, n).tolist()

    return model, tokens


def greedy(model, cache, first: int, n: int) -> tuple[list[int], float]:
    """n greedy tokens after `first` (the token the context's last logits chose), and tok/s."""
    out, token = [], first
    start = time.perf_counter()
    for _ in range(n):
        logits, _ = model(mx.array([token], dtype=mx.int32), cache)
        token = int(mx.argmax(logits[-1]).item())
        out.append(token)
    return out, n / (time.perf_counter() - start)


def forced(model, cache, tokens: list[int]) -> np.ndarray:
    """Log-probabilities [T, vocab] of the next token after each of `tokens` (one forward)."""
    logits, _ = model(mx.array(tokens, dtype=mx.int32), cache)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True), dtype=np.float64)


@contextmanager
def kv_bits(model, bits: int | None):
    """The model with its KV rows quantized to `bits` (None: as computed) inside the block."""
    model.kv_bits = bits
    try:
        yield model
    finally:
        model.kv_bits = None


def quantized_prefill(model, context: list[int], bits: int, capacity: int):
    """A cache of `bits` that prefilled `context`, as `--kv-bits` prefills it."""
    with kv_bits(model, bits):
        cache = model.make_cache(capacity)
    mx.eval(prefill(model, mx.array(context, dtype=mx.int32), cache))
    return cache


def held_per_row(cache) -> float:
    layers = cache.row_layers
    return sum(a.nbytes for layer in layers for a in layer.arrays()) / layers[0].allocated


def prefill_rate(model, tokens: list[int], bits) -> float:
    with kv_bits(model, bits):
        cache = model.make_cache(len(tokens) + 1)
    start = time.perf_counter()
    mx.eval(prefill(model, mx.array(tokens, dtype=mx.int32), cache))
    return len(tokens) / (time.perf_counter() - start)


def run_context(model, tokens, n: int, count: int, bits_list, prefill_tokens: int) -> list[dict]:
    context = tokens(n, 1)
    plain = model.make_cache(n + count + 1)
    first = int(mx.argmax(prefill(model, mx.array(context, dtype=mx.int32), plain)[-1]).item())
    snap = plain.snapshot()
    reference, decode = greedy(model, plain, first, count)
    plain.restore(snap)
    ref_logp = forced(model, plain, [first] + reference[:-1])
    plain.restore(snap)
    rows = [{"context": n, "kv_bits": None, "bytes_per_token": per_token_bytes(model),
             "held_bytes_per_row": held_per_row(plain), "decode_tok_s": decode,
             "prefill_tok_s": prefill_rate(model, tokens(prefill_tokens, 2), None)}]
    for bits in bits_list:
        cache = quantized_prefill(model, context, bits, n + count + 1)
        qsnap = cache.snapshot()
        got, decode = greedy(model, cache, first, count)
        cache.restore(qsnap)
        logp = forced(model, cache, [first] + reference[:-1])
        differ = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), None)
        with kv_bits(model, bits):
            bytes_per_token = per_token_bytes(model)
        kl = (np.exp(ref_logp) * (ref_logp - logp)).sum(axis=-1)
        rows.append({"context": n, "kv_bits": bits, "bytes_per_token": bytes_per_token,
                     "held_bytes_per_row": held_per_row(cache), "decode_tok_s": decode,
                     "prefill_tok_s": prefill_rate(model, tokens(prefill_tokens, 2), bits),
                     "greedy_equal": sum(a == b for a, b in zip(got, reference)) / count,
                     "greedy_first_difference": differ,
                     "forced_top1_agreement": float((logp.argmax(-1) == ref_logp.argmax(-1)).mean()),
                     "mean_kl": float(kl.mean()), "max_kl": float(kl.max())})
        del cache
    load = os.getloadavg()[0]
    return [{**row, "load_average": load} for row in rows]


def real_35b(bits_list) -> list[dict]:
    """Qwen3.6-35B-A3B's KV bytes a token and a sequence's cache at 262,144 tokens, BF16 (a Mac)."""
    r = REAL_35B
    out = []
    for bits in [None, *bits_list]:
        layer = KVCache(r["kv_heads"], r["head_dim"], 1, mx.bfloat16) if bits is None else \
            QuantizedKVCache(r["kv_heads"], r["head_dim"], 1, mx.bfloat16, bits)
        per_token = r["attention_layers"] * layer.row_nbytes
        out.append({"kv_bits": bits, "bytes_per_token": per_token,
                    "sequence_gb_at_262144": (per_token * (r["context"] + 8) + r["gdn_state_bytes"]) / 1e9})
    return out


def markdown(report: dict) -> str:
    computed = DTYPES[report.get("dtype", "float32")]
    lines = ["# KV cache quantization (--kv-bits)", "", report["note"], "",
             (f"Machine: {report['machine']}; {report['blas']}. The load column is the machine's 1-minute load "
             "average after each context's runs: above the core count, other work shared the CPU and the tok/s "
             "columns are low and noisy (read them as \"no large change\", not as ratios); `python -m bench.kv_quant` "
              "with its defaults reruns every row, on a quiet machine for the speed columns (the quality columns "
              "are deterministic for a given machine and BLAS)."), "",
             ("| model | context | kv bits | bytes/token | vs as computed | held bytes/row | prefill tok/s | "
              "decode tok/s | load | greedy equal | first difference | forced top-1 | mean KL | max KL |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, rows in report["models"].items():
        base = {r["context"]: r["bytes_per_token"] for r in rows if r["kv_bits"] is None}
        for r in rows:
            q = r["kv_bits"] is not None
            lines.append(
                f"| {model} | {r['context']} | {r['kv_bits'] or f'none ({computed})'} | {r['bytes_per_token']} | "
                f"{r['bytes_per_token'] / base[r['context']]:.3f} | {r['held_bytes_per_row']:.0f} | "
                f"{r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | {r['load_average']:.1f} | "
                + (f"{r['greedy_equal']:.3f} | {r['greedy_first_difference']} | {r['forced_top1_agreement']:.4f} | "
                   f"{r['mean_kl']:.2e} | {r['max_kl']:.2e} |" if q else "| | | | |"))
    lines += ["", "Qwen3.6-35B-A3B at BF16 (a Mac), counted:", "",
              "| kv bits | KV bytes/token | vs BF16 | one sequence at 262,144 tokens (GB, with its GDN states) |",
              "|---|---|---|---|"]
    base = report["real_35b"][0]["bytes_per_token"]
    for r in report["real_35b"]:
        lines.append(f"| {r['kv_bits'] or 'none (BF16)'} | {r['bytes_per_token']} | "
                     f"{r['bytes_per_token'] / base:.3f} | {r['sequence_gb_at_262144']:.2f} |")
    lines += ["", ("On this CPU MLX's quantized matmul is not faster than the matmul it replaces; the gain here is "
              "memory. \"greedy equal\" counts equal tokens position by position over the free-running "
              "continuation, so after a first difference the rest no longer line up (a near-tie decided the other "
              "way shifts everything after it); \"forced top-1\" and the KL are teacher-forced over the reference "
              "continuation, so each position is judged on its own; a mean KL within rounding of zero may print "
              "slightly negative.")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="demo,skeleton")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--tokens", type=int, default=512, help="greedy tokens compared per context")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--skeleton-contexts", help="the skeleton's contexts (default --contexts)")
    ap.add_argument("--skeleton-tokens", type=int, help="the skeleton's greedy tokens (default --tokens)")
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the compute and cache dtype")
    ap.add_argument("--work", help="where the skeleton is written (default: a temporary directory)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    if argv is None:
        preload_openblas()  # re-executes this command once with OpenBLAS, where one is installed
    bits_list = [int(b) for b in args.bits.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    report = {"machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cpus, mlx {mx.__version__}, "
                         f"{mx.default_device()}",
              "blas": describe() or "the platform's BLAS",
              "dtype": args.dtype,
              "note": (f"The cache as computed is {DTYPES[args.dtype]}, the reference of the ratios and the "
                       f"agreement (a Mac's is BF16, where 8 bits is about half). {args.tokens} greedy tokens per context (the skeleton: "
                       f"{args.skeleton_tokens or args.tokens} at {args.skeleton_contexts or args.contexts}); "
                       f"prefill timed on {args.prefill_tokens} fresh tokens. The skeleton: 35B KV widths (2 KV "
                       "heads x 256), hidden 2048, a gated DeltaNet at the 35B's widths then attention, 4 query "
                       "heads, dense MLP 1024, vocabulary 8192, random weights (see the script's docstring)."),
              "settings": vars(args), "models": {}, "real_35b": real_35b(bits_list)}
    out = Path(args.out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        for name in args.models.split(","):
            model, tokens = load_demo(args.dtype) if name == "demo" else load_skeleton(work, args.dtype)
            skeleton = name == "skeleton"
            sizes = [int(c) for c in args.skeleton_contexts.split(",")] if skeleton and args.skeleton_contexts \
                else contexts
            count = args.skeleton_tokens if skeleton and args.skeleton_tokens else args.tokens
            rows = report["models"][name] = []
            for n in sizes:
                rows += run_context(model, tokens, n, count, bits_list, args.prefill_tokens)
                write(report, out)  # after each context: a long run stopped early keeps what it measured
            print(markdown({**report, "models": {name: rows}}), flush=True)


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = "kv_quant" if report["dtype"] == "float32" else f"kv_quant_{report['dtype']}"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(report))


if __name__ == "__main__":
    main()
