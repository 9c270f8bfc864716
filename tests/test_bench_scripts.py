"""Every live bench script runs at its smallest setting, so none can rot: each in a
subprocess (`python -m bench.NAME`, as docs/performance.md says to run them) with its
output in tmp_path, exit status 0, the JSON it says it writes. Nothing may land in
bench/results, and the caches are the session's private ones (tests/conftest.py) or
tmp_path. Also: no script edits sys.path, and bench's imports have no cycle."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"

# name: (arguments, the files it writes under OUT); OUT is the test's output directory
RUNS = {
    "batch_forward": (["--batches", "2", "--context", "16", "--repeats", "1", "--json", "OUT/r.json"], ["r.json"]),
    "cpu_ops": (["--repeats", "1", "--out", "OUT"], ["cpu_ops.json", "cpu_ops.md"]),
    "distributed": (["--max-tokens", "4", "--repeats", "1", "--out-dir", "OUT"], ["distributed.json"]),
    "fuzz": (["--requests", "20", "--clients", "1", "--waves", "0", "--port", "0",
              "--out-dir", "OUT"], ["fuzz.json", "fuzz.md"]),
    "layer_pipelining": (["--batches", "1", "--prompt-tokens", "16", "--max-tokens", "8", "--repeats", "1",
                          "--out", "OUT"], ["layer_pipelining.json", "layer_pipelining.md"]),
    "pack_build": (["--preset", "tiny", "--repeats", "1", "--work", "OUT/work", "--json", "OUT/r.json"], ["r.json"]),
    "primitives": (["--context", "16", "--out", "OUT/r.json"], ["r.json"]),
    "real_widths": (["--preset", "tiny", "--layers", "1", "--prompt-tokens", "8", "--max-tokens", "2",
                     "--pairs", "nvidia-35b:lithos-dspark", "--work", "OUT/work", "--json", "OUT/r.json"], ["r.json"]),
    "round_latency": (["--contexts", "16", "--repeats", "1", "--json", "OUT/r.json"], ["r.json"]),
    "serve_latency": (["--preset", "tiny", "--prompt-lengths", "16", "--max-tokens", "8", "--repeats", "1",
                       "--out", "OUT/r.json"], ["r.json"]),
    "spec_throughput": (["--prompts", "1", "--prompt-tokens", "16", "--max-tokens", "8", "--repeats", "1",
                         "--sched", "fixed", "--json", "OUT/r.json"], ["r.json"]),
    "target_forward": (["--contexts", "16", "--repeats", "1", "--decode-tokens", "2", "--rounds", "1",
                        "--json", "OUT/r.json"], ["r.json"]),
    "warm_cold": (["--cases", "1", "--modes", "plain", "--max-tokens", "2", "--out-dir", "OUT"],
                  ["warm_cold.json", "warm_cold.md"]),
}
ENV = {"warm_cold": {"PYTHONPATH": "tests"}}  # its harness is tests/test_warm_cold.py's

# scripts that cannot run in a few seconds even at their smallest setting
SKIPS = {
    "acceptance": "packs and loads the demo pair with both drafts: ~25 s at --prompts 1 --max-tokens 4",
    "claude_code_prefix": "starts servers and prefills a Claude Code prefix: ~40 s at --prefix-tokens 600",
    "concurrency": "a sequential and a batched server: ~13 s at one plain request (--quick: ~2 minutes)",
    "grammar_engines": "trains a 248,320-id BPE vocabulary first (bench/vocabulary.py; minutes)",
    "prompt_cache": "starts a server per run and replays whole agent conversations (minutes)",
    "structured": "trains a 248,320-id BPE vocabulary first (bench/vocabulary.py; minutes)",
}

# scripts with a condition of their own
NEEDS = {"target_forward": "mlx_lm"}  # compares with mlx-lm's decode (the [bench] extra)


def modules() -> dict[str, Path]:
    """bench's modules by dotted name (bench.common, bench.archive.call_graph, ...)."""
    found = {}
    for path in BENCH.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def live_scripts() -> list[str]:
    """Top-level bench modules that run as a script (they have a __main__ block)."""
    return sorted(p.stem for p in BENCH.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_every_live_script_is_run_or_skipped_with_a_reason():
    assert set(live_scripts()) == set(RUNS) | set(SKIPS)
    assert not set(RUNS) & set(SKIPS)


def test_no_script_edits_sys_path_and_no_import_cycle():
    mods = modules()
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        edits = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"
                 and isinstance(n.value, ast.Name) and n.value.id == "sys"]
        assert not edits, f"{path.relative_to(REPO)} edits sys.path (lines {edits})"
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = sorted(deps & set(mods))
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, f"import cycle: {' -> '.join(path[path.index(name):] + [name])}"
        if name not in done:
            for dep in graph[name]:
                visit(dep, path + [name])
            done.add(name)

    for name in graph:
        visit(name, [])


def results_listing() -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(BENCH)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in BENCH.rglob("results/*") if p.is_file()}


@pytest.mark.parametrize("name", live_scripts())
def test_bench_script_runs_at_its_smallest_setting(name, tmp_path):
    if name in SKIPS:
        pytest.skip(SKIPS[name])
    if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
        pytest.skip(f"needs {NEEDS[name]}")
    args, outputs = RUNS[name]
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "1", **ENV.get(name, {})}  # MONOLITH_CACHE: the session's private one
    before = results_listing()
    run = subprocess.run([sys.executable, "-m", f"bench.{name}", *(a.replace("OUT", str(out)) for a in args)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    for file in outputs:
        written = out / file
        assert written.is_file(), f"{name} did not write {file}: {run.stdout[-2000:]}"
        if file.endswith(".json"):
            assert json.loads(written.read_text()), f"{name} wrote an empty {file}"
    assert results_listing() == before, f"{name} wrote into bench/results"
