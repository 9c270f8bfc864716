"""python -m monolith.pack build|verify|unpack|inspect|list|rm (the command-line contract:
docs/cli.md).

verify, unpack and inspect take a pack directory, or the name of a cached pack as `list`
prints it, or a name the model is served as (`monolith-demo`, a hub id).

`build SRC --dry-run` reads only configs and safetensors headers and prints what a
build would do with every tensor, the pack's size and every problem (exit 1 if any)."""

from __future__ import annotations

import argparse
import json
import sys

from ..checkpoint import CheckpointError
from ..cli import ArgumentParser, quiet_when_stdout_closes
from ..formats import FormatError
from .build import DEFAULT_SHARD_BYTES, build_pack
from .catalog import cached_packs, describe, find_pack, format_list, remove
from .dry_run import dry_run, format_dry_run
from .inspect import format_inspection, inspect_pack
from .recipe import QUANTIZATION_CHOICES
from .unpack import unpack_pack
from .verify import verify_pack


def parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m monolith.pack", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build a chip-layout pack from a checkpoint (dir or hub id)")
    b.add_argument("source")
    b.add_argument("--out", help="the pack directory (required unless --dry-run)")
    b.add_argument("--dry-run", action="store_true",
                   help="write nothing: print what the build would do per tensor, the pack size and every problem")
    b.add_argument("--role", choices=("target", "draft"))
    b.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="auto",
                   help="auto: drafts to NVFP4, targets as stored; nvfp4: quantize float linears; none: never quantize")
    b.add_argument("--with-mtp", action="store_true",
                   help="a target pack keeps the checkpoint's multi-token-prediction head (docs/formats.md 5)")
    b.add_argument("--no-vision", action="store_true",
                   help="leave a target's vision tower out of the pack (text only; docs/formats.md 5)")
    b.add_argument("--revision")
    b.add_argument("--local-files-only", action="store_true")
    b.add_argument("--shard-size-mb", type=int, default=DEFAULT_SHARD_BYTES >> 20)
    b.add_argument("--force", action="store_true", help="replace an existing pack at --out")
    v = sub.add_parser("verify", help="check every hash of a pack")
    v.add_argument("pack")
    u = sub.add_parser("unpack", help="write a pack back as a ModelOpt-style checkpoint")
    u.add_argument("pack")
    u.add_argument("--out", required=True)
    u.add_argument("--force", action="store_true")
    i = sub.add_parser("inspect", help="describe a pack")
    i.add_argument("pack")
    i.add_argument("--json", action="store_true")
    i.add_argument("--ranks", type=int, metavar="N",
                   help="a target's split across N pipeline ranks (--distributed): the bytes each holds")
    ls = sub.add_parser("list", help="the packs in the pack cache: name, source, role, size, last used, verified")
    ls.add_argument("--json", action="store_true")
    r = sub.add_parser("rm", help="delete a cached pack (a name as `list` prints it, or a served model's name: all "
                                  "its packs)")
    r.add_argument("name")
    return ap


@quiet_when_stdout_closes
def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.command == "build" and not args.out and not args.dry_run:
        ap.error("build: --out is required (unless --dry-run)")
    try:
        if args.command == "build":
            if args.shard_size_mb < 1:
                raise FormatError("--shard-size-mb must be at least 1")
            if args.dry_run:
                report = dry_run(args.source, args.out, role=args.role, quantization=args.quantization,
                                 revision=args.revision, local_files_only=args.local_files_only,
                                 shard_bytes=args.shard_size_mb << 20, force=args.force, with_mtp=args.with_mtp,
                                 with_vision=not args.no_vision)
                print(format_dry_run(report))
                return 1 if report.problems else 0
            out = build_pack(args.source, args.out, role=args.role, quantization=args.quantization,
                             revision=args.revision, local_files_only=args.local_files_only,
                             shard_bytes=args.shard_size_mb << 20, force=args.force, with_mtp=args.with_mtp,
                             with_vision=not args.no_vision)
            print(format_inspection(inspect_pack(out)))
        elif args.command == "list":
            rows = [describe(p) for p in cached_packs()]
            print(json.dumps(rows, indent=1) if args.json else format_list(rows))
        elif args.command == "rm":
            for name in remove(args.name):
                print(f"removed {name}")
        elif args.command == "verify":
            summary = verify_pack(find_pack(args.pack))
            print(f"ok: {summary['tensors']} tensors in {summary['shards']} shard(s), pack_sha256 {summary['pack_sha256']}")
        elif args.command == "unpack":
            print(unpack_pack(find_pack(args.pack), args.out, force=args.force))
        else:
            info = inspect_pack(find_pack(args.pack), args.ranks)
            print(json.dumps(info, indent=1, sort_keys=True) if args.json else format_inspection(info))
    except BrokenPipeError:
        raise  # stdout's reader left: quiet_when_stdout_closes
    except (CheckpointError, FormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
