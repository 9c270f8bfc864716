"""Warm against cold at scale (issue 31): generated agent-style histories (tests/histories.py:
edited replies, re-rendered tool calls, dropped reasoning, shared openings, repeats,
prompts cut inside a message) sent to one long-lived engine made as `serve` makes it,
each greedy reply compared token for token with a cold engine's (a fresh session, no
prompt cache), in every mode of tests/test_warm_cold.py, on the bundled demo pair.

    PYTHONPATH=tests python -m bench.archive.warm_cold [--cases 2000] [--seed 0] [--modes plain,drafting,...] [--max-tokens 8] [--jobs 2]

--cases is the total, split evenly over the modes; --jobs runs modes in that many
processes side by side. Reported per mode: cases, requests,
mismatches (a parting where the target's top two logits are more than 1e-3 apart),
near-ties (partings within it: float rounding of a resumed prefill's other chunks) and
seconds. Writes bench/archive/results/warm_cold.json and .md (--out-dir for another directory);
exits 1 on any mismatch.
The harness is tests/test_warm_cold.py's (it imports tests/serving_rig.py): hence
PYTHONPATH=tests.

Archived, a finished study (issue 31): 2,000 cases over every mode matched a cold engine
(bench/archive/results/warm_cold.md); tests/test_warm_cold.py runs a fixed sample of the
same harness in the suite, which is what guards it now. The harness is the tests', so this
script alone in bench imports tests code (PYTHONPATH=tests) and nothing runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


_LOADED = None  # (model, drafter, tokenizer) of this process


def run_mode(mode: str, cases: int, seed: int, max_tokens: int) -> dict:
    """One mode's row; the demo pair is loaded once per process."""
    global _LOADED
    from monolith import engine_setup
    from monolith.pack.demo import bundle_dir, demo_pair
    from monolith.tokenizer import load_tokenizer
    from tests.test_warm_cold import HARNESS_MODES, harness

    if _LOADED is None:
        target, draft = demo_pair()
        model = engine_setup.load_target(target, dtype="float32")
        _LOADED = (model, engine_setup.load_drafter(draft, model, dtype="float32"), load_tokenizer(target))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        check = harness(_LOADED, bundle_dir() / "target", HARNESS_MODES[mode], Path(tmp), cases=cases, seed=seed,
                        max_tokens=max_tokens)
    row = {"mode": mode, "cases": cases, "requests": check.requests, "mismatches": len(check.mismatches),
           "near_ties": check.near_ties, "seconds": round(time.perf_counter() - started, 1),
           "first_mismatches": [m.__dict__ for m in check.mismatches[:3]]}
    print(json.dumps({k: v for k, v in row.items() if k != "first_mismatches"}), flush=True)
    return row


def main(argv=None) -> int:
    from tests.test_warm_cold import HARNESS_MODES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(HARNESS_MODES), help="comma-separated, of: " + ", ".join(HARNESS_MODES))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=1, help="processes running modes side by side (each loads the pair)")
    ap.add_argument("--out", default="warm_cold")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "archive" / "results")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in HARNESS_MODES]
    if unknown:
        ap.error(f"unknown modes: {unknown}")
    os.environ["MONOLITH_CACHE"] = tempfile.mkdtemp(prefix="warm-cold-cache-")
    each = max(1, args.cases // len(modes))
    started = time.perf_counter()
    if args.jobs == 1:
        rows = [run_mode(mode, each, args.seed + i, args.max_tokens) for i, mode in enumerate(modes)]
    else:  # the demo packs are built once here, before the workers read them
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from monolith.pack.demo import demo_pair

        demo_pair()
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(run_mode, mode, each, args.seed + i, args.max_tokens)
                       for i, mode in enumerate(modes)]
            rows = [f.result() for f in futures]
    wall = round(time.perf_counter() - started, 1)
    total = {k: sum(r[k] for r in rows) for k in ("cases", "requests", "mismatches", "near_ties", "seconds")}
    report = {"seed": args.seed, "max_tokens": args.max_tokens, "jobs": args.jobs, "wall_seconds": wall,
              "modes": rows, "total": total}
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Warm against cold (bench/archive/warm_cold.py)", "",
             f"Demo pair, float32, greedy, {args.max_tokens} tokens a reply, seed {args.seed}; {args.jobs} "
             f"process(es), {wall} s wall.", "",
             "| mode | cases | requests | mismatches | near-ties | seconds |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['cases']} | {r['requests']} | {r['mismatches']} | {r['near_ties']} | "
              f"{r['seconds']} |" for r in rows + [dict(total, mode="**total**")]]
    (out / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if total["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
