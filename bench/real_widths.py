"""The published layouts at real widths, reduced depth: pack, load, plain and speculative
greedy generation (they must agree), memory, and what 40 layers would cost on a Mac.

    python -m bench.real_widths [--pairs nvidia-35b:lithos-dspark,nvidia-35b:koopah-dspark,unsloth-27b:speculators-27b]
                                [--layers 4] [--prompt-tokens 32] [--max-tokens 8] [--work DIR]

For each target layout (monolith.synth.published, random values) a checkpoint at the
published widths with `--layers` decoder layers (3 gated-DeltaNet + 1 attention per 4),
each draft layout at its published widths (taps folded onto the shallow target, keeping
their count so `fc` keeps its real width), packed with `python -m monolith.pack`'s
defaults (a BF16 draft becomes NVFP4). Every stage runs in a fresh process, so its peak
RSS is its own: pack build (seconds, peak RSS), then a "serve" process that loads the
target and the draft (load seconds), prefills a prompt (first-token latency), decodes
plainly and speculatively (fixed 7-token blocks) and checks that the greedy outputs are
equal; its peak RSS is compared with the bytes of the two packs.

Bytes and MLX primitives per decode step and per verify round are counted on the loaded
models' graphs (the CPU graph here). The Mac projection scales the bytes one decode
step and one round touch to the published depth and divides by an M5 Max-class
bandwidth (614 GB/s); the dispatch term uses bench/primitives.py's counts of the Metal
path at 40 layers (bench/results/primitives.json) times a per-primitive cost, given as a
range because it cannot be measured here (bench/projection.py).

Target packs keep the checkpoint's MTP head (`--with-mtp`), and the serve stage counts
one MTP proposal's primitives with the real MTPHead; the MTP section projects a round of
k = 1-4 MTP proposals per target layout at a sweep of per-position acceptance, beside
its DSpark pairs at their cards' acceptance lengths, and finds the acceptance from which
MTP wins (bench/projection.py, docs/performance.md).
Writes bench/results/real_widths.json and .md (the tables, also printed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.projection import (
    BANDWIDTH,
    DISPATCH_US,
    GAMMA,
    count_mtp_step,
    dispatch_terms,
    mtp_lines,
    mtp_section,
    projection,
)

RESULTS = Path(__file__).parent / "results"
PUBLISHED_DEPTH = {"nvidia-35b": 40, "unsloth-27b": 64}
ANCHORS = {"lithos-metal round at 128 context (ms)": 25.2, "dflash-mlx 35B-A3B 4-bit DFlash (tok/s)": 300.0,
           "mlx-lm plain decode 35B-A3B 4-bit (tok/s)": 138.0}
TAUS = (3.0, 3.96)  # acceptance lengths to project with: the demo pair's ~3, Koopah DSPARK v2's card (Spec-Bench)
# each DSpark draft's published acceptance lengths, to set the MTP head against (docs/drafts.md 5)
CARD_TAUS = {"lithos-dspark": TAUS, "koopah-dspark": TAUS, "speculators-27b": (1.51,)}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def in_fresh_process(fn, *args):
    """fn(*args) in a new spawned interpreter (its peak RSS is its own)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


# ------------------------------------------------------------------ stages (child processes)


def write_stage(kind: str, layout: str, out: str, layers: int, target: str | None, preset: str) -> dict:
    from monolith.synth import published

    start = time.perf_counter()
    if kind == "target":
        published.write_published_target(out, layout, preset=preset, layers=layers)
    else:
        tc = json.loads((Path(target) / "config.json").read_text())["text_config"]
        full_depth = PUBLISHED_DEPTH[published.DRAFT_LAYOUTS[layout].target]
        sizes = folded_taps(published.draft_layout_sizes(layout, dict(tc, num_hidden_layers=full_depth)),
                            tc["num_hidden_layers"], layout)
        published.write_published_draft(out, layout, target, sizes=sizes)
    return {"seconds": time.perf_counter() - start, "peak_rss": peak_rss()}


def folded_taps(sizes, depth: int, layout: str):
    """The published taps mapped onto a `depth`-layer target, keeping their number."""
    from dataclasses import replace

    from monolith.synth import published

    full = PUBLISHED_DEPTH[published.DRAFT_LAYOUTS[layout].target]
    return replace(sizes, target_layer_ids=tuple(min(depth - 1, t * depth // full) for t in sizes.target_layer_ids))


def pack_stage(source: str, out: str, role: str) -> dict:
    from monolith.pack import build_pack, read_manifest

    start = time.perf_counter()
    build_pack(source, out, role=role, force=True, with_mtp=role == "target")  # the MTP head: docs/drafts.md 6
    seconds = time.perf_counter() - start
    manifest = read_manifest(out)
    return {"seconds": seconds, "peak_rss": peak_rss(), "bytes": sum(s["bytes"] for s in manifest["shards"].values())}


def serve_stage(target_pack: str, draft_pack: str, prompt_tokens: int, max_tokens: int) -> dict:
    import mlx.core as mx

    from monolith.engine_setup import load_drafter
    from monolith.models import load_model
    from monolith.runtime.decoder import Decoder
    from monolith.runtime.engine import run_decoder
    from monolith.runtime.scheduler import make_scheduler
    from monolith.sampling import SamplingParams

    out: dict = {}
    start = time.perf_counter()
    model = load_model(target_pack, "float32")
    out["target_load_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    drafter = load_drafter(draft_pack, model, dtype="float32")
    out["draft_load_seconds"] = time.perf_counter() - start
    out["rss_after_load"] = peak_rss()
    out["target_weights"] = model.dense_summary
    vocab = model.args.vocab_size
    prompt = mx.random.randint(0, vocab, (prompt_tokens,), key=mx.random.key(7)).tolist()
    params = SamplingParams(temperature=0.0)
    context = prompt_tokens + max_tokens + 16
    plain = run_decoder(Decoder(model, None, context), prompt, max_tokens, params)
    gamma = min(GAMMA, drafter.max_proposals)
    spec = run_decoder(Decoder(model, drafter, context, gamma=gamma, scheduler=make_scheduler("fixed")),
                       prompt, max_tokens, params)
    out.update(
        first_token_seconds=plain.prefill_seconds,
        plain_tok_s=plain.decode_tok_s,
        speculative_tok_s=spec.decode_tok_s,
        tau=spec.speculative.acceptance_length,
        equal=plain.token_ids == spec.token_ids,
        plain_ids=plain.token_ids,
        speculative_ids=spec.token_ids,
        gamma=gamma,
    )
    out.update(graph_counts(model, drafter, prompt, gamma))
    out["primitives"]["mtp_step"] = count_mtp_step(model, target_pack, prompt_tokens)
    out["peak_rss"] = peak_rss()
    return out


def graph_counts(model, drafter, prompt, gamma: int) -> dict:
    """Primitives (graph nodes) of one decode step, one draft proposal and one verify +
    commit of gamma + 1 rows after the prompt."""
    from monolith.models.layers import whole_graphs

    with whole_graphs():  # the counted graphs stay whole
        return _graph_counts(model, drafter, prompt, gamma)


def _graph_counts(model, drafter, prompt, gamma: int) -> dict:
    import mlx.core as mx

    from bench.common import count_primitives
    from monolith.runtime.prefill import prefill
    from monolith.sampling import SamplingParams

    cache = model.make_cache(len(prompt) + 32)
    logits = prefill(model, mx.array(prompt, dtype=mx.int32), cache)
    mx.eval(logits, cache.arrays())
    snap = cache.snapshot()
    step, _ = model.forward(mx.array([1], dtype=mx.int32), cache, logits="last")
    decode = count_primitives(step, *cache.arrays())
    cache.restore(snap)
    cache.snapshot(record=True)
    rows = mx.array(list(range(1, gamma + 2)), dtype=mx.int32)
    verify, _ = model.forward(rows, cache, taps=drafter.taps, logits="all")
    cache.commit(snap, gamma // 2 + 1)
    round_primitives = count_primitives(verify, *cache.arrays())
    drafter.start(len(prompt) + 32)
    features = mx.zeros((len(prompt), len(drafter.taps) * model.args.hidden_size), model.dtype)
    drafter.observe(features)
    mx.eval(drafter.arrays())  # the context rows are not part of the proposal
    proposal = drafter.propose(mx.array(1, dtype=mx.int32), gamma, SamplingParams(temperature=0.0), None)
    draft = count_primitives(proposal.tokens, proposal.q)
    return {"primitives": {"decode_step": decode, "verify_commit": round_primitives, "draft_proposal": draft,
                           "round": round_primitives + draft}}


# ------------------------------------------------------------------ the run


def stage(args, out: Path, fn, *fn_args) -> dict:
    """A stage in a fresh process, or (--reuse) its earlier result."""
    record = out.parent / f"{out.name}.stage.json"
    if args.reuse and record.is_file() and (out.is_dir() or fn is serve_stage):
        return json.loads(record.read_text())
    result = in_fresh_process(fn, *fn_args)
    record.write_text(json.dumps(result))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="nvidia-35b:lithos-dspark,nvidia-35b:koopah-dspark,unsloth-27b:speculators-27b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--preset", default="full", help="widths: full (published) or a synth preset (tiny: a smoke run)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--work", type=Path, default=Path("/tmp/monolith-real-widths"))
    ap.add_argument("--json", type=Path, default=RESULTS / "real_widths.json")
    ap.add_argument("--reuse", action="store_true", help="keep checkpoints and packs already in --work")
    args = ap.parse_args()

    from monolith.pack import read_manifest

    pairs = [tuple(p.split(":")) for p in args.pairs.split(",") if p]
    args.work.mkdir(parents=True, exist_ok=True)
    report = {"machine": platform.platform(), "python": platform.python_version(), "layers": args.layers,
              "preset": args.preset,
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "bandwidth": BANDWIDTH,
              "targets": {}, "pairs": [], "dispatch_40_layers": dispatch_terms(RESULTS), "anchors": ANCHORS}
    for target_layout in dict.fromkeys(t for t, _ in pairs):
        src, pack = args.work / f"{target_layout}-src", args.work / f"{target_layout}-pack"
        row = {"write": stage(args, src, write_stage, "target", target_layout, str(src), args.layers, None,
                              args.preset)}
        row["pack"] = stage(args, pack, pack_stage, str(src), str(pack), "target")
        report["targets"][target_layout] = row
        print(f"{target_layout}: pack {row['pack']['bytes'] / 1e9:.2f} GB in {row['pack']['seconds']:.0f} s, "
              f"peak RSS {row['pack']['peak_rss'] / 1e9:.2f} GB", flush=True)
    for target_layout, draft_layout in pairs:
        tsrc, tpack = args.work / f"{target_layout}-src", args.work / f"{target_layout}-pack"
        src, pack = args.work / f"{draft_layout}-src", args.work / f"{draft_layout}-pack"
        row = {"target": target_layout, "draft": draft_layout,
               "write": stage(args, src, write_stage, "draft", draft_layout, str(src), args.layers, str(tsrc),
                              args.preset)}
        row["pack"] = stage(args, pack, pack_stage, str(src), str(pack), "draft")
        row["serve"] = stage(args, args.work / f"{target_layout}+{draft_layout}", serve_stage, str(tpack), str(pack),
                             args.prompt_tokens, args.max_tokens)
        packs = report["targets"][target_layout]["pack"]["bytes"] + row["pack"]["bytes"]
        row["packs_bytes"] = packs
        row["rss_over_packs"] = row["serve"]["peak_rss"] / packs
        config = json.loads((tpack / "config.json").read_text())
        row["projection"] = projection(read_manifest(tpack), read_manifest(pack), config,
                                       PUBLISHED_DEPTH[target_layout], context=128)
        report["pairs"].append(row)
        s = row["serve"]
        print(f"{target_layout} + {draft_layout}: draft pack {row['pack']['bytes'] / 1e9:.2f} GB "
              f"({row['pack']['seconds']:.0f} s, RSS {row['pack']['peak_rss'] / 1e9:.2f} GB); load "
              f"{s['target_load_seconds']:.1f} + {s['draft_load_seconds']:.1f} s; first token "
              f"{s['first_token_seconds']:.2f} s; plain {s['plain_tok_s']:.2f} tok/s, speculative "
              f"{s['speculative_tok_s']:.2f} tok/s (tau {s['tau']:.2f}), equal {s['equal']}; peak RSS "
              f"{s['peak_rss'] / 1e9:.2f} GB = {row['rss_over_packs']:.2f}x the packs", flush=True)
    report["mtp"] = {t: mtp_projection(report, args.work, t) for t in report["targets"]}
    text = "\n".join(tables(report))
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    args.json.with_suffix(".md").write_text(f"# real_widths\n\n`python -m bench.real_widths` ({report['preset']} "
                                            f"widths, {report['layers']} layers; docs/performance.md)\n{text}\n")
    print(f"wrote {args.json} and .md")


def mtp_projection(report: dict, work: Path, target_layout: str) -> dict:
    """The target's MTP head (its pack is built --with-mtp) projected beside its DSpark
    pairs (bench/projection.py)."""
    from monolith.pack import read_manifest

    tpack = work / f"{target_layout}-pack"
    pairs = [row for row in report["pairs"] if row["target"] == target_layout]
    config = json.loads((tpack / "config.json").read_text())
    counts = {"mtp_step": pairs[0]["serve"]["primitives"]["mtp_step"]}
    return mtp_section(read_manifest(tpack), config, PUBLISHED_DEPTH[target_layout], 128, counts,
                       report["dispatch_40_layers"], pairs, CARD_TAUS)


def tables(report: dict) -> list[str]:
    lines = [("\n| target + draft | packs GB | peak RSS / packs | load s | first token s | plain tok/s "
             "| spec tok/s | tau | equal |"), "|---|---|---|---|---|---|---|---|---|"]
    for row in report["pairs"]:
        s = row["serve"]
        lines.append(f"| {row['target']} + {row['draft']} | {row['packs_bytes'] / 1e9:.2f} "
                     f"| {row['rss_over_packs']:.2f} | {s['target_load_seconds'] + s['draft_load_seconds']:.1f} "
                     f"| {s['first_token_seconds']:.2f} | {s['plain_tok_s']:.2f} | {s['speculative_tok_s']:.2f} "
                     f"| {s['tau']:.2f} | {s['equal']} |")
    lines += [("\n| target + draft | primitives: step / draft / verify+commit | published depth: step MB / ms "
              "| round MB / ms (draft MB) |"), "|---|---|---|---|"]
    for row in report["pairs"]:
        p, j = row["serve"]["primitives"], row["projection"]
        lines.append(f"| {row['target']} + {row['draft']} | {p['decode_step']} / {p['draft_proposal']} / "
                     f"{p['verify_commit']} | {j['decode_step']['total'] / 1e6:.0f} / "
                     f"{j['decode_step']['floor_ms']:.2f} | {j['round']['total'] / 1e6:.0f} / "
                     f"{j['round']['floor_ms']:.2f} ({j['draft']['total'] / 1e6:.0f}) |")
    d = report["dispatch_40_layers"]
    if d:
        lines.append("\nprojected at the published depth, bytes floor + dispatch (2 us per Metal-path primitive; "
                     "the count is the 35B-A3B's at 40 layers, a rough stand-in for the dense 27B at 64):\n")
        for row in report["pairs"]:
            j = row["projection"]
            step = j["decode_step"]["floor_ms"] + d["decode_step_ms"]["2.0 us"]
            rnd = j["round"]["floor_ms"] + d["round_ms"]["2.0 us"]
            rates = ", ".join(f"tau {t}: {t * 1e3 / rnd:.0f} tok/s" for t in TAUS)
            lines.append(f"- {row['target']} + {row['draft']}: step {step:.1f} ms ({1e3 / step:.0f} tok/s plain), "
                         f"round {rnd:.1f} ms ({rates})")
        lines.append(f"\nMetal path, 40 layers: {d['decode_step']} primitives per decode step, {d['round']} per "
                     f"round; at {', '.join(str(us) for us in DISPATCH_US)} us each: step "
                     f"{', '.join(f'{v:.1f}' for v in d['decode_step_ms'].values())} ms, round "
                     f"{', '.join(f'{v:.1f}' for v in d['round_ms'].values())} ms")
    return lines + mtp_lines(report)


if __name__ == "__main__":
    main()
