"""The first numbers from an accelerator (issue 37): the 35B-A3B layout at real widths on
whatever GPU MLX computes on (MLX's CUDA backend on Linux with NVIDIA; the MLX references
stand in for the Metal kernels there, docs/kernels.md), in one command:

    python -m bench.accelerator [--preset full] [--layers 40] [--contexts 128,4096,32768]
        [--prefill 2048,16384] [--batches 1,2,4,8] [--decode-tokens 64] [--batch-tokens 32]
        [--repeats 3] [--work DIR] [--out-dir DIR] [--no-mlx-lm]

Builds a ModelOpt MIXED target (monolith.synth.published layout nvidia-35b) with --layers
decoder layers at --preset widths (full: the published ones) and a LithosAI-layout draft
(lithos-dspark, its taps folded onto that depth as bench/real_widths.py does), both as
skeletons (every file at its real size, all values zero: writing random values at full
size takes an hour, docs/performance.md), and packs them (the draft becomes NVFP4). All
zeros would route every row to the same experts, so after loading each router adds random
noise to its logits (in memory, `RandomRouter`): rows spread over the experts at random,
and a step, a verify and a batch read the experts real routing would. Every logit is 0,
so every greedy proposal is accepted (8 tokens a round at --block-size 7): the
speculative rows are that ceiling; the round costs are what carries over.

Measures, in the compute dtype of the device (bfloat16 on a GPU): the gated delta rule
over 8 and 512 rows, chunked against MLX's fast op (`recurrence_probe`); plain decode tok/s
(bench/target_forward.py's loop); at each of --contexts the decode step ms and the
speculative round's draft / verify / commit / round ms (bench/round_latency.py's Rig)
and the round-to-step cost ratio; aggregate tok/s of B = --batches sequences stepped as
one batch (bench/common.batch_decode), plain and speculative; prefill tok/s at each
--prefill length; mlx-lm's plain decode of a model of the same config, NVFP4-quantized
in memory (its own random values: a float copy of the target, which mlx-lm would need to
load ours, does not fit the device's disk), when mlx_lm is importable. Writes
accelerator.json and accelerator.md under --out-dir. Device procedure: docs/performance.md,
"On an NVIDIA GPU".
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import time
import traceback
from pathlib import Path

import mlx.core as mx

from bench.common import batch_decode, machine, machine_note, write
from bench.real_widths import PUBLISHED_DEPTH, folded_taps, pack_stage
from bench.round_latency import Rig, measure
from bench.target_forward import WARMUP_STEPS, ours_decode
from monolith.runtime.calibrate import median_seconds

TARGET, DRAFT = "nvidia-35b", "lithos-dspark"


def build(preset: str, layers: int, work: Path) -> dict:
    """Skeleton target and draft written and packed under `work` (the sources removed
    after, the target's config.json kept); seconds of each stage."""
    from monolith.synth import published

    out, start = {}, time.perf_counter()
    src = published.write_published_target(work / "target-src", TARGET, preset=preset, layers=layers, skeleton=True)
    tc = json.loads((src / "config.json").read_text())["text_config"]
    full = published.draft_layout_sizes(DRAFT, dict(tc, num_hidden_layers=PUBLISHED_DEPTH[TARGET]))
    draft_src = published.write_published_draft(work / "draft-src", DRAFT, src, skeleton=True,
                                                sizes=folded_taps(full, layers, DRAFT))
    out["write_seconds"] = time.perf_counter() - start
    for role, source in (("target", src), ("draft", draft_src)):
        packed = pack_stage(str(source), str(work / f"{role}-pack"), role)
        out[f"{role}_pack_seconds"], out[f"{role}_pack_bytes"] = packed["seconds"], packed["bytes"]
    shutil.copy2(src / "config.json", work / "target-config.json")  # mlx-lm's model is built from it
    for source in (src, draft_src):  # the device's disk holds the packs, not the sources too
        shutil.rmtree(source)
    return out


class RandomRouter:
    """A MoE router whose logits are its own (zeros in a skeleton) plus fresh normal noise
    per row and call: rows spread over the experts at random, the expected spread of real
    routing (bench/real_widths.py's projection assumes the same), and the router's
    weights are still read."""

    def __init__(self, router, experts: int):
        self.router, self.experts = router, experts

    def __call__(self, x: mx.array) -> mx.array:
        logits = self.router(x)
        return logits + mx.random.normal((*logits.shape[:-1], self.experts))


def random_routing(model) -> int:
    """Every MoE layer of `model` routed by a RandomRouter (in memory); how many."""
    layers = [layer for layer in model.layers if hasattr(layer.mlp, "router")]
    for layer in layers:
        layer.mlp.router = RandomRouter(layer.mlp.router, model.args.num_experts)
    return len(layers)


def prompt(model, length: int, seed: int) -> list[int]:
    return mx.random.randint(0, model.args.vocab_size, (length,), key=mx.random.key(seed)).tolist()


def step_ms(rig: Rig, model, repeats: int) -> float:
    """One decode step (one row, last logits) from the rig's saved state."""
    def once() -> float:
        rig.reset()
        start = time.perf_counter()
        logits, _ = model.forward(mx.array([1], dtype=mx.int32), rig.decoder.cache, logits="last")
        mx.eval(logits, rig.decoder.cache.arrays())
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(repeats)) * 1e3


def recurrence_probe(model, repeats: int) -> dict:
    """ms of the gated delta rule over 8 and 512 rows at the model's widths: the chunked
    form (what runs off Metal: matmuls, and a 64 x 64 triangular inverse on the CPU
    stream) against MLX's fast op (unrolled over rows where it has no kernel). If the
    chunked form fails on this device, the fast op serves the rest of the run (recorded
    as "serving")."""
    from monolith.kernels import recurrence

    a, out = model.args, {}
    hk, hv, dk, dv = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
    for rows in (8, 512):
        keys = mx.random.split(mx.random.key(rows), 4)
        q, k = (mx.random.normal((1, rows, hk, dk), key=kk).astype(model.dtype) * dk ** -0.5 for kk in keys[:2])
        v = mx.random.normal((1, rows, hv, dv), key=keys[2]).astype(model.dtype)
        gamma = mx.random.uniform(0.9, 1.0, (1, rows, hv), key=keys[3])
        beta, state = mx.full((1, rows, hv), 0.5), mx.zeros((1, hv, dv, dk))
        for name, run in (("chunked", lambda: recurrence.chunked(q, k, v, gamma, beta, state)),
                          ("fast", lambda: mx.fast.gated_delta_update(q, k, v, gamma, beta, initial_state=state))):
            try:
                out[f"{name}_{rows}_rows_ms"] = median_seconds(lambda run=run: mx.eval(*run()), repeats) * 1e3
            except Exception as e:  # a backend without an op
                out[f"{name}_{rows}_rows_ms"], out[f"{name}_error"] = None, f"{type(e).__name__}: {e}"
    out["serving"] = "fast op" if recurrence.fast_recurrence() else "chunked"
    if "chunked_error" in out and "fast_error" not in out and not recurrence.fast_recurrence():
        recurrence.fast_recurrence = lambda: True
        out["serving"] = "fast op (the chunked form failed here)"
    return out


def rounds(model, manifests, drafter, contexts, gamma: int, repeats: int) -> list[dict]:
    rows = measure(model, manifests[0], drafter, manifests[1], contexts, gamma, repeats, 2)
    for row in rows:
        row["step_ms"] = step_ms(Rig(model, drafter, row["context"], gamma), model, repeats)
        row["round_to_step"] = row["round_ms"] / row["step_ms"]
    return rows


def prefill_rates(model, lengths, repeats: int) -> list[dict]:
    from monolith.runtime.prefill import prefill

    rows = []
    for length in lengths:
        tokens = mx.array(prompt(model, length, length), dtype=mx.int32)

        def once() -> float:
            cache = model.make_cache(length + 16)
            start = time.perf_counter()
            mx.eval(prefill(model, tokens, cache), cache.arrays())
            return time.perf_counter() - start

        once()
        rows.append({"tokens": length, "tok_s": length / statistics.median(once() for _ in range(repeats))})
    return rows


def batched(model, drafter, batches, prompt_tokens: int, max_tokens: int, gamma: int) -> list[dict]:
    from monolith.runtime.decoder import Decoder
    from monolith.runtime.scheduler import make_scheduler

    context = prompt_tokens + max_tokens + 64
    decoders = {"plain": Decoder(model, None, context),
                "speculative": Decoder(model, drafter, context, gamma=gamma, scheduler=make_scheduler("fixed"))}
    rows = []
    for mode, decoder in decoders.items():
        for b in batches:
            prompts = [prompt(model, prompt_tokens, 1000 + i) for i in range(b)]
            batch_decode(decoder, prompts, 4)  # warm-up
            rate, _ = batch_decode(decoder, prompts, max_tokens)
            rows.append({"mode": mode, "sequences": b, "tok_s": rate})
    return rows


def mlx_lm_plain(config_path: Path, prompt_ids: list[int], steps: int) -> dict:
    """mlx-lm's decode tok/s on a model of the target's config, NVFP4 in memory."""
    try:
        import mlx.nn as nn
        from mlx_lm.models import cache as lm_cache
        from mlx_lm.utils import _get_classes
    except ImportError as e:
        return {"skipped": f"mlx_lm is not importable ({e})"}
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    skip = ("mlp.gate", "shared_expert_gate", "embed_tokens")
    for layer in model.layers:  # one layer's float values at a time
        layer.set_dtype(mx.bfloat16)
        nn.quantize(layer, group_size=16, bits=4, mode="nvfp4",
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and not p.endswith(skip))
        mx.eval(layer.parameters())
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    cache = lm_cache.make_prompt_cache(model)
    logits = model(mx.array(prompt_ids, dtype=mx.int32)[None], cache=cache)
    token = mx.argmax(logits[0, -1]).reshape(1, 1)
    times = []
    for i in range(WARMUP_STEPS + steps):
        start = time.perf_counter()
        token = mx.argmax(model(token, cache=cache)[0, -1]).reshape(1, 1)
        mx.eval(token)
        times.append(time.perf_counter() - start)
    return {"tok_s": steps / sum(times[WARMUP_STEPS:]), "weights": "mlx-lm's own random values, NVFP4 in memory"}


def guarded(report: dict, key: str, measure_it, out_dir: Path, deadline: float) -> None:
    """report[key] = measure_it(), or {"failed": the error} (a device run keeps what it
    got), or {"skipped": ...} once time.perf_counter() is past `deadline`; the report so
    far is written after each stage, so a run stopped at its limit still leaves it."""
    start = time.perf_counter()
    if start > deadline:
        report[key] = {"skipped": "out of time (--deadline)"}
        return
    try:
        report[key] = measure_it()
    except Exception as e:  # a backend without an op, memory: recorded, the run goes on
        traceback.print_exc()
        report[key] = {"failed": f"{type(e).__name__}: {e}"}
    print(f"{key}: {time.perf_counter() - start:.1f} s", flush=True)
    save(report, out_dir)


def save(report: dict, out_dir: Path) -> None:
    """The report so far, as accelerator.json (write() replaces it at the end)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "accelerator.json").write_text(json.dumps(report, indent=2) + "\n")


def markdown(report: dict) -> str:
    failed = [f"{k}: {v.get('failed') or v['skipped']}" for k, v in report.items()
              if isinstance(v, dict) and ("failed" in v or "skipped" in v) and k != "mlx_lm"]
    report = {k: ([] if isinstance(v, dict) and ("failed" in v or "skipped" in v) and k != "mlx_lm" else v)
              for k, v in report.items()}
    lines = ["| context | step ms | draft ms | verify ms | commit ms | round ms | round / step |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['step_ms']:.2f} | {r['draft_ms']:.2f} | {r['verify_ms']:.2f} | "
              f"{r['commit_ms']:.2f} | {r['round_ms']:.2f} | {r['round_to_step']:.2f} |" for r in report["rounds"]]
    lines += ["", "| mode | sequences | aggregate tok/s |", "|---|---|---|"]
    lines += [f"| {r['mode']} | {r['sequences']} | {r['tok_s']:.1f} |" for r in report["batched"]]
    lines += ["", "| prefill tokens | tok/s |", "|---|---|"]
    lines += [f"| {r['tokens']} | {r['tok_s']:.0f} |" for r in report["prefill"]]
    rec = report["recurrence"]
    if rec != []:
        ms = lambda key: "failed" if rec[key] is None else f"{rec[key]:.2f}"  # noqa: E731
        lines += ["", f"gated delta rule, 8 / 512 rows: chunked {ms('chunked_8_rows_ms')} / {ms('chunked_512_rows_ms')}"
                  f" ms, fast op {ms('fast_8_rows_ms')} / {ms('fast_512_rows_ms')} ms; serving: {rec['serving']}"]
    lm, ours = report["mlx_lm"], report["plain_tok_s"]
    lines += ["", f"plain decode: ours {f'{ours:.1f} tok/s' if ours != [] else 'not measured'}; mlx-lm "
              + (f"{lm['tok_s']:.1f} tok/s" if "tok_s" in lm else lm.get("skipped") or f"failed ({lm['failed']})")]
    return "\n".join(lines + [""] + [f"not measured: {f}" for f in failed])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", help="widths: full (published) or a synth preset (tiny: a smoke run)")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--contexts", default="128,4096,32768")
    ap.add_argument("--prefill", default="2048,16384")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--batch-prompt", type=int, default=128, help="prompt tokens of each batched sequence")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=32, help="tokens each batched sequence decodes")
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/monolith-accelerator"))
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/monolith-accelerator/out"))
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--deadline", type=float, default=540,
                    help="seconds after the start past which no further stage begins (a device call's limit is 600)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")  # the kernel check's line
    from monolith.engine_setup import load_drafter
    from monolith.kernels import backend, gpu_backend
    from monolith.models import load_model
    from monolith.pack import read_manifest

    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    began = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "device": mx.device_info(), "gpu_backend": gpu_backend(),
              "kernels": backend(), "preset": args.preset, "layers": args.layers, "notes": []}
    report["build"] = build(args.preset, args.layers, args.work)
    print(f"built in {time.perf_counter() - began:.0f} s: {report['build']}", flush=True)
    save(report, args.out_dir)
    start = time.perf_counter()
    model = load_model(args.work / "target-pack", verify="never")  # just built: hashing 19 GB would cost seconds
    drafter = load_drafter(args.work / "draft-pack", model, verify="never")
    report["random_routers"] = random_routing(model)
    report["load_seconds"], report["dtype"] = time.perf_counter() - start, str(model.dtype)
    print(f"loaded in {report['load_seconds']:.0f} s", flush=True)
    gamma = min(args.block_size, drafter.max_proposals)
    manifests = (read_manifest(args.work / "target-pack"), read_manifest(args.work / "draft-pack"))
    stages = {
        "recurrence": lambda: recurrence_probe(model, args.repeats),
        "plain_tok_s": lambda: ours_decode(model, prompt(model, 128, 0), args.decode_tokens),
        "rounds": lambda: rounds(model, manifests, drafter, ints(args.contexts), gamma, args.repeats),
        "batched": lambda: batched(model, drafter, ints(args.batches), args.batch_prompt, args.batch_tokens, gamma),
        "prefill": lambda: prefill_rates(model, ints(args.prefill), args.repeats),
    }
    for key, stage in stages.items():
        guarded(report, key, stage, args.out_dir, began + args.deadline)
    report["peak_memory_bytes"] = mx.get_peak_memory()
    save(report, args.out_dir)
    del model, drafter, stages
    mx.clear_cache()
    guarded(report, "mlx_lm", lambda: {"skipped": "--no-mlx-lm"} if args.no_mlx_lm else
            mlx_lm_plain(args.work / "target-config.json", list(range(128)), args.decode_tokens),
            args.out_dir, began + args.deadline)
    report["seconds"] = time.perf_counter() - began
    report["notes"] = [machine_note(report["machine"]),
                       f"device: {report['device'].get('device_name')}, MLX backend {gpu_backend() or 'cpu'}, "
                       f"kernels {report['kernels']}, dtype {report['dtype']}",
                       f"target {TARGET} ({args.preset} widths, {args.layers} layers) + draft {DRAFT}, skeleton "
                       "values (zeros), routers with random noise (every proposal is accepted: speculative rows "
                       "are the all-accepted ceiling)",
                       f"run {report['seconds']:.0f} s (build {sum(v for k, v in report['build'].items() if 'seconds' in k):.0f} s)"]
    table = markdown(report)
    print(table)
    write(report, "accelerator", table, args.out_dir)


if __name__ == "__main__":
    main()
