"""Speculative round latency by context length, BF16 vs NVFP4 draft: draft ms, verify ms,
commit ms and full round ms (the seed card's table), plus bytes moved and MLX
primitives per round.

    python -m bench.round_latency [--contexts 128,512,2048] [--block-size 7] [--repeats 5]
                                  [--preset bench-forward] [--dtype float32]
                                  [--model PACK --draft DRAFT]
Prints a table and writes bench/results/round_latency.json. By default a synthetic
target (sizes: --preset, as bench/target_forward.py) and a synthetic DeepSpec draft
that fits it; --model/--draft run real ones (on a Mac).

Every measurement starts from the same state: the context prefilled, then a round is
drafted, verified and committed, and the cache and the draft context are put back.
Stages are timed each with its own evaluation (draft: the proposals; verify: the
forward and the acceptance read; commit: the replayed GDN states and the draft context
append); "round" is one unprofiled `Rounds.round` (its one host sync) plus
evaluating what it left lazy. A synthetic draft accepts almost nothing, so "commit" is
the a = 0 replay; "commit l-1" forces a = l - 1 (the longest replay). Bytes are an
estimate of what the stage must read and write (formulas in `round_bytes`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.common import (
    PRESETS,
    bytes_touched,
    count_primitives,
    load_pair,
    weight_bytes,
)
from monolith.models.layers import whole_graphs


def draft_bytes(draft_manifest: dict, draft, context: int, gamma: int, dtype_bytes: int) -> dict:
    """Draft stage: every draft weight except the embedding table (a gather of gamma
    rows), plus the context K/V read by every draft layer. Commit-side append: `fc`
    and the layers' k/v projections for the kept rows (weights read once)."""
    sizes = weight_bytes(draft_manifest)
    a = draft.args
    embed = sum(v for k, v in sizes.items() if k.startswith("embed_tokens"))
    weights = sum(sizes.values()) - embed + embed * gamma // max(draft.target_vocab, 1)
    kv = a.num_layers * 2 * (context + draft.block_size) * a.num_kv_heads * a.head_dim * dtype_bytes
    append = sum(v for k, v in sizes.items() if k.startswith("fc") or ".k_proj" in k or ".v_proj" in k)
    return {"weights": weights, "context_kv": kv, "total": weights + kv, "append_weights": append}


def commit_bytes(args, kept: int) -> int:
    """Tape replay: each GDN layer reads the recurrent state before the round and writes
    the state after the kept rows (F32), and reads the kept rows' q, k, v, gates."""
    gdn = sum(1 for t in args.layer_types if t == "linear_attention")
    state = args.linear_num_value_heads * args.linear_value_head_dim * args.linear_key_head_dim * 4
    rows = kept * (2 * args.linear_num_key_heads * args.linear_key_head_dim
                   + args.linear_num_value_heads * (args.linear_value_head_dim + 2)) * 4
    return gdn * (2 * state + rows)


class Rig:
    """A decoder prefilled to `context` rows, and a way back to that state."""

    def __init__(self, model, drafter, context: int, gamma: int):
        from monolith.runtime.generation import Generation
        from monolith.runtime.rounds import Rounds

        self.decoder = Rounds(model, drafter, Generation(), context + 64, gamma)
        prompt = mx.random.randint(0, model.args.vocab_size, (context,), key=mx.random.key(context))
        self.decoder.prefill(np.array(prompt).tolist(), chunk_size=512)
        mx.eval(self.decoder.cache.arrays(), drafter.arrays())
        self.snapshot = self.decoder.cache.snapshot()
        self.anchor, self.draft_snapshot = self.decoder.anchor, drafter.snapshot()
        self.context_offset = self.draft_snapshot.offset
        self.drafter = drafter

    def reset(self):
        self.decoder.cache.restore(self.snapshot)
        self.drafter.restore(self.draft_snapshot, self.context_offset)
        self.decoder.anchor = self.anchor

    def stages(self, force_accepted: int | None = None, count: bool = False) -> dict:
        """Seconds (and primitives) of draft, verify, commit from the saved state."""
        d, out = self.decoder, {}
        self.reset()
        start = time.perf_counter()
        with whole_graphs() if count else nullcontext():  # counted graphs stay whole
            block = d.draft(10**9)
        if count:
            out["draft_primitives"] = count_primitives(*block.arrays())
        mx.eval(block.arrays())
        drafted = time.perf_counter()
        with whole_graphs() if count else nullcontext():
            verdict = d.verify(block)
        if count:
            out["verify_primitives"] = count_primitives(verdict)
        read = np.array(verdict)
        verified = time.perf_counter()
        if force_accepted is not None:
            read[block.size] = force_accepted
        result = d.commit(block, read)
        state = d.cache.arrays() + self.drafter.arrays()
        if count:
            out["commit_primitives"] = count_primitives(*state)
        mx.eval(state)
        committed = time.perf_counter()
        out.update(draft=drafted - start, verify=verified - drafted, commit=committed - verified,
                   proposed=result.proposed, accepted=result.accepted)
        return out

    def full_round(self) -> float:
        self.reset()
        start = time.perf_counter()
        self.decoder.round(10**9)
        mx.eval(self.decoder.cache.arrays(), self.drafter.arrays())
        return time.perf_counter() - start


def median(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(repeats))


def measure(model, target_manifest, drafter, draft_manifest, contexts, gamma, repeats, dtype_bytes) -> list[dict]:
    rows = []
    for context in contexts:
        rig = Rig(model, drafter, context, gamma)
        counted = rig.stages(count=True)
        row = {"context": context, "gamma": gamma, "proposed": counted["proposed"],
               "accepted": counted["accepted"]}
        for stage in ("draft", "verify", "commit"):
            row[f"{stage}_ms"] = median(lambda s=stage, rig=rig: rig.stages()[s], repeats) * 1e3
            row[f"{stage}_primitives"] = counted[f"{stage}_primitives"]
        longest = rig.stages(force_accepted=gamma - 1)  # warm-up (and check)
        assert longest["accepted"] == gamma - 1
        row["commit_longest_ms"] = median(lambda rig=rig: rig.stages(force_accepted=gamma - 1)["commit"],
                                          repeats) * 1e3
        row["round_ms"] = median(rig.full_round, repeats) * 1e3
        row["round_primitives"] = sum(counted[f"{s}_primitives"] for s in ("draft", "verify", "commit"))
        draft = draft_bytes(draft_manifest, drafter.draft, context, gamma, dtype_bytes)
        verify = bytes_touched(target_manifest, model.args, 1 + gamma, context, dtype_bytes)
        commit = commit_bytes(model.args, counted["accepted"] + 1) + draft["append_weights"]
        row["bytes"] = {"draft": draft["total"], "verify": verify["total"], "commit": commit,
                        "round": draft["total"] + verify["total"] + commit}
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-forward", choices=sorted(PRESETS))
    ap.add_argument("--model", type=Path, help="a target (pack or checkpoint) instead of the synthetic one")
    ap.add_argument("--draft", type=Path, help="its draft (checkpoint or pack; with --model)")
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "round_latency.json")
    args = ap.parse_args()
    if (args.model is None) != (args.draft is None):
        ap.error("--model and --draft go together")

    from monolith.engine_setup import load_drafter
    from monolith.pack import read_manifest, resolve_pack

    work, target_pack, draft_src, model = load_pair(args)
    contexts = [int(c) for c in args.contexts.split(",")]
    dtype_bytes = 4 if args.dtype == "float32" else 2
    report = {"machine": platform.platform(), "mlx": mx.__version__, "dtype": args.dtype,
              "preset": None if args.model else PRESETS[args.preset], "block_size": args.block_size, "tables": {}}
    print(f"{'draft':>6} {'context':>8} {'draft ms':>9} {'verify ms':>10} {'commit ms':>10} {'commit l-1':>11} "
          f"{'round ms':>9} {'prims':>6} {'MB/round':>9} {'a/l':>5}")
    for label, quantization in (("bf16", "none"), ("nvfp4", "nvfp4")):
        drafter = load_drafter(draft_src, model, dtype=args.dtype, quantization=quantization,
                               cache_dir=work / "packs")
        draft_pack = resolve_pack(draft_src, role="draft", quantization=quantization, cache_dir=work / "packs")
        gamma = min(args.block_size, drafter.max_proposals)
        table = measure(model, read_manifest(target_pack), drafter, read_manifest(draft_pack), contexts, gamma,
                        args.repeats, dtype_bytes)
        report["tables"][label] = table
        for r in table:
            print(f"{label:>6} {r['context']:>8} {r['draft_ms']:9.2f} {r['verify_ms']:10.2f} {r['commit_ms']:10.2f} "
                  f"{r['commit_longest_ms']:11.2f} {r['round_ms']:9.2f} {r['round_primitives']:>6} "
                  f"{r['bytes']['round'] / 1e6:9.2f} {r['accepted']}/{r['proposed']:<3}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
