"""A coding agent's first turns through `launch`, as a new user meets them: `python -m
monolith.launch claude -- -p "say hi"` on the bundled demo pair, cold (an empty pack cache:
the demo packs are built and checked, the server loads and measures, Claude Code sends its
stock prompt, the reply comes, the server stops) and then warm (the same command again:
the packs are found). Each run is timed in three parts from launch's own lines: to the
server's readiness, the client's turn, and the stop. The BLAS the server ran with comes
from its log's `BLAS:` line (monolith/blas.py: OpenBLAS by default where installed;
`--blas bundled` runs with MONOLITH_OPENBLAS=0).

    python -m bench.launch_turn [--client-bin PATH] [--blas openblas,bundled] [--repeats 1]
        [--prompt "say hi"] [--serve-arg=--max-context=32768] [--out-dir bench/results]

Claude Code is the pinned one `sh tests/clients/install.sh` installs (tests/clients/
node_modules/.bin/claude); it runs with a private HOME under --work. `--fake-client`
runs a small Python client instead (one Anthropic request of 2 tokens: the smallest
setting tests/test_bench_scripts.py runs). Writes launch_turn.json and .md."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import ROOT, free_port, machine, machine_note, write

CLAUDE = ROOT / "tests" / "clients" / "node_modules" / ".bin" / "claude"
FAKE_CLIENT = '''#!{python}
import json, os, sys, urllib.request
body = {{"model": os.environ["ANTHROPIC_MODEL"], "max_tokens": 2,
        "messages": [{{"role": "user", "content": sys.argv[-1]}}]}}
request = urllib.request.Request(os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages", json.dumps(body).encode(),
                                 {{"content-type": "application/json",
                                   "authorization": "Bearer " + os.environ["ANTHROPIC_AUTH_TOKEN"]}})
print("".join(block.get("text", "") for block in json.load(urllib.request.urlopen(request, timeout=600))["content"]))
'''


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.launch_turn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--client-bin", help=f"Claude Code's executable (default {CLAUDE.relative_to(ROOT)})")
    ap.add_argument("--fake-client", action="store_true", help="a Python client making one 2-token request")
    ap.add_argument("--prompt", default="say hi")
    ap.add_argument("--blas", default="openblas", help="comma-separated: openblas (the default) and/or bundled")
    ap.add_argument("--repeats", type=int, default=1, help="cold-then-warm pairs per BLAS")
    ap.add_argument("--serve-arg", action="append", default=[], help="a serve flag for launch (repeatable)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one launch may take")
    ap.add_argument("--work", default=None, help="the caches and the client's HOME (default: a temporary directory)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return ap.parse_args(argv)


def client_binary(args, work: Path) -> Path:
    if args.fake_client:
        path = work / "bin" / "claude"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(FAKE_CLIENT.format(python=sys.executable))
        path.chmod(0o755)
        return path
    path = Path(args.client_bin) if args.client_bin else CLAUDE
    if not path.exists():
        raise SystemExit(f"no Claude Code at {path}: run sh tests/clients/install.sh, or give --client-bin")
    return path


def private_env(home: Path, blas: str) -> dict:
    """The environment of one run: HOME, XDG dirs and the caches under `home`, offline, no
    BLAS preloaded from outside (serve picks it, or keeps the bundled one with `bundled`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")}
    for name, sub in (("HOME", "."), ("XDG_CONFIG_HOME", ".config"), ("XDG_CACHE_HOME", ".cache"),
                      ("XDG_DATA_HOME", ".local/share"), ("XDG_STATE_HOME", ".local/state"), ("HF_HOME", "hf"),
                      ("MONOLITH_CACHE", "monolith")):
        (home / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(home / sub)
    env.update(HF_HUB_OFFLINE="1", NO_COLOR="1", DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1",
               DISABLE_ERROR_REPORTING="1", CLAUDE_CODE_MAX_OUTPUT_TOKENS="256",
               # this checkout's monolith, whatever the client's working directory (its HOME)
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if blas == "bundled":
        env["MONOLITH_OPENBLAS"] = "0"
    return env


def run_launch(args, binary: Path, env: dict, cwd: Path) -> dict:
    """One `launch claude -- -p PROMPT`, its stderr lines timed as they come."""
    port = free_port()
    argv = [sys.executable, "-m", "monolith.launch", "claude", "--port", str(port), "--client-bin", str(binary),
            "--log-level", "info", *args.serve_arg, "--", "-p", args.prompt]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace")
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.perf_counter() - started, line.rstrip())
                                                          for line in proc.stderr), daemon=True)
    reader.start()
    try:
        out = proc.stdout.read()
        proc.wait(args.timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    total = time.perf_counter() - started
    at = {what: next((t for t, line in lines if mark in line), None) for what, mark in
          (("ready", "the server is ready; running"), ("stopped", "stopped the server"))}
    text = "\n".join(line for _, line in lines)
    blas = re.search(r"BLAS: (OpenBLAS \([^,]+|MLX's bundled reference BLAS)", text)
    load = re.search(r"ready in ([\d.]+) s", text)
    return {"exit_status": proc.returncode, "total_s": round(total, 2),
            "to_ready_s": None if at["ready"] is None else round(at["ready"], 2),
            "turn_s": None if None in at.values() else round(at["stopped"] - at["ready"], 2),
            "server_load_s": float(load.group(1)) if load else None,
            "packs_built": "built the demo" in text, "blas": blas.group(1).rstrip(" (") if blas else None,
            "reply": out.strip()[:200]}


def table(rows: list[dict]) -> str:
    head = "| BLAS | run | to ready (s) | server load (s) | turn (s) | total (s) | packs built | exit |\n" \
           "|---|---|---|---|---|---|---|---|\n"
    return head + "".join(f"| {r['blas_asked']} | {r['run']} | {r['to_ready_s']} | {r['server_load_s']} | "
                          f"{r['turn_s']} | {r['total_s']} | {r['packs_built']} | {r['exit_status']} |\n"
                          for r in rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work) if args.work else Path(os.environ.get("TMPDIR", "/tmp")) / f"launch_turn-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    binary, rows = client_binary(args, work), []
    try:
        for blas in args.blas.split(","):
            for repeat in range(args.repeats):
                home = work / f"home-{blas}-{repeat}"
                shutil.rmtree(home, ignore_errors=True)  # cold: an empty pack cache and a new client home
                env = private_env(home, blas)
                for run in ("cold", "warm"):
                    row = {"blas_asked": blas, "run": run, "repeat": repeat, **run_launch(args, binary, env, home)}
                    print(table([row]).splitlines()[-1], flush=True)
                    rows.append(row)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    m = machine() | {"blas": "per run (rows' blas)", "openblas_threads": "1 (serve's default)"}
    client = "a fake Python client (2 tokens)" if args.fake_client else f"Claude Code ({binary.name})"
    report = {"machine": m, "client": client, "prompt": args.prompt, "serve_args": args.serve_arg,
              "notes": [machine_note(m), f"`python -m monolith.launch claude -- -p {args.prompt!r}` on the demo pair "
                        f"with {client}; cold: an empty pack cache, warm: the same command again",
                        "the client gets CLAUDE_CODE_MAX_OUTPUT_TOKENS=256: the demo model rambles, and Claude Code "
                        "ends a reply cut there with an error (exit 1), after the whole turn ran",
                        "to ready: launch's start to the server's readiness; turn: the client's run; total: the "
                        "whole command, the server's stop included"],
              "rows": rows}
    write(report, "launch_turn", table(rows), Path(args.out_dir))
    return 0 if all(r["exit_status"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
