"""Pipeline parallel on loopback (issue 19): `generate --json` in one process against the
same under `mlx.launch -n R --backend ring ... --distributed`, plain and speculative, on
the demo pair (or --model / --draft).

Reported per mode: ms per decode step (plain) or per verify round (speculative), the
R-rank / 1-rank ratio, whether the tokens are equal, and the bytes exchanged per forward:
rank 0's, counted by the pipeline (runtime/pipeline.py, `traffic()`: command frames and
the residual stream it sends; what it receives: the stream and the taps from the last
rank, besides the ranks' start-up), and the whole ring's, from the protocol: R hops of
rows x hidden x dtype bytes and each frame relayed by R - 1 ranks (the cache commands of a
round ride in the next forward's frame), taps aside (the demo draft taps rank 1's layers:
they ride back with the stream, in rank 1's bytes). Then a projection for the 35B-A3B at 2 ranks
over Thunderbolt 5 (assumptions printed with it). Medians of --repeats runs, each pair
(one process, R ranks) run back to back. Prints a table and writes
bench/results/distributed.json and .md (--out-dir for another directory).

    python -m bench.distributed [--ranks 2] [--max-tokens 64] [--repeats 3] [--model M --draft D]

Run with LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 for
bench/results (docs/performance.md); both the ranks share this machine's two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"

# Thunderbolt 5: 80 Gb/s each way (Intel/USB-IF Thunderbolt 5 and USB4 v2 specification);
# a TCP round over a Thunderbolt bridge pays tens of microseconds per message (MLX's
# distributed docs recommend the ring backend over Thunderbolt for this reason). Assumed:
TB5_BYTES_PER_S = 80e9 / 8
TB5_MESSAGE_S = 50e-6
QWEN36_35B = {"hidden": 2048, "dtype_bytes": 2, "layers": 40}


def run(command: list[str], env: dict) -> dict:
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or len(lines) != 1:
        raise SystemExit(f"failed: {' '.join(command)}\n{done.stderr[-2000:]}")
    return json.loads(lines[0])


def run_ranks(command: list[str], env: dict, ranks: int, launch: str, launcher: str) -> dict:
    """`command --distributed` on `ranks` ranks over loopback: through mlx.launch, or
    ("direct") started here with the environment mlx.launch gives each rank (MLX_RANK,
    MLX_HOSTFILE). mlx.launch relays the ranks' output in a loop that never sleeps (its
    select() waits on the ranks' stdin pipes, always writable): on a 2-core machine that
    takes a core from the ranks."""
    if launcher == "mlx":
        return run([launch, "-n", str(ranks), "--backend", "ring", "--", *command], env)
    base = free_port(ranks)
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(ranks)]))
        procs = [subprocess.Popen(command, env={**env, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)},
                                  stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                                  stderr=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                                  stdin=subprocess.DEVNULL, text=True) for r in range(ranks)]
        out, err = procs[0].communicate(timeout=900)
        for p in procs[1:]:
            p.wait(60)
    lines = [line for line in out.splitlines() if line.strip()]
    if procs[0].returncode != 0 or len(lines) != 1:
        raise SystemExit(f"failed: {' '.join(command)}\n{err[-2000:]}")
    return json.loads(lines[0])


def free_port(n: int) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65535:
            return base
    raise SystemExit("no free ports")


def per_unit(doc: dict, speculative: bool) -> float:
    stats = doc["stats"]
    units = stats["rounds"] if speculative else max(len(doc["token_ids"]) - 1, 1)
    return stats["decode_seconds"] / units


def ring_bytes(traffic: dict, hidden: int, dtype_bytes: int) -> float:
    """The whole ring's bytes for the run, taps aside: every frame relayed by R - 1 ranks,
    every forward's rows over R hops."""
    r = traffic["ranks"]
    return traffic["frames"] * traffic["frame_bytes"] * (r - 1) + traffic["rows"] * hidden * dtype_bytes * r


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--launcher", choices=("direct", "mlx"), default="direct",
                    help="start the ranks here (default) or through mlx.launch (see run_ranks)")
    ap.add_argument("--model", default=str(ROOT / "packs/demo/target"))
    ap.add_argument("--draft", default=str(ROOT / "packs/demo/draft"))
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench/results")
    return ap.parse_args()


def measure_mode(args, mode: str, base: list[str], env: dict, launch: str, hidden: int) -> tuple[dict, dict]:
    """(the table row of one mode, the last R-rank run's pipeline traffic): --repeats
    pairs of runs, one process and R ranks back to back."""
    extra = ["--no-draft"] if mode == "plain" else ["--draft", args.draft]
    one, many, equal, traffic = [], [], True, None
    for _ in range(args.repeats):
        alone = run(base + extra, env)
        split = run_ranks([*base, *extra, "--distributed"], env, args.ranks, launch, args.launcher)
        one.append(per_unit(alone, mode == "speculative"))
        many.append(per_unit(split, mode == "speculative"))
        equal &= alone["token_ids"] == split["token_ids"]
        traffic = split["pipeline"]
    dtype_bytes = 4 if platform.system() == "Linux" else 2  # MLX's CPU computes in float32 here
    forwards = traffic["forwards"]
    row = {
        "mode": mode, "ranks": args.ranks, "layers": traffic["layers"],
        "one_ms": statistics.median(one) * 1e3, "ranks_ms": statistics.median(many) * 1e3,
        "ratio": statistics.median(many) / statistics.median(one), "equal": equal,
        "rank0_bytes_per_forward": traffic["sent_bytes"] / forwards,
        "rank0_received_per_forward": traffic["received_bytes"] / forwards,
        "ring_bytes_per_forward": ring_bytes(traffic, hidden, dtype_bytes) / forwards,
        "frames_per_forward": traffic["frames"] / forwards,
        "commands_per_forward": traffic["commands"] / forwards,
        "rows_per_forward": traffic["rows"] / forwards,
    }
    return row, traffic


def tb5_projection(frame: int) -> dict:
    """The 35B-A3B's decode step and verify round at 2 ranks over Thunderbolt 5, with the
    pipeline's control frame of `frame` bytes."""
    h, b = QWEN36_35B["hidden"], QWEN36_35B["dtype_bytes"]
    projection = {}
    for name, n_rows in (("decode step", 1), ("verify round", 8)):
        stream = 2 * n_rows * h * b  # rank 0 -> 1 -> 0
        messages = 3  # the frame (with the queued cache commands), the rows, the answer
        projection[name] = {"stream_bytes": stream, "control_bytes": frame,
                            "goal_bytes": 2 * n_rows * h * 2,
                            "seconds": messages * TB5_MESSAGE_S + (stream + frame) / TB5_BYTES_PER_S}
    return projection


def markdown(args, result: dict) -> str:
    lines = ["# distributed", "", f"- machine: {result['machine']}, BLAS {result['blas']}",
             f"- model: {args.model}; {args.max_tokens} tokens; medians of {args.repeats}; ranks started "
             + ("by mlx.launch" if args.launcher == "mlx" else "directly with mlx.launch's environment"), "",
             ("| mode | ranks | layers | 1 process ms | ranks ms | ratio | equal | rank 0 sent B/forward | "
              "rank 0 received B/forward | ring B/forward (taps aside) | "
              "frames/forward | commands/forward | rows/forward |"), "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['mode']} | {r['ranks']} | {r['layers']} | {r['one_ms']:.2f} | {r['ranks_ms']:.2f} | "
                     f"{r['ratio']:.2f} | {r['equal']} | {r['rank0_bytes_per_forward']:.0f} | "
                     f"{r['rank0_received_per_forward']:.0f} | "
                     f"{r['ring_bytes_per_forward']:.0f} | {r['frames_per_forward']:.2f} | "
                     f"{r['commands_per_forward']:.2f} | "
                     f"{r['rows_per_forward']:.2f} |")
    lines += ["", (f"Thunderbolt 5 projection, Qwen3.6-35B-A3B at 2 ranks (hidden {QWEN36_35B['hidden']}, BF16; "
                   f"assumed {TB5_BYTES_PER_S * 8 / 1e9:.0f} Gb/s and {TB5_MESSAGE_S * 1e6:.0f} us a message):"), ""]
    for name, p in result["tb5_projection_35b_2_ranks"].items():
        lines.append(f"- {name}: stream {p['stream_bytes']} B (goal {p['goal_bytes']} B) + control "
                     f"{p['control_bytes']} B -> {p['seconds'] * 1e6:.0f} us")
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    launch = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    base = [sys.executable, "-m", "monolith.generate", "--model", args.model, "--prompt", PROMPT,
            "--max-tokens", str(args.max_tokens), "--json"]
    config = json.loads((Path(args.model) / "config.json").read_text())
    config = config.get("text_config", config)
    rows = []
    for mode in ("plain", "speculative"):
        row, traffic = measure_mode(args, mode, base, env, launch, config["hidden_size"])
        rows.append(row)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus", "blas": os.environ.get("LD_PRELOAD", "bundled"),
              "launcher": args.launcher,
              "model": args.model, "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows,
              "tb5_assumed": {"bytes_per_s": TB5_BYTES_PER_S, "seconds_per_message": TB5_MESSAGE_S,
                              "model": QWEN36_35B},
              "tb5_projection_35b_2_ranks": tb5_projection(traffic["frame_bytes"])}
    text = markdown(args, result)
    print(text)
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    name = "distributed" if args.launcher == "direct" else "distributed_mlx_launch"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
