"""Every live bench script runs at its smallest setting, so none can rot: each in a
subprocess (`python -m bench.NAME`, as docs/performance.md says to run them) with its
output in tmp_path, exit status 0, the JSON it says it writes. Nothing may land in
bench/results, and the caches are the session's private ones (tests/conftest.py) or
tmp_path. Every committed result in bench/results belongs to a live script, and that
script's smallest run writes JSON of the same structure (the same top-level keys, the
same keys in its rows), so a result no current script could write is caught. Also: no
script edits sys.path, and bench's imports have no cycle. Finished studies live in
bench/archive/ with their results; nothing here runs them."""

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
RESULTS = BENCH / "results"

# run: (arguments, the files it writes under OUT); OUT is the test's output directory. A
# run is its script's name, or the name and the flag of another mode of the script.
RUNS = {
    "accelerator": (["--preset", "tiny", "--layers", "4", "--contexts", "16", "--prefill", "16", "--batches", "1,2",
                     "--batch-prompt", "8", "--decode-tokens", "2", "--batch-tokens", "2", "--repeats", "1",
                     "--no-mlx-lm", "--work", "OUT/work", "--out-dir", "OUT"], ["accelerator.json", "accelerator.md"]),
    "accuracy": (["--items", "2", "--ppl-docs", "1", "--ppl-chars", "200", "--max-context", "1024",
                  "--work", "OUT/work", "--out-dir", "OUT"], ["accuracy.json", "accuracy.md"]),
    "acceptance": (["--prompts", "1", "--max-tokens", "2", "--json", "OUT/r.json"], ["r.json"]),
    "agent_session": (["--prefixes", "64", "--turns", "2", "--new-tokens", "16", "--max-tokens", "2", "--edit-turn",
                       "2", "--decode-tokens", "2", "--servers", "monolith", "--server-arg=--no-warmup", "--out-dir", "OUT"],
                      ["agent_session.json", "agent_session.md"]),
    "batch_forward": (["--batches", "2", "--context", "16", "--repeats", "1", "--json", "OUT/r.json"], ["r.json"]),
    "calibration": (["--out", "OUT/r.json"], ["r.json"]),
    "call_graph": (["--out-dir", "OUT"], ["call_graph.json", "call_graph.md"]),
    "concurrency": (["--modes", "plain", "--clients", "1", "--requests", "1", "--max-tokens", "2", "--repeat", "1",
                     "--server-arg=--no-warmup", "--out-dir", "OUT"], ["concurrency.json", "concurrency.md"]),
    "concurrency --soak": (["1", "--modes", "plain", "--soak-max-tokens", "8", "--server-arg=--no-warmup",
                            "--out-dir", "OUT"], ["concurrency_soak.json", "concurrency_soak.md"]),
    "demo": (["--count", "3", "--max-tokens", "4", "--json", "OUT/r.json"], ["r.json"]),
    "distributed": (["--max-tokens", "4", "--repeats", "1", "--out-dir", "OUT"], ["distributed.json"]),
    "fuzz": (["--requests", "20", "--clients", "1", "--waves", "0", "--port", "0",
              "--out-dir", "OUT"], ["fuzz.json", "fuzz.md"]),
    "kv_quant": (["--models", "demo", "--contexts", "64", "--tokens", "4", "--prefill-tokens", "16", "--bits", "8",
                  "--out-dir", "OUT"], ["kv_quant.json", "kv_quant.md"]),
    "launch_turn": (["--fake-client", "--serve-arg=--no-warmup", "--serve-arg=--max-context=2048", "--work", "OUT/work",
                     "--out-dir", "OUT"], ["launch_turn.json", "launch_turn.md"]),
    "mlx_lm_checkpoint": (["--out", "OUT/ckpt"], ["ckpt/config.json"]),
    "openresponses_suite": (["--filter", "compact-missing-model,response-output-phase-schema,"
                             "websocket-previous-response-not-found", "--out-dir", "OUT"],
                            ["openresponses_suite.json", "openresponses_suite.md"]),
    "pack_build": (["--preset", "tiny", "--repeats", "1", "--work", "OUT/work", "--json", "OUT/r.json"], ["r.json"]),
    "primitives": (["--context", "16", "--out", "OUT/r.json"], ["r.json"]),
    "prompt_cache": (["--runs", "warm", "--variants", "plain", "--turns", "1", "--system-tokens", "16", "--tools", "1",
                      "--max-tokens", "2", "--json", "OUT/r.json"], ["r.json"]),
    "real_widths": (["--preset", "tiny", "--layers", "1", "--prompt-tokens", "8", "--max-tokens", "2",
                     "--pairs", "nvidia-35b:lithos-dspark", "--work", "OUT/work", "--json", "OUT/r.json"], ["r.json"]),
    "request_parse": (["--iterations", "20", "--repeats", "1", "--out-dir", "OUT"],
                      ["request_parse.json", "request_parse.md"]),
    "round_latency": (["--contexts", "16", "--repeats", "1", "--json", "OUT/r.json"], ["r.json"]),
    "schema_fuzz": (["--requests", "14", "--clients", "1", "--port", "0", "--out-dir", "OUT"],
                    ["schema_fuzz.json", "schema_fuzz.md"]),
    "serve_latency": (["--preset", "tiny", "--prompt-lengths", "16", "--max-tokens", "8", "--repeats", "1",
                       "--out", "OUT/r.json"], ["r.json"]),
    "spec_throughput": (["--prompts", "1", "--prompt-tokens", "16", "--max-tokens", "8", "--repeats", "1",
                         "--sched", "fixed", "--json", "OUT/r.json"], ["r.json"]),
    "target_forward": (["--contexts", "16", "--repeats", "1", "--decode-tokens", "2", "--rounds", "1",
                        "--json", "OUT/r.json"], ["r.json"]),
    "vision": (["--image", "64x64", "--real-image", "64x64", "--repeats", "1", "--out-dir", "OUT"],
               ["vision.json", "vision.md"]),
    "waiting_guide": (["--prompts", "1", "--max-tokens", "4", "--repeats", "1", "--out-dir", "OUT"],
                      ["waiting_guide.json", "waiting_guide.md"]),
}

# scripts with a condition of their own
NEEDS = {"target_forward": "mlx_lm",  # compares with mlx-lm's decode (the [bench] extra)
         "calibration": "mlx_lm"}  # builds mlx-lm's own models to count their primitives

# scripts that run a suite from a checkout outside this repository, named by an environment
# variable, with the runtime tests/clients/install.sh installs where that variable is set
CHECKOUTS = {"openresponses_suite": ("OPENRESPONSES_CHECKOUT", "tests/clients/openresponses/node_modules/.bin/bun")}

# committed results named otherwise than their run (bench/results/NAME.json and .md): the
# script run with other flags wrote them, and the run here writes the same structure
RESULT_RUNS = {
    "call_graph_before": "call_graph",  # --name call_graph_before, at the commit its notes name (issue 49's before)
    "concurrency_plain_5_lists": "concurrency",  # --modes plain --clients 1,4 --repeat 5, the files renamed
    "concurrency_soak": "concurrency --soak",  # the name --soak writes
    "distributed_mlx_launch": "distributed",  # the name --launcher mlx writes
    "fuzz_no_prompt_cache": "fuzz",  # --server-arg=--prompt-cache-size=0 --out fuzz_no_prompt_cache
    "fuzz_waves_prompt_cache_256M": "fuzz",  # --server-arg=--prompt-cache-size=256M --out ...
    "kv_quant_bfloat16": "kv_quant",  # the name --dtype bfloat16 writes
}

# top-level keys a committed result has that the run here leaves out: what only a larger
# setting writes (each a section of its own, not a renamed one)
SECTIONS = {
    "concurrency": {"spec_vs_plain_mismatches"},  # both modes (--modes plain,speculative)
    "prompt_cache": {"cold", "restart", "memory", "sweep", "mlx_lm"},  # the other --runs (minutes: a server each)
}


def modules() -> dict[str, Path]:
    """bench's modules by dotted name (bench.common, bench.archive.break_even, ...)."""
    found = {}
    for path in BENCH.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def live_scripts() -> list[str]:
    """Top-level bench modules that run as a script (they have a __main__ block)."""
    return sorted(p.stem for p in BENCH.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_every_live_script_is_run():
    assert set(live_scripts()) == {run.split()[0] for run in RUNS}


def committed(run: str) -> list[Path]:
    """The committed JSON results of a run (bench/results/NAME.json)."""
    return sorted(p for p in RESULTS.glob("*.json") if RESULT_RUNS.get(p.stem, p.stem) == run)


def test_every_committed_result_belongs_to_a_live_run():
    for path in sorted(RESULTS.iterdir()):
        assert path.suffix in (".json", ".md"), f"{path.relative_to(REPO)}: results are .json (and .md beside it)"
        assert path.with_suffix(".json").is_file(), f"{path.relative_to(REPO)} has no JSON beside it"
        run = RESULT_RUNS.get(path.stem, path.stem)
        assert run in RUNS, (f"{path.relative_to(REPO)}: no live script writes it (a finished study's result "
                             "belongs in bench/archive/results; a variant's run is named in RESULT_RUNS)")
    for run in SECTIONS:
        assert committed(run), f"SECTIONS names {run}, which has no committed result"


def structure(report: dict) -> dict[str, list[str] | None]:
    """A result's top-level keys, each with the keys its records use where it is a list
    of records (rows), else None."""
    return {key: sorted({k for row in value for k in row})
            if isinstance(value, list) and value and all(isinstance(row, dict) for row in value) else None
            for key, value in report.items()}


def same_structure(path: Path, run: str, fresh: dict) -> None:
    """A committed result has the structure of what the run wrote now, but for the
    sections only a larger setting writes (SECTIONS)."""
    old, new = structure(json.loads(path.read_text())), structure(fresh)
    name = path.relative_to(REPO)
    missing, unknown = sorted(set(new) - set(old)), sorted(set(old) - set(new) - SECTIONS.get(run, set()))
    assert not missing and not unknown, (f"{name} is not what `python -m bench.{run}` writes now: "
                                         + "; ".join(([f"it lacks {missing}"] if missing else [])
                                                     + ([f"the script writes no {unknown}"] if unknown else []))
                                         + " (regenerate it or archive it)")
    for key in set(old) & set(new):
        if old[key] is not None and new[key] is not None:
            assert old[key] == new[key], (f"{name}: the rows of {key!r} have keys {old[key]}, the script's rows "
                                          f"{new[key]} (regenerate it or archive it)")


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


@pytest.mark.parametrize("run", sorted(RUNS))
def test_bench_script_runs_at_its_smallest_setting(run, tmp_path):
    name = run.split()[0]
    if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
        pytest.skip(f"{name} compares with {NEEDS[name]}, which is not installed (the [bench] extra)")
    if name in CHECKOUTS:
        variable, runtime = CHECKOUTS[name]
        if not os.environ.get(variable):
            pytest.skip(f"{name} runs a suite from the checkout ${variable} names, and it names none")
        if not (REPO / runtime).exists():
            pytest.skip(f"{name}'s runtime is not installed ({runtime}: sh tests/clients/install.sh "
                        f"with ${variable} set)")
    args, outputs = RUNS[run]
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "1"}  # MONOLITH_CACHE: the session's private one
    before = results_listing()
    argv = [a.replace("OUT", str(out)) for a in run.split()[1:] + args]
    done = subprocess.run([sys.executable, "-m", f"bench.{name}", *argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    written = {}
    for file in outputs:
        path = out / file
        assert path.is_file(), f"{run} did not write {file}: {done.stdout[-2000:]}"
        if file.endswith(".json"):
            written[file] = json.loads(path.read_text())
            assert written[file], f"{run} wrote an empty {file}"
    assert results_listing() == before, f"{run} wrote into bench/results"
    report = next(iter(written.values()))
    for path in committed(run):
        same_structure(path, run, report)
