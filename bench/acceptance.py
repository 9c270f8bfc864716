"""Acceptance of a trained target + DSpark draft pair on held-out prompts (greedy):
tau (accepted + 1 per round), per-position acceptance, decode tok/s of plain vs
speculative (alternating runs, medians), whether outputs equal plain greedy, for the
BF16 and the NVFP4 draft, and the NVFP4/BF16 tau ratio.

    python bench/acceptance.py --pair DIR [--target target] [--prompts 6] [--prompt-tokens 64]
                               [--max-tokens 128] [--block-size 7] [--repeats 2] [--dtype float32]

DIR is the output of packs/demo (train.py + draft.py): DIR/target (ModelOpt NVFP4),
DIR/target-bf16, DIR/draft (DeepSpec NVFP4), DIR/draft-bf16, DIR/tokens.npz (held-out
token stream: prompts are slices of it, never trained on). Prints a table and writes
bench/results/acceptance.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, required=True)
    ap.add_argument("--target", default="target", help="target subdirectory (target = NVFP4, target-bf16)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "acceptance.json")
    args = ap.parse_args()

    from monolith.models import load_model
    from monolith.runtime.decode import generate
    from monolith.runtime.drafter import load_drafter
    from monolith.runtime.sampling import SamplingParams
    from monolith.runtime.scheduler import make_scheduler
    from monolith.runtime.speculative import generate_speculative

    cache = args.pair / "packs"
    t = time.time()
    model = load_model(args.pair / args.target, dtype=args.dtype, cache_dir=cache)
    drafters = {
        "bf16": load_drafter(args.pair / "draft-bf16", model, dtype=args.dtype, quantization="none", cache_dir=cache),
        "nvfp4": load_drafter(args.pair / "draft", model, dtype=args.dtype, quantization="auto", cache_dir=cache),
    }
    print(f"loaded in {time.time() - t:.1f}s", file=sys.stderr)
    held = np.load(args.pair / "tokens.npz")["held"]
    stride = (held.size - args.prompt_tokens) // args.prompts
    prompts = [held[i * stride:i * stride + args.prompt_tokens].tolist() for i in range(args.prompts)]
    params = SamplingParams(temperature=0.0)
    max_context = args.prompt_tokens + args.max_tokens + 16
    gamma = min(args.block_size, *(d.max_proposals for d in drafters.values()))

    rows = []
    for index, prompt in enumerate(prompts):
        plain_runs, spec_runs = [], {k: [] for k in drafters}
        for _ in range(args.repeats):
            plain_runs.append(generate(model, prompt, args.max_tokens, params, [], max_context))
            for label, drafter in drafters.items():
                spec_runs[label].append(generate_speculative(model, drafter, prompt, args.max_tokens, params, [],
                                                             max_context, block_size=gamma,
                                                             scheduler=make_scheduler("fixed")))
        plain_tok_s = statistics.median(r.decode_tok_s for r in plain_runs)
        rows.append({"prompt": index, "mode": "plain", "decode_tok_s": plain_tok_s, "speedup": 1.0,
                     "generated": len(plain_runs[-1].token_ids)})
        for label, runs in spec_runs.items():
            s = runs[-1].speculative
            tok_s = statistics.median(r.decode_tok_s for r in runs)
            rows.append({
                "prompt": index, "mode": label, "decode_tok_s": tok_s, "speedup": tok_s / plain_tok_s,
                "acceptance_length": s.acceptance_length, "rounds": s.rounds,
                "accepted": sum(s.accepted_per_round), "proposed": sum(s.proposed_per_round),
                "per_position_acceptance": s.per_position_acceptance(),
                "same_as_plain": runs[-1].token_ids == plain_runs[-1].token_ids,
            })

    print(f"{args.prompts} held-out prompts of {args.prompt_tokens} tokens, {args.max_tokens} generated, gamma {gamma}, "
          f"greedy, target {args.target}, {args.dtype} (tok/s: medians of {args.repeats} alternating runs)")
    print(f"{'prompt':>6} {'mode':>6} {'tok/s':>8} {'speedup':>8} {'tau':>6} {'acc/prop':>10} {'same':>5}")
    for r in rows:
        plain = r["mode"] == "plain"
        print(f"{r['prompt']:>6} {r['mode']:>6} {r['decode_tok_s']:8.1f} {r['speedup']:8.2f} "
              f"{'' if plain else format(r['acceptance_length'], '.2f'):>6} "
              f"{'' if plain else str(r['accepted']) + '/' + str(r['proposed']):>10} "
              f"{'' if plain else str(r['same_as_plain']):>5}")
    summary = {}
    for mode in ("plain", *drafters):
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"decode_tok_s": float(np.median([r["decode_tok_s"] for r in mine])),
                         "speedup": float(np.median([r["speedup"] for r in mine]))}
        if mode != "plain":
            rounds = sum(r["rounds"] for r in mine)
            summary[mode]["tau"] = (sum(r["accepted"] for r in mine) + rounds) / rounds  # pooled over rounds
            summary[mode]["same_as_plain"] = all(r["same_as_plain"] for r in mine)
            pos = [r["per_position_acceptance"] for r in mine]
            summary[mode]["per_position_acceptance"] = [
                float(np.mean([p[k] for p in pos if k < len(p) and p[k] is not None] or [np.nan]))
                for k in range(gamma)]
    summary["nvfp4_over_bf16_tau"] = summary["nvfp4"]["tau"] / summary["bf16"]["tau"]
    for mode in drafters:
        print(f"{mode}: tau {summary[mode]['tau']:.3f}, median speedup {summary[mode]['speedup']:.2f}, "
              f"per-position {[round(x, 3) for x in summary[mode]['per_position_acceptance']]}")
    print(f"plain {summary['plain']['decode_tok_s']:.1f} tok/s; NVFP4/BF16 draft tau ratio "
          f"{summary['nvfp4_over_bf16_tau']:.3f}")
    report = {"machine": platform.platform(), "mlx": mx.__version__, "dtype": args.dtype, "pair": str(args.pair),
              "target": args.target, "gamma": gamma, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "rows": rows, "summary": summary}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
