"""The embedded default: the trained demo pair served when no --model is given.

The pair (a target and its DSpark draft, NVFP4 checkpoints, about 9 MB) is bundled in
packs/demo/{target,draft} by packs/demo/bundle.py, beside packs/demo/expected.json,
which records the pack_sha256 each of their packs must have. A checkout reads it
there; a wheel installs it as data files under <prefix>/share/monolith/packs/demo/
(pyproject: [tool.setuptools.data-files]), found through the distribution's file list.

The first start builds both packs into the pack cache ($MONOLITH_CACHE) with
resolve_pack, with the role and quantization serve and chat then resolve them with, and
checks each against expected.json: the pack_sha256 and every file the pack took from
the bundle. A pack that does not match is removed from the cache and the start fails,
naming the pack and both hashes. Later starts find the cached packs (resolve_pack's
stamp: no rebuild) and re-check only what their manifests record; a cached pack that
fails verification (a byte changed in the cache) is rebuilt from the bundle by
resolve_pack, then checked against expected.json again. The target also has a trained
MTP head (model_mtp.safetensors, packs/demo/mtp.py): asked `with_mtp`, the target's pack
is the one built --with-mtp, checked against its own record (MTP_RECORD).

There is no fallback pair: a missing bundle (a broken install) is an error, not a
server of random weights.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from filelock import FileLock

from ..data_files import candidates
from .cache import resolve_pack
from .manifest import MANIFEST, lock_path, read_manifest

DEMO_NAME = "monolith-demo"
BUNDLE_FORMAT = "monolith-demo-bundle/1"
EXPECTED = "expected.json"
# role -> pack quantization: what serve and chat resolve the pair with by default
DEMO_PACKS = {"target": "auto", "draft": "auto"}
# expected.json's record of the target pack built --with-mtp (its trained MTP head,
# model_mtp.safetensors; docs/drafts.md 6), with the target's quantization
MTP_RECORD = "target_mtp"


class DemoError(RuntimeError):
    """The bundled demo pair is missing, or does not build into the recorded packs."""


def search_paths() -> list[Path]:
    """Where the bundle is looked for, in order: the checkout, then the installed data files."""
    return [path.parent for path in candidates("packs", "demo", EXPECTED)]


def bundle_dir() -> Path:
    for path in search_paths():
        if (path / EXPECTED).is_file():
            return path
    tried = ", ".join(str(p) for p in search_paths())
    raise DemoError(f"the bundled demo pair is missing (no {EXPECTED} in {tried}); reinstall monolith or give --model")


def read_expected(bundle: Path) -> dict:
    path = bundle / EXPECTED
    try:
        expected = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DemoError(f"{path}: unreadable ({e})") from None
    if not isinstance(expected, dict) or expected.get("format") != BUNDLE_FORMAT:
        raise DemoError(f"{path}: not a {BUNDLE_FORMAT} record; re-run packs/demo/bundle.py")
    for role, quantization in DEMO_PACKS.items():
        record = expected.get("packs", {}).get(role, {})
        if "pack_sha256" not in record or record.get("quantization") != quantization:
            raise DemoError(f"{path}: no {role} pack with quantization {quantization} recorded; "
                            "re-run packs/demo/bundle.py")
        if not (bundle / role / "config.json").is_file():
            raise DemoError(f"{bundle / role}: the bundled demo {role} is missing; reinstall monolith or give --model")
    return expected


def _mismatches(manifest: dict, role: str, expected: dict) -> list[str]:
    """The pack's source and copied files whose SHA-256 is not the bundled one."""
    files = expected.get("files", {})
    found = {f["name"]: f["sha256"] for f in manifest.get("source", {}).get("files", [])}
    found.update(manifest.get("aux_files", {}))
    return [name for name, digest in sorted(found.items())
            if files.get(f"{role}/{name}", {}).get("sha256") != digest]


def check_pack(bundle: Path, role: str, expected: dict, log, verify: str = "first", with_mtp: bool = False) -> Path:
    """The cached pack of the bundled `role`, built on first use (and rebuilt when it
    fails verification, see cache.py), matching expected.json; `with_mtp`: the target
    pack that keeps its MTP head, matching the MTP_RECORD."""
    started = time.time()
    record = expected["packs"][MTP_RECORD if with_mtp else role]
    pack = resolve_pack(bundle / role, role=role, quantization=DEMO_PACKS[role], verify=verify, with_mtp=with_mtp,
                        alias=DEMO_NAME)
    manifest = read_manifest(pack)
    want, got = record["pack_sha256"], manifest.get("pack_sha256")
    changed = _mismatches(manifest, role, expected)
    if got != want or changed:
        with FileLock(lock_path(pack, "cache")):  # nothing left for a later start (or --model) to reuse
            shutil.rmtree(pack, ignore_errors=True)
        why = (f"bundled files differ from the record: {', '.join(changed)}" if changed else
               "the bundled files are as recorded, so this monolith packs them differently")
        raise DemoError(f"the demo {role} pack does not match {bundle / EXPECTED}: expected pack_sha256 {want}, "
                        f"got {got} ({why}); the pack was removed. Reinstall monolith, or re-run "
                        "packs/demo/bundle.py in a checkout")
    if (pack / MANIFEST).stat().st_mtime >= started:
        log(f"built the demo {role} pack{' with its MTP head' if with_mtp else ''} {pack}: pack_sha256 "
            f"{got[:16]}... as recorded")
    return pack


def demo_pair(log=lambda message: None, bundle: Path | None = None, verify: str = "first",
              with_mtp: bool = False) -> tuple[Path, Path]:
    """(target, draft) checkpoint directories of the bundled demo pair, their packs built
    into the pack cache and checked (the first start) or found there and verified as
    `verify` (--verify-pack) says (later starts). `with_mtp`: the target's pack is the
    one that keeps its MTP head (resolve_pack(target, with_mtp=True) finds it), checked
    against its own record, in place of the plain one."""
    bundle = Path(bundle).absolute() if bundle is not None else bundle_dir()
    expected = read_expected(bundle)
    if with_mtp and "pack_sha256" not in expected["packs"].get(MTP_RECORD, {}):
        raise DemoError(f"{bundle / EXPECTED}: no target pack with its MTP head recorded; re-run packs/demo/bundle.py")
    for role in DEMO_PACKS:
        check_pack(bundle, role, expected, log, verify, with_mtp and role == "target")
    return bundle / "target", bundle / "draft"
