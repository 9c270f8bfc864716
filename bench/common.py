"""What several bench scripts share: the machine description, installed package
versions and the report writer, the synthetic target presets and a pack's byte counts,
the synthetic pair loader, prompt sources, and the `monolith.serve` command line.

Scripts import each other's helpers only from here (or from the library modules
bench/http_replay.py, bench/agent_workload.py, bench/acceptance_report.py,
bench/mlx_lm_checkpoint.py, bench/projection.py; bench/accelerator.py also reuses the stages
of bench/real_widths.py, bench/round_latency.py and bench/target_forward.py, and
bench/mlx_lm_graph.py (bench/calibration.py's part) bench/primitives.py's counting; the archived
grammar studies from bench/archive/vocabulary.py; a script split in parts imports its own:
bench/prompt_cache_runs.py and _report.py, bench/concurrency_clients.py,
bench/real_size_model.py and bench/step_bytes.py), and run from the repository root as
`python -m bench.NAME`.
"""

from __future__ import annotations

import io
import json
import os
import platform
import random
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from monolith.pack.target_recipe import VISION_PREFIX

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


class Prompts:
    """Windows of the standard library's sources, from a line start, `chars` long."""

    def __init__(self):
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        self.files = [p for p in sorted(stdlib.glob("*.py")) if p.stat().st_size > 20000]
        self._texts: dict[Path, str] = {}

    def window(self, rng: random.Random, chars: int) -> tuple[str, str]:
        path = rng.choice(self.files)
        text = self._texts.setdefault(path, path.read_text(errors="replace"))
        start = text.find("\n", rng.randrange(max(1, len(text) - chars))) + 1
        return text[start:start + chars], f"{path.name}:{start}"


def supports_max_batch() -> bool:
    help_text = subprocess.run([sys.executable, "-m", "monolith.serve", "--help"], capture_output=True, text=True,
                               cwd=ROOT, check=False).stdout
    return "--max-batch" in help_text


def server_command(args, mode: str, max_batch: int | None, max_queue: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "monolith.serve", "--max-context", str(args.max_context), "--log-level", "info"]
    if args.model:
        cmd += ["--model", args.model]
    if mode == "plain":
        cmd.append("--no-draft")
    else:
        cmd += ["--draft", args.draft] if args.draft else []
        cmd += ["--spec-sched", args.spec_sched] if args.spec_sched != "server-default" else []
    if max_batch is not None:
        cmd += ["--max-batch", str(max_batch)]
    if max_queue is not None:
        cmd += ["--max-queue", str(max_queue)]
    return cmd + args.server_arg


def package_version(name: str) -> str | None:
    """The installed version of a distribution, None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                            check=False).stdout
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "mlx": package_version("mlx"),
            "commit": commit.strip(), "blas": os.environ.get("LD_PRELOAD") or "bundled",
            "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS")}


def machine_note(m: dict) -> str:
    threads = f", {m['openblas_threads']} BLAS thread(s)" if m.get("openblas_threads") else ""
    return (f"machine: {m['processor']}, {m['cpus']} cpus, mlx {m['mlx']}, BLAS {m.get('blas', 'bundled')}{threads}, "
            f"commit {m['commit']}")


def write(report: dict, name: str, table: str, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(f"# {name}\n\n" + "".join(f"- {n}\n" for n in report["notes"])
                                        + "\n" + table + "\n")
    print(f"wrote {out_dir / name}.json and .md")


PRESETS = {
    # a small MoE target that still has every kind of layer and a few MB of weights
    "bench-forward": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                          linear_value_head_dim=64, num_experts=32, num_experts_per_tok=4,
                          moe_intermediate_size=128, shared_expert_intermediate_size=128, vocab_size=4096),
}


def count_primitives(*arrays) -> int:
    """Nodes of the (unevaluated) graph that mx.eval would run: one per primitive."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return dot.getvalue().count("shape=rectangle")


def weight_bytes(manifest: dict) -> dict:
    """Bytes of each pack entry a forward reads (all its tensors; not the vision tower's,
    which runs once per image)."""
    sizes: dict = {}
    for tensor, info in manifest["tensors"].items():
        if tensor.startswith(VISION_PREFIX):
            continue
        n = 1
        for d in info["shape"]:
            n *= d
        item = {"U32": 4, "F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I64": 8, "BOOL": 1}[info["dtype"]]
        entry = next((e for e in (tensor.rsplit(".", 1)[0], tensor) if e in manifest["entries"]), tensor)
        sizes[entry] = sizes.get(entry, 0) + n * item
    return sizes


def bytes_touched(manifest: dict, args, rows: int, context: int, dtype_bytes: int) -> dict:
    """Weights read by one forward of `rows` rows (experts: at most rows * top_k distinct
    per layer), recurrent state read + written, KV read."""
    sizes = weight_bytes(manifest)
    weights = 0
    for name, size in sizes.items():
        if ".experts." in name:
            experts = manifest["entries"][name]["shape"][0]
            weights += size * min(experts, rows * args.num_experts_per_tok) // experts
        else:
            weights += size
    gdn = sum(1 for t in args.layer_types if t == "linear_attention")
    attn = len(args.layer_types) - gdn
    state = gdn * args.linear_num_value_heads * args.linear_value_head_dim * args.linear_key_head_dim * 4 * 2
    kv = attn * (context + rows) * args.num_key_value_heads * args.head_dim * 2 * dtype_bytes
    return {"weights": weights, "recurrent_state": state, "kv": kv, "total": weights + state + kv}


def load_pair(args):
    """(scratch dir, target pack, draft source, loaded target): --model/--draft, or a
    synthetic pair of --preset written into a scratch directory."""
    from monolith.models import load_model
    from monolith.pack import build_pack, resolve_pack
    from monolith.synth import Preset, write_draft, write_target

    work = Path(tempfile.mkdtemp(prefix="monolith-bench-"))
    if args.model is None:
        target_src = write_target(work / "target", preset=Preset(**PRESETS[args.preset]), format="bf16")
        draft_src = write_draft(work / "draft", target_src, format="deepspec")
        target_pack = build_pack(target_src, work / "target.pack", role="target")
    else:
        target_pack, draft_src = resolve_pack(args.model, role="target"), args.draft
    return work, target_pack, draft_src, load_model(target_pack, dtype=args.dtype)


def corpus_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    text = (Path(__file__).parents[1] / "monolith" / "data" / "corpus.txt").read_text()
    ids = tokenizer.encode(text)
    stride = max(1, (len(ids) - length) // max(count, 1))
    return [ids[i * stride:i * stride + length] for i in range(count)]


def batch_decode(decoder, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """(decode tok/s, each sequence's tokens) of greedy `prompts` stepped as one batch
    (runtime/batch.py, as the engine steps them): the tokens after every sequence's first
    one over the time after the batch's first step (its prefills)."""
    from monolith.runtime.batch import Batch
    from monolith.runtime.generation import Generation, Tokens

    outputs: list[list[int]] = [[] for _ in prompts]
    batch = Batch()
    for out, prompt in zip(outputs, prompts):
        batch.add(decoder.steps(Generation(prompt, max_tokens,
                                           emitter=Tokens(lambda token, logprob, out=out: out.append(token) or True))))
    batch.step()  # the prefills and every first token
    mx.synchronize()
    start, first = time.perf_counter(), sum(len(o) for o in outputs)
    while len(batch):
        batch.step()
    mx.synchronize()
    return (sum(len(o) for o in outputs) - first) / (time.perf_counter() - start), outputs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
