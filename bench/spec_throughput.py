"""Plain vs speculative decoding on the same prompts, in one run: decode tok/s (runs
alternate, medians), acceptance length tau, per-position acceptance, and whether the
greedy outputs agree.

    python -m bench.spec_throughput [--prompts 3] [--prompt-tokens 128] [--max-tokens 64]
                                    [--repeats 3] [--block-size 7] [--sched fixed,cost]
                                    [--preset bench-forward] [--dtype float32]
                                    [--model PACK --draft DRAFT]
Prints a table and writes bench/results/spec_throughput.json. By default a synthetic
target and a synthetic DeepSpec draft (BF16 and NVFP4 packs of it); --model/--draft run
real ones (on a Mac). Prompts are slices of monolith/data/corpus.txt.

A synthetic draft is untrained: it accepts almost nothing, so its rows measure the
round's overhead. The `replay` rows are the ceiling: a drafter that proposes the plain
greedy output itself (every proposal accepted, tau = block size + 1), so they show what
the verify block and the commit cost against one-token steps on this backend.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.common import PRESETS, corpus_prompts, load_pair
from monolith.runtime.drafter import Drafter, Proposal


class ReplayDrafter(Drafter):
    """Proposes a known continuation of the prompt (the plain greedy output)."""

    def __init__(self, taps, sequence, vocab: int, max_proposals: int):
        self.taps, self.sequence, self.vocab, self.max_proposals = list(taps), list(sequence), vocab, max_proposals

    def start(self, max_context):
        self.rows = 0

    def observe(self, features):
        self.rows += features.shape[0]

    def propose(self, anchor, gamma, params, key):
        tokens = (self.sequence[self.rows + 1:self.rows + 1 + gamma] + [0] * gamma)[:gamma]
        q = np.zeros((gamma, self.vocab), np.float32)
        q[np.arange(gamma), tokens] = 1.0
        return Proposal(mx.array(tokens, dtype=mx.int32), mx.array(q), None)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-forward", choices=sorted(PRESETS))
    ap.add_argument("--model", type=Path, help="a target (pack or checkpoint) instead of the synthetic one")
    ap.add_argument("--draft", type=Path, help="its draft (checkpoint or pack; with --model)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="alternations of plain and each speculative mode")
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--sched", default="fixed,cost", help="schedulers to run, comma-separated")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "spec_throughput.json")
    args = ap.parse_args()
    if (args.model is None) != (args.draft is None):
        ap.error("--model and --draft go together")
    return args


def speculative_modes(args, model, drafters: dict, gamma: int, params):
    """A function of the reference continuation giving every speculative mode's (name,
    decoder) on one prompt; the cost schedulers share one calibration per drafter."""
    from monolith.runtime.calibrate import measure_costs
    from monolith.runtime.decoder import Decoder
    from monolith.runtime.scheduler import make_scheduler

    max_context = args.prompt_tokens + args.max_tokens + 16
    schedulers = [s.strip() for s in args.sched.split(",") if s.strip()]
    costs = {label: measure_costs(model, drafter, gamma, params) for label, drafter in drafters.items()
             if "cost" in schedulers}
    taps = next(iter(drafters.values())).taps

    def modes(reference):
        for label, drafter in drafters.items():
            for name in schedulers:
                scheduler = make_scheduler(name, drafter.max_proposals)
                if name == "cost":
                    scheduler.set_costs(*costs[label])
                yield f"{label}/{name}", Decoder(model, drafter, max_context, gamma=gamma, scheduler=scheduler)
        replay = ReplayDrafter(taps, reference, model.args.vocab_size, gamma)
        yield "replay/fixed", Decoder(model, replay, max_context, gamma=gamma, scheduler=make_scheduler("fixed"))

    return modes


def prompt_rows(args, index: int, prompt: list[int], plain_decoder, modes, params) -> list[dict]:
    """Plain and every speculative mode on one prompt, alternating --repeats times."""
    from monolith.runtime.engine import run_decoder

    plain_runs, spec_runs = [], {}
    for _ in range(args.repeats):
        plain = run_decoder(plain_decoder, prompt, args.max_tokens, params)
        plain_runs.append(plain)
        for name, decoder in modes(prompt + plain.token_ids):
            spec_runs.setdefault(name, []).append(run_decoder(decoder, prompt, args.max_tokens, params))
    plain_tok_s = statistics.median(r.decode_tok_s for r in plain_runs)
    rows = [{"prompt": index, "mode": "plain", "decode_tok_s": plain_tok_s, "speedup": 1.0}]
    for name, runs in spec_runs.items():
        s = runs[-1].speculative
        tok_s = statistics.median(r.decode_tok_s for r in runs)
        rows.append({
            "prompt": index, "mode": name, "decode_tok_s": tok_s, "speedup": tok_s / plain_tok_s,
            "acceptance_length": s.acceptance_length, "rounds": s.rounds,
            "accepted": sum(s.accepted_per_round), "proposed": sum(s.proposed_per_round),
            "per_position_acceptance": s.per_position_acceptance(),
            "same_as_plain": runs[-1].token_ids == plain_runs[-1].token_ids if params.greedy else None,
        })
    return rows


def print_table(args, rows: list[dict], gamma: int, params) -> None:
    print(f"{args.prompts} prompts of {args.prompt_tokens} tokens, {args.max_tokens} generated, block {gamma}, "
          f"{'greedy' if params.greedy else f'temperature {args.temperature}'}, {args.dtype} "
          f"(decode tok/s: medians of {args.repeats} alternating runs)")
    print(f"{'prompt':>6} {'mode':>14} {'tok/s':>8} {'speedup':>8} {'tau':>6} {'acc/prop':>10} {'same':>5}")
    for r in rows:
        tau = "" if r["mode"] == "plain" else f"{r['acceptance_length']:.2f}"
        acc = "" if r["mode"] == "plain" else f"{r['accepted']}/{r['proposed']}"
        same = "" if r.get("same_as_plain") is None else str(r["same_as_plain"])
        print(f"{r['prompt']:>6} {r['mode']:>14} {r['decode_tok_s']:8.1f} {r['speedup']:8.2f} {tau:>6} {acc:>10} "
              f"{same:>5}")


def write_report(args, rows: list[dict], gamma: int) -> None:
    summary = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"decode_tok_s": float(np.median([r["decode_tok_s"] for r in mine])),
                         "speedup": float(np.median([r["speedup"] for r in mine]))}
        if mode != "plain":
            summary[mode]["acceptance_length"] = float(np.mean([r["acceptance_length"] for r in mine]))
    report = {"machine": platform.platform(), "mlx": mx.__version__, "dtype": args.dtype,
              "preset": None if args.model else PRESETS[args.preset], "block_size": gamma,
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "rows": rows, "summary": summary}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)


def main() -> None:
    args = parse_args()
    from monolith.engine_setup import load_drafter
    from monolith.runtime.decoder import Decoder
    from monolith.sampling import SamplingParams
    from monolith.tokenizer import load_tokenizer

    work, target_pack, draft_src, model = load_pair(args)
    prompts = corpus_prompts(load_tokenizer(target_pack), args.prompts, args.prompt_tokens)
    params = SamplingParams(temperature=args.temperature, seed=0 if args.temperature else None)
    drafters = {label: load_drafter(draft_src, model, dtype=args.dtype, quantization=q, cache_dir=work / "packs")
                for label, q in (("bf16", "none"), ("nvfp4", "nvfp4"))}
    gamma = min(args.block_size, *(d.max_proposals for d in drafters.values()))
    modes = speculative_modes(args, model, drafters, gamma, params)
    plain_decoder = Decoder(model, None, args.prompt_tokens + args.max_tokens + 16)
    rows = [row for index, prompt in enumerate(prompts)
            for row in prompt_rows(args, index, prompt, plain_decoder, modes, params)]
    print_table(args, rows, gamma, params)
    write_report(args, rows, gamma)


if __name__ == "__main__":
    main()
