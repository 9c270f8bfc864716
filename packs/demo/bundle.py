"""Bundle a trained demo pair into packs/demo/ as the embedded default.

    python packs/demo/bundle.py OUT
    python packs/demo/bundle.py --rerecord
    python packs/demo/bundle.py --head OUT

OUT is the output of the recipe (train.py + draft.py + mtp.py): OUT/target (ModelOpt
NVFP4, with its trained MTP head in model_mtp.safetensors and the index that reads the
head there) and OUT/draft (DeepSpec NVFP4, Markov W1 BF16). Their checkpoint files are copied into
packs/demo/target and packs/demo/draft (replacing what was there), both packs are built
from the copies in a scratch directory exactly as the first start of
`python -m monolith.serve` builds them (same role and quantization, from
monolith.pack.demo), verified, and packs/demo/expected.json records each pack's
pack_sha256, every bundled file's SHA-256 and size, the versions that built them and
where the pair came from; the target is also packed --with-mtp (MTP_RECORD: the pack
`--draft mtp` serves). Re-run it after retraining; nothing else holds the hashes.
`--rerecord` keeps the bundled files and their origin and records the packs again (after
a change of the pack format or of what pack_sha256 covers). `--head OUT` copies only the
MTP head of OUT/target (mtp.py's export; its model.safetensors must be the bundled one),
keeps the rest of the bundle and its origin (adding the head's), and records the packs.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_BYTES = 50 * 2**20  # the budget for the whole bundle


def checkpoint_files(src: Path) -> list[Path]:
    """The files of a checkpoint directory the runtime reads (what a hub download fetches)."""
    from monolith.checkpoint.resolve import ALLOW_PATTERNS

    files = sorted(p for p in src.iterdir() if p.is_file() and any(fnmatch.fnmatch(p.name, g) for g in ALLOW_PATTERNS))
    if not any(p.name == "config.json" for p in files):
        sys.exit(f"error: {src}: not a checkpoint directory (no config.json)")
    return files


def copy_pair(out: Path) -> None:
    for role in ("target", "draft"):
        src, dest = out / role, HERE / role
        if not src.is_dir():
            sys.exit(f"error: {src}: missing (run the recipe first: packs/demo/README.md)")
        files = checkpoint_files(src)
        tmp = HERE / f".{role}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for path in files:
            shutil.copyfile(path, tmp / path.name)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        print(f"copied {len(files)} files of {src} into {dest}", file=sys.stderr)


HEAD_FILES = ("model_mtp.safetensors", "model.safetensors.index.json")  # mtp.py's export


def copy_head(out: Path) -> None:
    """The MTP head of OUT/target (HEAD_FILES) into packs/demo/target, whose other files stay."""
    src, dest = out / "target", HERE / "target"
    if (src / "model.safetensors").read_bytes() != (dest / "model.safetensors").read_bytes():
        sys.exit(f"error: {src}/model.safetensors is not the bundled target's: its head does not fit (bundle OUT)")
    for name in HEAD_FILES:
        if not (src / name).is_file():
            sys.exit(f"error: {src / name}: missing (run packs/demo/mtp.py first)")
        shutil.copyfile(src / name, dest / name)
    print(f"copied the MTP head of {src} into {dest}", file=sys.stderr)


def head_origin(out: Path) -> dict:
    """The head's training record (mtp.py's OUT/mtp_log.json), as far as it exists."""
    path = out / "mtp_log.json"
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "curve"} if path.is_file() else {}


def origin(out: Path) -> dict:
    """Where the pair came from: the recipe's logs as far as they exist."""
    info: dict = {"out": str(out.resolve()), "recipe": "packs/demo (train.py, draft.py)"}
    try:
        info["git_commit"] = subprocess.run(["git", "-C", str(HERE), "rev-parse", "HEAD"], capture_output=True,
                                            text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    log = out / "train.log"
    if log.is_file():
        for line in log.read_text().splitlines():
            if line.startswith("corpus: "):
                info["corpus"] = json.loads(line[len("corpus: "):])
    for name, key in (("target_log.json", "target"), ("draft_log.json", "draft")):
        path = out / name
        if path.is_file():
            data = json.loads(path.read_text())
            info[key] = data.get("final") or {k: v for k, v in data.items() if k != "curve"}
    info["mtp"] = head_origin(out)
    path = out / "acceptance.json"
    if path.is_file():
        data = json.loads(path.read_text())
        keep = ("dtype", "target", "gamma", "prompt_tokens", "max_tokens")
        info["acceptance"] = {**{k: data.get(k) for k in keep}, "summary": {
            mode: {k: v for k, v in s.items() if k in ("tau", "same_as_plain", "speedup")}
            for mode, s in data.get("summary", {}).items() if isinstance(s, dict)}}
    path = out / "demo.json"  # bench/demo.py: the assistant measures
    if path.is_file():
        info["demo"] = {k: v for k, v in json.loads(path.read_text()).items() if k in ("settings", "summary")}
    return info


def record_packs() -> dict:
    """Each pack of the bundle, built in a scratch directory as the first start of serve
    builds it, verified: its record for expected.json (by role, and MTP_RECORD)."""
    from monolith.pack import build_pack, read_manifest, verify_pack
    from monolith.pack.demo import DEMO_PACKS, MTP_RECORD

    packs = {}
    with tempfile.TemporaryDirectory(prefix="monolith-bundle-") as scratch:
        for record, role, with_mtp in (*((r, r, False) for r in DEMO_PACKS), (MTP_RECORD, "target", True)):
            quantization = DEMO_PACKS[role]
            pack = build_pack(HERE / role, Path(scratch) / record, role=role, quantization=quantization,
                              with_mtp=with_mtp)
            summary = verify_pack(pack)
            packs[record] = {"role": role, "quantization": quantization, "pack_sha256": summary["pack_sha256"],
                             "architecture": read_manifest(pack)["architecture"], "tensors": summary["tensors"],
                             "bytes": summary["bytes"], **({"with_mtp": True} if with_mtp else {})}
            print(f"{record}: pack_sha256 {summary['pack_sha256']} ({summary['tensors']} tensors, "
                  f"{summary['bytes'] / 2**20:.1f} MB)", file=sys.stderr)
    return packs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="?", help="the recipe's output directory (holds target/ and draft/)")
    ap.add_argument("--rerecord", action="store_true",
                    help="keep the bundled files and their origin; record the packs built from them again")
    ap.add_argument("--head", type=Path, default=None,
                    help="copy only the MTP head of HEAD/target (mtp.py's output) and record the packs again")
    args = ap.parse_args()
    if sum((args.out is not None, args.rerecord, args.head is not None)) != 1:
        ap.error("give the recipe's OUT directory, --rerecord or --head OUT")

    import mlx.core as mx

    from monolith.pack import manifest as mf
    from monolith.pack.build import quantizer_sha256
    from monolith.pack.demo import BUNDLE_FORMAT, DEMO_NAME, DEMO_PACKS
    from monolith.pack.recipe import RECIPE_VERSION

    if args.out is not None:
        copy_pair(args.out)
    if args.head is not None:
        copy_head(args.head)
    if not (HERE / "target" / HEAD_FILES[0]).is_file():
        sys.exit(f"error: {HERE / 'target'} has no trained MTP head ({HEAD_FILES[0]}): run packs/demo/mtp.py")
    files = {}
    for role in DEMO_PACKS:
        for path in sorted((HERE / role).iterdir()):
            files[f"{role}/{path.name}"] = {"sha256": mf.sha256_file(path), "bytes": path.stat().st_size}
    total = sum(f["bytes"] for f in files.values())
    if total > MAX_BYTES:
        sys.exit(f"error: the bundle is {total / 2**20:.1f} MB, over the {MAX_BYTES / 2**20:.0f} MB budget")

    expected = {
        "format": BUNDLE_FORMAT,
        "name": DEMO_NAME,
        "packs": record_packs(),
        "files": files,
        "built_with": {"monolith": importlib.metadata.version("monolith"), "mlx": mx.__version__, "python": platform.python_version(),
                       "recipe_version": RECIPE_VERSION, "pack_format_version": mf.PACK_FORMAT_VERSION,
                       "quantizer_sha256": quantizer_sha256()},
        "origin": origin(args.out) if args.out is not None else
        json.loads((HERE / "expected.json").read_text())["origin"],
    }
    if args.head is not None:
        expected["origin"]["mtp"] = head_origin(args.head)
    tmp = HERE / ".expected.json.tmp"
    tmp.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    tmp.rename(HERE / "expected.json")
    print(f"wrote {HERE / 'expected.json'} (bundle {total / 2**20:.1f} MB)", file=sys.stderr)


if __name__ == "__main__":
    main()
