"""How many monolith modules one chat completion passes through, from the HTTP handler
to the state commit, and how many distinct calls cross a module boundary on the way
(issue 14's and issue 31's before/after counts), with and without drafting; and the
lines of runtime/.

    python -m bench.archive.call_graph [--json FILE]    # FILE: bench/archive/results/call_graph.json by default

Builds a tiny synthetic target + DSpark pair, loads it the way `serve` does (drafting
forced with --spec-sched fixed so that every round verifies and commits; then without
the draft), then traces one POST /v1/chat/completions with sys.setprofile on every
thread. For each it reports the monolith modules entered, the distinct cross-module
calls (a distinct (caller module, callee module.function) pair, both in monolith), and
the models -> runtime calls among them (a lower layer calling up: there should be none);
the JSON adds the module names and the edges.

Archived, a finished study: issue 14's and issue 31's before/after counts are recorded in
bench/archive/results/call_graph.json. That file is stale: it names the modules and calls
of the code it measured then (monolith.models.qwen3_5 has been split since, and modules
renamed), and nothing reruns it; read it as the record of that time, not of the code now.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _engine(tmp: Path, drafting: bool):
    from monolith import engine_setup
    from monolith.serve import build_parser
    from monolith.synth import write_pair

    if not (tmp / "pair").exists():
        write_pair(tmp / "pair", seed=3)
    argv = ["--model", str(tmp / "pair" / "target"), "--max-context", "256", "--no-warmup"]
    if drafting:
        argv += ["--draft", str(tmp / "pair" / "draft"), "--spec-sched", "fixed"]
    args = build_parser().parse_args(argv)
    return engine_setup.load_engine(args, engine_setup.plan_model(args), lambda m: None)


EDGES: set[tuple[str, str]] = set()
MODULES: set[str] = set()
TRACING = threading.Event()


def profile(frame, event, arg):
    """Installed for every thread before the engine's and the app's threads start;
    counts only while TRACING is set."""
    if event != "call" or not TRACING.is_set():
        return
    callee = frame.f_globals.get("__name__", "")
    caller_frame = frame.f_back
    if not callee.startswith("monolith.") or caller_frame is None:
        return
    caller = caller_frame.f_globals.get("__name__", "")
    MODULES.add(callee)
    if caller.startswith("monolith.") and caller != callee:
        EDGES.add((caller, f"{callee}.{frame.f_code.co_qualname}"))


def trace_request(engine) -> dict:
    from starlette.testclient import TestClient

    from monolith.serving.app import ServerConfig, create_app

    app = create_app(lambda: engine, ServerConfig(("m",), None, 1 << 20), lambda e: None)
    edges, modules = EDGES, MODULES
    EDGES.clear()
    MODULES.clear()

    with TestClient(app, base_url="http://127.0.0.1") as client:  # a loopback Host, as a local client sends
        client.get("/health")
        body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 24,
                "temperature": 0}
        client.post("/v1/chat/completions", json=body)  # warm: imports and kernels
        TRACING.set()
        try:
            reply = client.post("/v1/chat/completions", json=body)
        finally:
            TRACING.clear()
    reply.raise_for_status()

    def layer(name: str) -> str:
        return name.split(".")[1]

    flips = sorted(e for e in edges if layer(e[0]) == "models" and layer(e[1]) == "runtime")
    return {
        "modules": len(modules),
        "cross_module_calls": len(edges),
        "models_to_runtime_calls": len(flips),
        "module_names": sorted(modules),
        "edges": sorted(f"{a} -> {b}" for a, b in edges),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "archive" / "results" / "call_graph.json")
    args = ap.parse_args()
    threading.setprofile(profile)  # before the engine's worker and the app's thread start
    sys.setprofile(profile)
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, drafting in (("speculative", True), ("plain", False)):
            engine = _engine(Path(tmp), drafting)
            try:
                report[name] = trace_request(engine)
            finally:
                engine.close()
    runtime = sorted((ROOT / "monolith" / "runtime").glob("*.py"))
    report["runtime_lines"] = sum(len(p.read_text().splitlines()) for p in runtime)
    report["runtime_files"] = len(runtime)
    for name in ("speculative", "plain"):
        print(f"{name}: modules entered {report[name]['modules']}, distinct cross-module calls "
              f"{report[name]['cross_module_calls']}, models -> runtime calls {report[name]['models_to_runtime_calls']}")
    print(f"runtime/: {report['runtime_lines']} lines in {report['runtime_files']} files")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
