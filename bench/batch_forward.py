"""Batched forwards: B sequences' rows packed into one target forward (Qwen3_5.forward_batch)
against B separate forwards, for B one-row decode segments and B 8-row verify segments
(recorded, as a speculative verify), on the bundled demo target and a synthetic MoE
target (bench/target_forward.py's preset); and the demo draft's forward_batch against B
draft forwards.

    python -m bench.batch_forward [--batches 1,2,4,8] [--context 128] [--repeats 9]
                                  [--openblas /usr/lib/x86_64-linux-gnu/libopenblas.so.0]
Prints a table and writes bench/results/batch_forward.json (one entry per BLAS). Each
repeat times the batched forward and the B separate ones back to back from the same
cache states (each separate forward evaluated on its own, as sequential serving does);
medians, and the MLX primitives each evaluates. ratio = batched /
(B separate): 1/B means batching is free, 1 that it saves nothing. --openblas re-runs
the script with that library preloaded (docs/performance.md, "The CPU backend here"): the
bundled reference BLAS of the Linux wheel makes every float32 matmul compute-bound.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from bench.common import PRESETS, count_primitives
from monolith.models.layers import whole_graphs
from monolith.runtime.prefill import prefill


def caches_at(model, b: int, context: int) -> list:
    """b caches, each prefilled with its own `context` rows."""
    vocab, caches = model.args.vocab_size, []
    for i in range(b):
        cache = model.make_cache(context + 16)
        prefill(model, mx.random.randint(0, vocab, (context,), key=mx.random.key(100 + i)).astype(mx.int32), cache)
        mx.eval(cache.arrays())
        caches.append(cache)
    return caches


def time_pair(batched, separate, repeats: int) -> tuple[float, float]:
    """Median seconds of batched() and of separate(), alternating (one warm-up each)."""
    batched(), separate()
    a, b = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        batched()
        a.append(time.perf_counter() - start)
        start = time.perf_counter()
        separate()
        b.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def target_row(model, b: int, rows: int, context: int, repeats: int) -> dict:
    from monolith.models.qwen3_5 import Segment

    caches = caches_at(model, b, context)
    snaps = [cache.snapshot() for cache in caches]
    vocab = model.args.vocab_size
    tokens = [mx.random.randint(0, vocab, (rows,), key=mx.random.key(i)).astype(mx.int32) for i in range(b)]

    def reset():
        for cache, snap in zip(caches, snaps):
            cache.restore(snap)
            if rows > 1:  # a verify records its tapes
                cache.snapshot(record=True)

    def batched():
        reset()
        results = model.forward_batch([Segment(t, c) for t, c in zip(tokens, caches)])
        mx.eval([logits for logits, _ in results], [c.arrays() for c in caches])

    def separate():
        reset()
        for t, c in zip(tokens, caches):
            logits, _ = model.forward(t, c)
            mx.eval(logits, c.arrays())

    one, many = time_pair(batched, separate, repeats)
    with whole_graphs():  # MLX primitives evaluated: the packed forward, then the B separate ones
        reset()
        results = model.forward_batch([Segment(t, c) for t, c in zip(tokens, caches)])
        packed = count_primitives(*[logits for logits, _ in results], *[a for c in caches for a in c.arrays()])
        mx.eval([logits for logits, _ in results], [c.arrays() for c in caches])
        reset()
        alone = 0
        for t, c in zip(tokens, caches):
            logits, _ = model.forward(t, c)
            alone += count_primitives(logits, *c.arrays())
            mx.eval(logits, c.arrays())
    return {"batch": b, "rows": rows, "batched_ms": one * 1e3, "separate_ms": many * 1e3, "ratio": one / many,
            "batched_primitives": packed, "separate_primitives": alone}


def draft_row(draft, b: int, context: int, repeats: int) -> dict:
    width = draft.fc.shape[1]
    items = []
    for i in range(b):
        ctx = draft.make_context(context + 16)
        draft.append_context(ctx, mx.random.normal((context, width), key=mx.random.key(200 + i)))
        mx.eval(ctx.arrays())
        items.append((ctx, 3 + i))

    def batched():
        mx.eval(draft.forward_batch(items))

    def separate():
        for ctx, anchor in items:
            mx.eval(draft.forward(ctx, anchor))

    one, many = time_pair(batched, separate, repeats)
    return {"batch": b, "rows": draft.block_size, "batched_ms": one * 1e3, "separate_ms": many * 1e3,
            "ratio": one / many}


def print_table(label: str, table: list[dict]) -> None:
    print(f"\n{label}")
    print(f"{'B':>3} {'rows':>5} {'batched ms':>11} {'B separate ms':>14} {'ratio':>6} {'1/B':>6} "
          f"{'prims batched':>14} {'prims separate':>15}")
    for r in table:
        print(f"{r['batch']:>3} {r['rows']:>5} {r['batched_ms']:11.2f} {r['separate_ms']:14.2f} "
              f"{r['ratio']:6.2f} {1 / r['batch']:6.2f} {r.get('batched_primitives', ''):>14} "
              f"{r.get('separate_primitives', ''):>15}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=128, help="rows already in every cache")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--openblas", help="preload this BLAS library (re-runs the script with LD_PRELOAD)")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "batch_forward.json")
    args = ap.parse_args()
    if args.openblas and os.environ.get("LD_PRELOAD") != args.openblas:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "LD_PRELOAD": args.openblas})

    work = Path(tempfile.mkdtemp(prefix="monolith-bench-"))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path) -> None:
    from monolith.engine_setup import load_drafter, load_target
    from monolith.models import load_model
    from monolith.pack import build_pack
    from monolith.pack.demo import demo_pair
    from monolith.synth import Preset, write_target

    os.environ.setdefault("MONOLITH_CACHE", str(work / "cache"))
    batches = [int(b) for b in args.batches.split(",")]
    target_dir, draft_dir = demo_pair()
    demo = load_target(target_dir, dtype="float32")
    synth_pack = build_pack(write_target(work / "synth", preset=Preset(**PRESETS["bench-forward"]), format="bf16",
                                         expert_layout="fused"), work / "synth.pack", role="target")
    models = {"demo": demo, "synthetic MoE (bench-forward)": load_model(synth_pack, dtype="float32")}
    report = {"machine": platform.platform(), "mlx": mx.__version__, "blas": os.environ.get("LD_PRELOAD") or "bundled",
              "context": args.context, "repeats": args.repeats, "target": {}, "draft": {}}
    print(f"BLAS: {report['blas']}; {args.context} rows in every cache; medians of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.2f}")
    for name, model in models.items():
        for rows in (1, 8):
            table = [target_row(model, b, rows, args.context, args.repeats) for b in batches]
            report["target"][f"{name}, {rows} row{'s' if rows > 1 else ''}"] = table
            print_table(f"target {name}: B segments of {rows} row(s)", table)
    draft = load_drafter(draft_dir, demo, dtype="float32").draft
    report["draft"]["demo"] = table = [draft_row(draft, b, args.context, args.repeats) for b in batches]
    print_table(f"draft demo: B blocks of {draft.block_size} rows", table)
    report["load_average"] = os.getloadavg()  # other work on the machine skews the medians
    args.json.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(args.json.read_text()).get("runs", {}) if args.json.exists() else {}
    runs[report["blas"]] = report  # one run per BLAS: the bundled one and a preloaded one side by side
    args.json.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
