"""The CPU's layer pipelining (monolith.models.layers.run_now) on and off (whole_graphs), in one run:
decode tok/s of B sequences stepped together (runtime/batch.py, as the engine steps
them), plain and speculative (the draft, fixed blocks), on the bundled demo pair.

    python -m bench.archive.layer_pipelining [--batches 1,4] [--prompt-tokens 256]
                                             [--max-tokens 128] [--repeats 5]
Prints a table and writes bench/archive/results/layer_pipelining.json and .md. Each repeat runs
the same B prompts (slices of monolith/data/corpus.txt, fresh sessions) with the
pipelining off and then on, back to back; a run's tok/s counts the tokens after every
sequence's first one over the time after the batch's first step (its prefills). Rows
give medians, and the speedup is the median (and range) of the repeats' own on / off
ratios; `same output` checks that every sequence's tokens are equal both ways. Run it
as the other CPU benches, e.g. with LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
OPENBLAS_NUM_THREADS=1.

Archived, a finished study: the CPU pipelines its layers (monolith.models.layers.run_now)
and bench/archive/results/layer_pipelining.md, which models/layers.py and the docs cite,
says what it gains.
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import nullcontext
from pathlib import Path

from bench.common import batch_decode, corpus_prompts, machine, machine_note, write

MODES = ("plain", "speculative")


def decoders(max_context: int) -> dict:
    from monolith.engine_setup import load_drafter, load_target
    from monolith.pack.demo import demo_pair
    from monolith.runtime.decoder import Decoder
    from monolith.runtime.scheduler import FixedScheduler
    from monolith.tokenizer import load_tokenizer

    target, draft = demo_pair()
    model = load_target(target)
    drafter = load_drafter(draft, model)
    return {"tokenizer": load_tokenizer(target),
            "plain": Decoder(model, None, max_context),
            "speculative": Decoder(model, drafter, max_context, scheduler=FixedScheduler())}


def run(decoder, prompts: list[list[int]], max_tokens: int, pipelined: bool) -> tuple[float, list[list[int]]]:
    """(decode tok/s, each sequence's tokens) of the prompts stepped as one batch."""
    from monolith.models import layers

    with nullcontext() if pipelined else layers.whole_graphs():
        return batch_decode(decoder, prompts, max_tokens)


def measure(args) -> list[dict]:
    parts = decoders(args.prompt_tokens + args.max_tokens + 16)
    rows = []
    for mode in args.modes:
        for b in args.batches:
            prompts = corpus_prompts(parts["tokenizer"], b, args.prompt_tokens)
            run(parts[mode], prompts, 8, True)  # warm-up
            off, on, ratios, same = [], [], [], True
            for _ in range(args.repeats):
                rate_off, out_off = run(parts[mode], prompts, args.max_tokens, False)
                rate_on, out_on = run(parts[mode], prompts, args.max_tokens, True)
                off.append(rate_off)
                on.append(rate_on)
                ratios.append(rate_on / rate_off)
                same = same and out_on == out_off
            row = {"mode": mode, "batch": b, "off_tok_s": statistics.median(off), "on_tok_s": statistics.median(on),
                   "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
                   "same_output": same, "repeats": args.repeats}
            rows.append(row)
            print(f"{mode:12s} B={b}: off {row['off_tok_s']:.1f} tok/s, on {row['on_tok_s']:.1f} tok/s, "
                  f"speedup {row['speedup']:.2f} ({min(ratios):.2f}-{max(ratios):.2f}), same output {same}",
                  flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| mode | B | off tok/s | on tok/s | speedup (range) | same output |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['batch']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | "
                     f"{r['speedup']:.2f} ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | "
                     f"{'yes' if r['same_output'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")  # bench/archive/results
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)} (known: {', '.join(MODES)})")
    args.batches = [int(b) for b in args.batches.split(",")]
    m = machine()
    rows = measure(args)
    notes = [machine_note(m), "model: the bundled demo pair (speculative: fixed blocks of 7 proposals, greedy)",
             f"{args.repeats} repeats of off then on; {args.prompt_tokens}-token prompts, {args.max_tokens} tokens each"]
    table = markdown(rows)
    print(table)
    write({"machine": m, "notes": notes, "rows": rows}, "layer_pipelining", table, args.out)


if __name__ == "__main__":
    main()
