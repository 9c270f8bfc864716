"""python -m monolith.synth {target,draft,pair} --out DIR [options]: write deterministic
synthetic checkpoints (see monolith.synth)."""

from __future__ import annotations

import argparse
import sys

from ..cli import ArgumentParser
from . import DRAFT_FORMATS, FORMATS, PRESETS, write_draft, write_pair, write_target
from .target import EXPERT_LAYOUTS


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m monolith.synth", description=__doc__)
    parser.add_argument("what", choices=("target", "draft", "pair"))
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--format", default="bf16", choices=FORMATS, help="target format")
    parser.add_argument("--draft-format", default="deepspec", choices=DRAFT_FORMATS)
    parser.add_argument("--seed", type=int, default=0)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--dense", action="store_const", const=True, dest="dense", help="dense MLP (27B-style) target")
    model.add_argument("--moe", action="store_const", const=False, dest="dense", help="MoE target (35B-style)")
    parser.add_argument("--expert-layout", choices=EXPERT_LAYOUTS)
    parser.add_argument("--shards", type=int, help="number of safetensors files of the target")
    parser.add_argument("--markov-head-type", default="vanilla", choices=("vanilla", "gated", "rnn"))
    parser.add_argument("--target", help="target directory the draft fits (for `draft`)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.seed < 0:
            raise ValueError("--seed must be non-negative")
        if args.what == "draft":
            if not args.target:
                raise ValueError("`draft` needs --target DIR")
            print(write_draft(args.out, args.target, args.draft_format, args.seed, args.markov_head_type))
        elif args.what == "target":
            print(
                write_target(args.out, args.preset, args.format, args.dense, args.expert_layout, args.seed, args.shards)
            )
        else:
            if args.dense is not None or args.expert_layout or args.shards or args.markov_head_type != "vanilla":
                raise ValueError("`pair` takes --preset, --format, --draft-format and --seed only")
            target, draft = write_pair(args.out, args.preset, args.format, args.draft_format, args.seed)
            print(target)
            print(draft)
    except (ValueError, OSError) as e:
        print(f"monolith.synth: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
