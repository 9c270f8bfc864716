"""Pack build throughput beside plain read throughput of the same files, and peak memory.

Writes a synthetic target (default: the `bench` preset, about 1.3 GB in BF16) and its
ModelOpt NVFP4 export, then alternates, in one run, a plain read of the source files
with pack builds (each build in a fresh process so its peak RSS is its own):
  - bf16 source, --quantization none  (layout + hashing + validation)
  - bf16 source, --quantization nvfp4 (adds the ModelOpt-exact quantizer)
  - nvfp4 source, --quantization auto (repack only, no arithmetic)
Each is measured with a hot page cache and, where the page cache can be dropped (root
on Linux), a cold one (read and build both from the disk).
Goal (issue 2): build at least half the read speed; peak memory under two shards.

    python -m bench.pack_build [--preset bench] [--repeats 3] [--shard-mb 256] [--work DIR]
Prints a table and writes bench/results/pack_build.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHUNK = 16 << 20


def read_files(paths: list[Path]) -> tuple[float, int]:
    """Seconds to read every byte of `paths` with plain buffered reads."""
    total = 0
    start = time.perf_counter()
    buffer = bytearray(CHUNK)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return time.perf_counter() - start, total


BUILD_CHILD = """
import json, resource, sys, time
from monolith.pack import build_pack
src, out, quantization, shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
start = time.perf_counter()
build_pack(src, out, quantization=quantization, shard_bytes=shard, force=True)
print(json.dumps({"seconds": time.perf_counter() - start,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

BASELINE_CHILD = """
import json, resource
import monolith.pack, mlx.core, numpy
print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run_child(code: str, *args) -> dict:
    result = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def drop_caches() -> bool:
    """Empty the page cache (root on Linux) so reads come from the disk; False if not allowed."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def source_bytes(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "pack_build.json")
    return ap.parse_args()


def write_sources(work: Path, preset: str) -> dict[str, Path]:
    """The BF16 target and its ModelOpt NVFP4 export under `work` (kept from an earlier run)."""
    from monolith.synth import write_target

    sources = {}
    for fmt in ("bf16", "modelopt-nvfp4"):
        path = work / f"src-{fmt}"
        if not path.exists():
            t = time.perf_counter()
            write_target(path, preset=preset, format=fmt, expert_layout="per-expert")
            print(f"wrote {fmt} source in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        sources[fmt] = path
    return sources


def measure(sources: dict[str, Path], work: Path, cases, temperatures, repeats: int, shard: int) -> dict:
    """(case, page cache) -> read and build speeds (bytes/s) and build peak RSS per repeat."""
    rows = {(case, temp): {"read": [], "build": [], "rss": []} for case in cases for temp in temperatures}
    for _ in range(repeats):
        for fmt, quantization in cases:  # alternate read and build of the same source
            files = source_bytes(sources[fmt])
            out = work / f"pack-{fmt}-{quantization}"
            for temp in temperatures:
                row = rows[((fmt, quantization), temp)]
                if temp == "cold":
                    drop_caches()
                else:
                    read_files(files)  # warm the page cache
                seconds, nbytes = read_files(files)
                row["read"].append(nbytes / seconds)
                subprocess.run(["sync"], check=True)  # no writeback of the last build during this one
                if temp == "cold":
                    drop_caches()
                result = run_child(BUILD_CHILD, sources[fmt], out, quantization, shard)
                row["build"].append(nbytes / result["seconds"])
                row["rss"].append(result["peak_rss_bytes"])
                row["bytes"] = nbytes
    return rows


def report_cases(rows: dict, baseline: int, shard: int) -> list[dict]:
    """Print the table; returns one report entry per case (medians, peak RSS, goals)."""
    print(f"{'source':>15} {'quant':>6} {'cache':>5} {'GB':>6} {'read GB/s':>10} {'build GB/s':>11} {'ratio':>6} "
          f"{'peak RSS MB':>12} {'above import':>13} {'in shards':>10}")
    cases = []
    for ((fmt, quantization), temp), r in rows.items():
        read, build, rss = statistics.median(r["read"]), statistics.median(r["build"]), max(r["rss"])
        case = {"source": fmt, "quantization": quantization, "page_cache": temp, "source_bytes": r["bytes"],
                "read_gb_s": read / 1e9, "build_gb_s": build / 1e9, "build_over_read": build / read,
                "peak_rss_bytes": rss, "peak_rss_above_import_bytes": rss - baseline,
                "peak_above_import_in_shards": (rss - baseline) / shard,
                "goal_half_read_speed": build / read >= 0.5, "goal_under_two_shards": (rss - baseline) < 2 * shard}
        cases.append(case)
        print(f"{fmt:>15} {quantization:>6} {temp:>5} {r['bytes'] / 1e9:6.2f} {read / 1e9:10.2f} {build / 1e9:11.3f} "
              f"{build / read:6.2f} {rss / 2**20:12.0f} {(rss - baseline) / 2**20:13.0f} {(rss - baseline) / shard:10.2f}")
    return cases


def main() -> None:
    args = parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="monolith-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    sources = write_sources(work, args.preset)
    cases = [("bf16", "none"), ("bf16", "nvfp4"), ("modelopt-nvfp4", "auto")]
    shard = args.shard_mb << 20
    baseline = run_child(BASELINE_CHILD)["peak_rss_bytes"]
    cold = drop_caches()
    temperatures = ("hot", "cold") if cold else ("hot",)
    rows = measure(sources, work, cases, temperatures, args.repeats, shard)

    report = {"machine": platform.platform(), "python": platform.python_version(), "preset": args.preset,
              "shard_bytes": shard, "import_baseline_rss_bytes": baseline, "repeats": args.repeats,
              "cold_cache_measured": cold, "cases": report_cases(rows, baseline, shard)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
