"""python -m monolith.synth {target,draft,pair} --out DIR [options]: write deterministic
synthetic checkpoints (see monolith.synth).

With --layout, the file set of a published repository (monolith.synth.published):
  target --layout nvidia-35b|unsloth-27b [--preset tiny|full|NAME] [--layers N] [--skeleton]
  draft --layout DRAFT --target DIR [--skeleton]
  pair --layout DRAFT [--preset ...] [--layers N] [--skeleton]  (the draft and its target)
--skeleton writes headers only, at full file size (sparse)."""

from __future__ import annotations

import argparse
import sys

from ..cli import ArgumentParser, quiet_when_stdout_closes
from . import DRAFT_FORMATS, FORMATS, PRESETS, write_draft, write_pair, write_target
from .published import (
    DRAFT_LAYOUTS,
    LAYOUTS,
    TARGET_LAYOUTS,
    write_published_draft,
    write_published_pair,
    write_published_target,
)
from .target import EXPERT_LAYOUTS


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m monolith.synth", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=("target", "draft", "pair"))
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS) + ["full"])
    parser.add_argument("--format", choices=FORMATS, help="target format (default bf16)")
    parser.add_argument("--draft-format", choices=DRAFT_FORMATS, help="draft format (default deepspec)")
    parser.add_argument("--seed", type=int, default=0)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--dense", action="store_const", const=True, dest="dense", help="dense MLP (27B-style) target")
    model.add_argument("--moe", action="store_const", const=False, dest="dense", help="MoE target (35B-style)")
    parser.add_argument("--expert-layout", choices=EXPERT_LAYOUTS)
    parser.add_argument("--shards", type=int, help="number of safetensors files of the target")
    parser.add_argument("--markov-head-type", default="vanilla", choices=("vanilla", "gated", "rnn"))
    parser.add_argument("--target", help="target directory the draft fits (for `draft`)")
    parser.add_argument("--layout", choices=LAYOUTS, help="a published repository's file set")
    parser.add_argument("--layers", type=int, help="target depth (num_hidden_layers), with --layout")
    parser.add_argument("--skeleton", action="store_true", help="headers only, at full size (with --layout)")
    return parser


@quiet_when_stdout_closes
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.seed < 0:
            raise ValueError("--seed must be non-negative")
        if args.layout:
            _published(args)
            return 0
        if args.preset == "full" or args.layers is not None or args.skeleton:
            raise ValueError("--preset full, --layers and --skeleton need --layout")
        fmt, draft_fmt = args.format or "bf16", args.draft_format or "deepspec"
        if args.what == "draft":
            if not args.target:
                raise ValueError("`draft` needs --target DIR")
            print(write_draft(args.out, args.target, draft_fmt, args.seed, args.markov_head_type))
        elif args.what == "target":
            print(write_target(args.out, args.preset, fmt, args.dense, args.expert_layout, args.seed, args.shards))
        else:
            if args.dense is not None or args.expert_layout or args.shards or args.markov_head_type != "vanilla":
                raise ValueError("`pair` takes --preset, --format, --draft-format and --seed only")
            target, draft = write_pair(args.out, args.preset, fmt, draft_fmt, args.seed)
            print(target)
            print(draft)
    except BrokenPipeError:
        raise  # stdout's reader left: quiet_when_stdout_closes
    except (ValueError, OSError) as e:
        print(f"monolith.synth: error: {e}", file=sys.stderr)
        return 1
    return 0


def _published(args) -> None:
    given = [
        flag
        for flag, value in (
            ("--format", args.format),
            ("--draft-format", args.draft_format),
            ("--dense/--moe", args.dense),
            ("--expert-layout", args.expert_layout),
            ("--shards", args.shards),
            ("--markov-head-type", None if args.markov_head_type == "vanilla" else args.markov_head_type),
        )
        if value is not None
    ]
    if given:
        raise ValueError(f"--layout fixes the format and files; {', '.join(given)} cannot be given with it")
    kinds = {"target": TARGET_LAYOUTS, "draft": DRAFT_LAYOUTS, "pair": DRAFT_LAYOUTS}
    if args.layout not in kinds[args.what]:
        raise ValueError(f"`{args.what}` takes --layout {' | '.join(kinds[args.what])}, not {args.layout}")
    if args.what == "target":
        print(write_published_target(args.out, args.layout, args.preset, args.layers, args.seed, args.skeleton))
    elif args.what == "draft":
        if not args.target:
            raise ValueError("`draft` needs --target DIR")
        if args.layers is not None or args.preset != "tiny":
            raise ValueError("`draft` takes its widths and depth from --target; --preset and --layers do not apply")
        print(write_published_draft(args.out, args.layout, args.target, args.seed, args.skeleton))
    else:
        for path in write_published_pair(args.out, args.layout, args.preset, args.layers, args.seed, args.skeleton):
            print(path)


if __name__ == "__main__":
    raise SystemExit(main())
