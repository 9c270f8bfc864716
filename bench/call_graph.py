"""How coupled the code a request runs through is (issue 49's "Done when"): one
speculative and one plain chat completion traced from the HTTP handler to the state
commit, and counts read from the source.

    python -m bench.call_graph [--out-dir DIR] [--name NAME]    # DIR: bench/results

Builds a tiny synthetic target + DSpark pair, loads it the way `serve` does (drafting
forced with --spec-sched fixed so that every round verifies and commits; then without
the draft), then traces one POST /v1/chat/completions with sys.setprofile on every
thread. For each it reports the monolith modules entered, the distinct cross-module
calls (a distinct (caller module, callee module.function) pair, both in monolith), the
module pairs that call each other both ways (a callee calling back into its caller's
module: a callback that runs back up), and the models -> runtime calls among them (a
lower layer calling up: there should be none). From the source: the functions of
monolith/runtime/ and monolith/serving/ that take 9 or more parameters (self counted),
the getattr/hasattr calls in monolith/, and serving/'s top-level modules and API
packages. The JSON adds the module names, the edges and the functions.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import RESULTS, ROOT, machine, write

PACKAGE = ROOT / "monolith"
MANY_PARAMETERS = 9


def _engine(tmp: Path, drafting: bool):
    from monolith import engine_setup, model_flags
    from monolith.serve import build_parser
    from monolith.synth import write_pair

    if not (tmp / "pair").exists():
        write_pair(tmp / "pair", seed=3)
    argv = ["--model", str(tmp / "pair" / "target"), "--max-context", "256", "--no-warmup"]
    if drafting:
        argv += ["--draft", str(tmp / "pair" / "draft"), "--spec-sched", "fixed"]
    args = build_parser().parse_args(argv)
    return engine_setup.load_engine(args, model_flags.plan_model(args), lambda m: None)


EDGES: set[tuple[str, str]] = set()
MODULES: set[str] = set()
TRACING = threading.Event()
GAUGES = ("keep_gauges",)  # serving/app.py's periodic sampler of the gauges (the metrics page's history)


def profile(frame, event, arg):
    """Installed for every thread before the engine's and the app's threads start;
    counts only while TRACING is set, and not the app's gauge sampler (GAUGES), which
    runs every few seconds whatever the requests and lands in the window by chance."""
    if event != "call" or not TRACING.is_set():
        return
    callee = frame.f_globals.get("__name__", "")
    caller_frame = frame.f_back
    if not callee.startswith("monolith.") or caller_frame is None:
        return
    outer = caller_frame
    while outer is not None:
        if outer.f_code.co_name in GAUGES:
            return
        outer = outer.f_back
    caller = caller_frame.f_globals.get("__name__", "")
    MODULES.add(callee)
    if caller.startswith("monolith.") and caller != callee:
        EDGES.add((caller, f"{callee}.{frame.f_code.co_qualname}"))


def callee_module(target: str, modules: set[str]) -> str:
    """The module of a traced callee `module.qualname`: its longest prefix that is a module."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return target.rsplit(".", 1)[0]


def trace_request(engine) -> dict:
    from starlette.testclient import TestClient

    from monolith.serving.app import ServerConfig, create_app

    app = create_app(lambda: engine, ServerConfig(("m",), None, 1 << 20), lambda e: None)
    EDGES.clear()
    MODULES.clear()

    with TestClient(app, base_url="http://127.0.0.1") as client:  # a loopback Host, as a local client sends
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:  # the app loads the engine on a thread: 503 until then
            if time.monotonic() > deadline:
                raise RuntimeError("the app did not become healthy in 60 s")
            time.sleep(0.01)
        body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 24,
                "temperature": 0}
        client.post("/v1/chat/completions", json=body)  # warm: imports and kernels
        while engine.busy:  # its job ends on the worker just after its reply: then the traced one resumes it
            time.sleep(0.01)
        TRACING.set()
        try:
            reply = client.post("/v1/chat/completions", json=body)
        finally:
            TRACING.clear()
    reply.raise_for_status()
    edges, modules = set(EDGES), set(MODULES)
    module_edges = {(a, callee_module(b, modules)) for a, b in edges}
    pairs = sorted(f"{a} <-> {b}" for a, b in module_edges if a < b and (b, a) in module_edges)

    def layer(name: str) -> str:
        return name.split(".")[1]

    flips = sorted(e for e in edges if layer(e[0]) == "models" and layer(e[1]) == "runtime")
    return {
        "modules": len(modules),
        "cross_module_calls": len(edges),
        "both_ways_pairs": len(pairs),
        "models_to_runtime_calls": len(flips),
        "pair_names": pairs,
        "module_names": sorted(modules),
        "edges": sorted(f"{a} -> {b}" for a, b in edges),
    }


def many_parameters(folders=("runtime", "serving")) -> list[str]:
    """Functions under monolith/FOLDER that take MANY_PARAMETERS or more (self, *args and
    **kwargs counted), as 'path:line name (count)'."""
    found = []
    for folder in folders:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                a = node.args
                count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) \
                    + (a.kwarg is not None)
                if count >= MANY_PARAMETERS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({count})")
    return found


def attribute_probes() -> list[str]:
    """The getattr/hasattr calls in monolith/, as 'path:line'."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}")
    return found


def serving_layout() -> dict:
    serving = PACKAGE / "serving"
    return {"top_level_modules": sorted(p.name for p in serving.glob("*.py") if p.name != "__init__.py"),
            "api_packages": sorted(p.parent.name for p in serving.glob("*/__init__.py"))}


def table(report: dict) -> str:
    rows = ["| | speculative | plain |", "|---|---|---|"]
    for key, label in (("modules", "modules entered"), ("cross_module_calls", "distinct cross-module calls"),
                       ("both_ways_pairs", "module pairs calling both ways"),
                       ("models_to_runtime_calls", "models -> runtime calls")):
        rows.append(f"| {label} | {report['speculative'][key]} | {report['plain'][key]} |")
    serving = report["serving"]
    rows += ["", "| from the source | count |", "|---|---|",
             f"| functions with >= {MANY_PARAMETERS} parameters in runtime/ and serving/ "
             f"| {len(report['many_parameters'])} |",
             f"| getattr/hasattr calls in monolith/ | {len(report['attribute_probes'])} |",
             f"| serving/ top-level modules | {len(serving['top_level_modules'])} |",
             f"| serving/ API packages | {len(serving['api_packages'])} |"]
    for name in ("speculative", "plain"):
        if report[name]["pair_names"]:
            rows += ["", f"{name}: both ways: " + ", ".join(report[name]["pair_names"])]
    if report["many_parameters"]:
        rows += ["", "many parameters: " + ", ".join(report["many_parameters"])]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="call_graph", help="the results' file name (NAME.json and NAME.md)")
    args = ap.parse_args()
    threading.setprofile(profile)  # before the engine's worker and the app's thread start
    sys.setprofile(profile)
    report: dict = {"notes": ["one POST /v1/chat/completions on the synthetic pair (max_tokens 24, "
                              "temperature 0), traced after a warm-up request", f"commit {machine()['commit']}"]}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, drafting in (("speculative", True), ("plain", False)):
                engine = _engine(Path(tmp), drafting)
                try:
                    report[name] = trace_request(engine)
                finally:
                    engine.close()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    report["many_parameters"] = many_parameters()
    report["attribute_probes"] = attribute_probes()
    report["serving"] = serving_layout()
    text = table(report)
    print(text)
    write(report, args.name, text, args.out_dir)


if __name__ == "__main__":
    main()
