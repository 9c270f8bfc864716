"""The Mac projection calibrated on published measurements: bench/projection.py's model
(the bytes a step reads over the bandwidth, plus a cost per dispatched primitive) run
over mlx-lm's own model at the published widths (bench/mlx_lm_graph.py: its primitives
counted as bench/primitives.py counts monolith's, its bytes as its 4-bit checkpoint
holds them), against plain-decode speeds others published on an Apple M5 Max. One
dispatch constant is fitted (minimax of |log(projected / published)| over the decode
points) and each point's error is reported; the prefill points are projected too, from
FLOPs over projection.GPU_FLOPS's ALU rate, and reported, not fitted: they are compute
bound, and the dispatch term is under 1% of their time. Then monolith's own projections
(bench/results/real_widths.json's bytes floors and bench/primitives.py's Metal-path
counts) at the fitted constant, with the fit's largest error as their band.

    python -m bench.calibration [--real-widths bench/results/real_widths.json] [--out ...]

Writes bench/results/calibration.json and .md (docs/mac.md section 5).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import mlx.core as mx

from bench.common import package_version
from bench.mlx_lm_graph import PREFILL_STEP, measure
from bench.projection import BANDWIDTH, CALIBRATED_DISPATCH_US, GPU_FLOPS

RESULTS = Path(__file__).parent / "results"
ALU_FLOPS = GPU_FLOPS["18 TFLOPS (ALUs)"]
BOUND = 0.20  # |error| every point used must stay within
TAUS = (3.0, 3.96)  # DSpark tokens a round: the demo pair's, Koopah's card (bench/real_widths.py)

DFLASH = ("bstnxbt/dflash-mlx README.md, Benchmarks table, Baseline column (stock mlx_lm.stream_generate, "
          "3 repeats, median; read at commit 1fe76ec)")
MAC_MLX = "magicnight/Mac-MLX issue 24 ([benchmark] Qwen3.5-35B-A3B-4bit on Apple M5 Max), its JSON"
MLX_LM_1480 = ("ml-explore/mlx-lm issue 1480 (as monolith's issue 47 quotes it; the thread itself was not "
               "among the copies this was checked against)")
DFLASH_CHIP = "Apple M5 Max, 64 GB, MLX 0.31.1"
DFLASH_PROMPT = 100  # its one math prompt with the chat template, about 100 tokens

MAC_MLX_CHIP = "Apple M5 Max, 128 GB, macOS 26.4.1"
PREFILL_WHY = ("compute bound: projected from FLOPs over the ALU rate (18.4 TFLOPS); the dispatch constant moves it "
               "by about 1%, so it says nothing of the constant. ")


def point(kind, runtime, model, prompt, tokens, published, source, chip, why=None) -> dict:
    """A published point; `why` says why the fit leaves it out (None: the fit uses it)."""
    return {"kind": kind, "runtime": runtime, "model": model, "prompt_tokens": prompt, "generated_tokens": tokens,
            "published": published, "source": source, "chip": chip, "used": why is None, "why_not_used": why}


POINTS = [
    point("decode", "mlx-lm", "Qwen3.6-35B-A3B", DFLASH_PROMPT, 1024, 138.26, DFLASH, DFLASH_CHIP),
    point("decode", "mlx-lm", "Qwen3.6-35B-A3B", DFLASH_PROMPT, 8192, 133.20, DFLASH, DFLASH_CHIP),
    point("decode", "mlx-lm", "Qwen3.6-27B", DFLASH_PROMPT, 1024, 33.26, DFLASH, DFLASH_CHIP),
    point("decode", "mlx-swift-lm 3.31.3", "Qwen3.5-35B-A3B", 1479, 2023, 133.478, MAC_MLX, MAC_MLX_CHIP),
    point("decode", "mlx-lm", "Qwen3.6-27B", DFLASH_PROMPT, 8192, 26.03, DFLASH, DFLASH_CHIP,
          "the dense 27B's decode slows from 33.3 tok/s (1K tokens) to 26.0 (8K) in the same table: 8.4 ms more "
          "a token, of which its KV cache's extra bytes (0.23 GB a step) explain 0.4 ms. The dispatch count does "
          "not grow with the context, so no constant fits both; the projection has no term for this long-context "
          "slowdown (the 35B, with 10 attention layers of 2 KV heads to the 27B's 16 of 4, loses 4%), so its "
          "27B figures hold at short contexts"),
    point("prefill", "mlx-lm", "Qwen3.6-35B-A3B", 8192, 0, 3909.0, MLX_LM_1480, "Apple M5 Max",
          PREFILL_WHY + "It falls within the bound at that rate."),
    point("prefill", "mlx-lm", "Qwen3.6-35B-A3B", 65536, 0, 2388.0, MLX_LM_1480, "Apple M5 Max",
          PREFILL_WHY + "Outside the bound: the rate it implies is above the ALU rate (MLX runs matmuls on the "
          "M5's neural accelerators, its NAX kernels; projection.GPU_FLOPS' 70 TFLOPS estimate for them "
          "overshoots every prefill point three- to fivefold). The 8K and 64K points imply nearly the same rate, so "
          "the attention term's growth with the prompt is right."),
    point("prefill", "mlx-swift-lm 3.31.3", "Qwen3.5-35B-A3B", 1479, 0, 2756.567, MAC_MLX, MAC_MLX_CHIP,
          PREFILL_WHY + "Outside the bound, the other way: a short prompt (one timing of 1479 tokens, 536 ms to "
          "the first token, fixed costs included), where each of the 256 experts' matmuls sees few rows."),
]


def model_for(name: str) -> str:
    """The widths a published model is counted at (Qwen3.5-35B-A3B has Qwen3.6-35B-A3B's
    architecture: mlx-lm runs both as qwen3_5_moe)."""
    return name.replace("Qwen3.5-35B-A3B", "Qwen3.6-35B-A3B")


def decode_bytes(m: dict, context: float) -> float:
    return m["weight_bytes"] + m["state_bytes"] + m["kv_bytes_per_row"] * context


def decode_ms(bytes_per_token: float, primitives: float, dispatch_us: float, bandwidth: float = BANDWIDTH) -> float:
    """One decode step: its bytes over the bandwidth plus its primitives at dispatch_us each."""
    return bytes_per_token / bandwidth * 1e3 + primitives * dispatch_us / 1e3


def prefill_flops(m: dict, prompt: int) -> float:
    """FLOPs of a prompt's prefill in chunks of PREFILL_STEP rows: 2 per multiply-add of
    the matrices, the gated-DeltaNet recurrence per row, causal attention over every
    earlier row (the chunk's own triangle, every row before it)."""
    total, done = 0.0, 0
    while done < prompt:
        rows = min(PREFILL_STEP, prompt - done)
        pairs = rows * done + rows * (rows + 1) / 2
        total += rows * (2 * m["matmul_params_per_row"] + m["gdn_flops_per_row"])
        total += m["attention_flops_per_pair"] * pairs
        done += rows
    return total


def prefill_s(m: dict, prompt: int, dispatch_us: float, flops_rate: float = ALU_FLOPS) -> float:
    chunks = math.ceil(prompt / PREFILL_STEP)
    return prefill_flops(m, prompt) / flops_rate + chunks * m["prefill_chunk_primitives"] * dispatch_us / 1e6


def point_terms(kind: str, m: dict, prompt: int, tokens: int) -> dict:
    """What a point's projection needs, its constant aside."""
    if kind == "decode":
        context = prompt + tokens / 2  # the mean context over the run
        return {"context": context, "bytes_per_token": decode_bytes(m, context),
                "primitives": m["decode_primitives"]}
    return {"flops": prefill_flops(m, prompt), "chunks": math.ceil(prompt / PREFILL_STEP),
            "primitives": m["prefill_chunk_primitives"]}


def projected(row: dict, dispatch_us: float) -> float:
    """A point's projected tok/s at dispatch_us."""
    if row["kind"] == "decode":
        return 1e3 / decode_ms(row["bytes_per_token"], row["primitives"], dispatch_us)
    seconds = row["flops"] / ALU_FLOPS + row["chunks"] * row["primitives"] * dispatch_us / 1e6
    return row["prompt_tokens"] / seconds


def worst_log_error(rows: list[dict], dispatch_us: float) -> float:
    return max(abs(math.log(projected(r, dispatch_us) / r["published"])) for r in rows)


def fit(rows: list[dict], low: float = 0.0, high: float = 20.0) -> float:
    """The dispatch constant (us) that minimizes the largest |log(projected / published)|
    over `rows`, to 0.01 us (each row's log error is monotone in it, so the largest is
    unimodal: a ternary search)."""
    for _ in range(100):
        a, b = low + (high - low) / 3, high - (high - low) / 3
        low, high = (low, b) if worst_log_error(rows, a) <= worst_log_error(rows, b) else (a, high)
    return round((low + high) / 2, 2)


def points(measured: dict) -> list[dict]:
    rows = []
    for p in POINTS:
        m = measured[model_for(p["model"])]
        rows.append({**p, "counted_as": model_for(p["model"]),
                     **point_terms(p["kind"], m, p["prompt_tokens"], p["generated_tokens"])})
    return rows


def evaluate(rows: list[dict], dispatch_us: float) -> None:
    for r in rows:
        r["projected"] = round(projected(r, dispatch_us), 2)
        r["error"] = round(r["projected"] / r["published"] - 1, 4)
        r["within_bound"] = abs(r["error"]) <= BOUND
        if r["kind"] == "prefill":  # the rate that would make the projection exact
            seconds = r["prompt_tokens"] / r["published"] - r["chunks"] * r["primitives"] * dispatch_us / 1e6
            r["implied_tflops"] = round(r["flops"] / seconds / 1e12, 1)
        else:
            r["implied_tflops"] = None


def monolith_rows(real_widths: dict, dispatch_us: float, band: float) -> list[dict]:
    """monolith's plain decode and DSpark rounds at the published depth (real_widths.json's
    bytes floors, bench/primitives.py's Metal-path counts of the 35B at 40 layers, the
    draft's CPU-graph proposal count) at the fitted constant."""
    d = real_widths["dispatch_40_layers"]
    rows = []
    for pair in real_widths["pairs"]:
        j, draft = pair["projection"], pair["serve"]["primitives"]["draft_proposal"]
        step = decode_ms(0, d["decode_step"], dispatch_us) + j["decode_step"]["floor_ms"]
        rnd = decode_ms(0, d["round"] + draft, dispatch_us) + j["round"]["floor_ms"]
        row = {"target": pair["target"], "draft": pair["draft"], "step_ms": round(step, 2),
               "plain_tok_s": round(1e3 / step, 1), "round_ms": round(rnd, 2),
               "round_primitives": d["round"] + draft}
        row["plain_band"] = [round(1e3 / step * (1 - band), 1), round(1e3 / step * (1 + band), 1)]
        for t in TAUS:
            rate = t * 1e3 / rnd
            row[f"tau_{t}_tok_s"] = round(rate, 1)
            row[f"tau_{t}_band"] = [round(rate * (1 - band), 1), round(rate * (1 + band), 1)]
        rows.append(row)
    return rows


def calibrate(real_widths_path: Path) -> dict:
    measured = {name: measure(name) for name in ("Qwen3.6-35B-A3B", "Qwen3.6-27B")}
    for m in measured.values():
        m["decode_primitives"] = m["decode_primitives"]["1024"]  # the count does not depend on the context
    rows = points(measured)
    constant = fit([r for r in rows if r["used"]])
    evaluate(rows, constant)
    used = [r for r in rows if r["used"]]
    band = max(abs(r["error"]) for r in used)
    report = {"mlx": mx.__version__, "mlx_lm": package_version("mlx-lm"), "bandwidth": BANDWIDTH,
              "alu_flops": ALU_FLOPS,
              "dispatch_us": constant, "fit": {"method": "minimax |log(projected / published)| over the used points",
                                               "bound": BOUND, "largest_error": band, "points_used": len(used),
                                               "all_used_within_bound": all(r["within_bound"] for r in used)},
              "mlx_lm_models": measured, "points": rows, "monolith": []}
    if real_widths_path.is_file():
        report["monolith"] = monolith_rows(json.loads(real_widths_path.read_text()), constant, band)
    return report


def lines(report: dict) -> list[str]:
    f = report["fit"]
    out = [f"Dispatch constant: **{report['dispatch_us']} us** per primitive (one for every point used), "
           f"bandwidth {report['bandwidth'] / 1e9:.0f} GB/s; largest error over the {f['points_used']} points "
           f"used: {100 * f['largest_error']:.1f}% (bound {100 * f['bound']:.0f}%).\n",
           "| kind | runtime | model | prompt + generated | published tok/s | projected | error | used | source |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in report["points"]:
        out.append(f"| {r['kind']} | {r['runtime']} | {r['model']} | {r['prompt_tokens']} + {r['generated_tokens']} "
                   f"| {r['published']} | {r['projected']} | {100 * r['error']:+.1f}% "
                   f"| {'yes' if r['used'] else 'no'} | {r['source'].split(',')[0]} |")
    out.append("\nNot used:\n")
    out += [f"- {r['kind']} {r['model']} {r['prompt_tokens']} + {r['generated_tokens']}: {r['why_not_used']}"
            + (f" Implied rate: {r['implied_tflops']} TFLOPS." if r["implied_tflops"] else "")
            for r in report["points"] if not r["used"]]
    if report["monolith"]:
        band = 100 * f["largest_error"]
        out += [f"\nmonolith at {report['dispatch_us']} us (band: +-{band:.0f}%, the fit's largest error):\n",
                "| target + draft | plain tok/s | round ms | " + " | ".join(f"tau {t} tok/s" for t in TAUS) + " |",
                "|---|---|---|" + "---|" * len(TAUS)]
        for r in report["monolith"]:
            cells = " | ".join(f"{r[f'tau_{t}_tok_s']:.0f} ({r[f'tau_{t}_band'][0]:.0f}-{r[f'tau_{t}_band'][1]:.0f})"
                               for t in TAUS)
            out.append(f"| {r['target']} + {r['draft']} | {r['plain_tok_s']:.0f} ({r['plain_band'][0]:.0f}-"
                       f"{r['plain_band'][1]:.0f}) | {r['round_ms']:.1f} | {cells} |")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real-widths", type=Path, default=RESULTS / "real_widths.json")
    ap.add_argument("--out", type=Path, default=RESULTS / "calibration.json")
    args = ap.parse_args(argv)
    report = calibrate(args.real_widths)
    text = "\n".join(lines(report))
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(f"# calibration\n\n`python -m bench.calibration` "
                                           f"(docs/mac.md section 5)\n\n{text}\n")
    if report["dispatch_us"] != CALIBRATED_DISPATCH_US:
        print(f"the fit ({report['dispatch_us']} us) differs from projection.CALIBRATED_DISPATCH_US "
              f"({CALIBRATED_DISPATCH_US} us): update it and the figures docs/mac.md quotes")
    print(f"wrote {args.out} and .md")
    return report


if __name__ == "__main__":
    main()
