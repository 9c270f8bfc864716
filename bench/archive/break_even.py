"""Does one machine give one answer? Serve measures at start what a drafted round costs
in plain steps (calibrate.measure_break_even: the median of 3 trials) and drafts only
when that sits clearly below the tokens a round can emit (calibrate.round_can_pay, a
10% margin). This measures it --starts times on the bundled demo pair (or --model /
--draft), each as a start does, and reports every start's median, its trials' range and
the decision, beside what the old rule (one trial, cut at gamma + 1 without a margin)
would have decided from the first trial of each start.

    python -m bench.archive.break_even [--starts 8] [--model M --draft D] [--json FILE]

Archived, a finished study: serve now uses the rule it chose (the median of 3 trials, a
10% margin); its result is bench/archive/results/break_even.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--starts", type=int, default=8)
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "archive" / "results" / "break_even.json")
    args = ap.parse_args()

    from monolith.engine_setup import load_drafter, load_target
    from monolith.pack.demo import demo_pair
    from monolith.runtime.calibrate import (
        measure_break_even,
        round_can_pay,
        round_pay_limit,
    )
    from monolith.runtime.drafter import check_gamma
    from monolith.sampling import SamplingParams

    target, draft = (args.model, args.draft) if args.model else demo_pair()
    model = load_target(target, dtype=args.dtype)
    drafter = load_drafter(draft, model, dtype=args.dtype)
    gamma = check_gamma(None, drafter.max_proposals)
    rows = []
    for start in range(args.starts):
        began = time.perf_counter()
        measured = measure_break_even(model, drafter, gamma, SamplingParams())
        rows.append({"start": start, "median": measured.steps, "trials": list(measured.trials),
                     "drafts": round_can_pay(measured.steps, gamma),
                     "old_rule_drafts": measured.trials[0] <= gamma + 1,
                     "seconds": time.perf_counter() - began})
        r = rows[-1]
        print(f"start {start}: median {r['median']:.2f} plain steps, trials "
              f"{', '.join(f'{t:.2f}' for t in r['trials'])}: {'drafts' if r['drafts'] else 'plain'} "
              f"(old rule: {'drafts' if r['old_rule_drafts'] else 'plain'}) in {r['seconds']:.1f} s")
    decisions = {r["drafts"] for r in rows}
    old = {r["old_rule_drafts"] for r in rows}
    medians = [r["median"] for r in rows]
    summary = {"gamma": gamma, "cut": round_pay_limit(gamma), "starts": len(rows),
               "median_range": [min(medians), max(medians)],
               "one_answer": len(decisions) == 1, "old_rule_one_answer": len(old) == 1}
    print(f"medians {min(medians):.2f}-{max(medians):.2f} against a cut of {summary['cut']:.1f}: "
          f"{'one answer' if summary['one_answer'] else 'answers differ'} over {len(rows)} starts "
          f"(old rule: {'one answer' if summary['old_rule_one_answer'] else 'answers differ'})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": platform.platform(), "pair": [str(target), str(draft)],
                                     "rows": rows, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
