"""What a decode step and a speculative round would cost on a Mac (docs/performance.md):
the bytes they read at the published depth, divided by an M5 Max-class bandwidth, plus a
per-primitive dispatch cost; for DSpark pairs and for the checkpoint's own MTP head
(docs/drafts.md 6). bench/real_widths.py's projection and its MTP section.

One MTP proposal is one forward of the head over one row: the target's embedding row,
`mtp.fc`, one full-attention decoder layer (the 35B's MoE reads only the routed and
shared experts of that row, as the target's MoE does; the 27B's dense MLP whole), the
final norm and the target's whole `lm_head`. k proposals are k sequential forwards, each
needing the token the previous one picked, and on Apple silicon nothing of them stays on
chip between steps (the head and the lm_head are hundreds of MB; the GPU's caches are
tens), so each step re-reads all of it. The lm_head is the biggest term. A DSpark block
reads its weights and the lm_head once for all its proposals. The first step of a round
also runs over the rows the verify accepted (tau of them on average), so the MoE head
reads that many rows' experts there.

A round with k MTP proposals: the target's verify of k + 1 rows (as DSpark's, with k + 1
rows), its commit, and the k steps. Its expected tokens, with a per-position acceptance
a (each proposal accepted with probability a once every earlier one was):
tau = 1 + a + ... + a^k.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import weight_bytes

ACCEPTANCE = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9)  # per-position acceptance swept (mlx-lm's MTP PR: 85-90% at step 1)
STEPS = (1, 2, 3, 4)  # proposals per round
BANDWIDTH = 614e9  # M5 Max 40-core, bytes/s
# M5 Max 40-core GPU, FP16/BF16 FLOP/s: its shader ALUs (the M4 Max's 18.4 TFLOPS, same core
# count), and the estimate for matmuls on its per-core neural accelerators (Apple: over 4x
# the M4's peak GPU compute for AI); bench/vision.py's compute floors
GPU_FLOPS = {"18 TFLOPS (ALUs)": 18.4e12, "70 TFLOPS (neural accelerators)": 70e12}
DISPATCH_US = (1.0, 2.0, 4.0)  # assumed cost of one dispatched primitive on an Apple GPU, microseconds
# the cost per primitive fitted on published M5 Max decode speeds of mlx-lm's own model
# (bench/calibration.py, bench/results/calibration.json); docs/mac.md quotes projections at it
CALIBRATED_DISPATCH_US = 1.24
MTP_DISPATCH_US = DISPATCH_US[1]
GAMMA = 7


def period_bytes(manifest: dict, rows: float, top_k: int, mtp: bool = False) -> tuple[int, int]:
    """(bytes of the non-layer entries, bytes of the decoder layers) that `rows` rows
    read: the embedding's rows, every other matrix whole, experts by the expected number
    of distinct experts among rows * top_k draws. The MTP head's entries (mtp.*) when
    `mtp`, else the target's."""
    fixed = layers = 0
    for name, size in weight_bytes(manifest).items():
        if name.startswith("mtp.") != mtp:
            continue
        entry = manifest["entries"].get(name, {})
        if name.endswith(("embed_tokens", "markov_w1")):  # row gathers
            size = int(size * rows) // entry["shape"][0]
        elif entry.get("kind") == "experts":
            experts = entry["shape"][0]
            distinct = experts * (1 - (1 - 1 / experts) ** (rows * top_k))
            size = int(size * distinct / experts)
        if ".layers." in name:
            layers += size
        else:
            fixed += size
    return fixed, layers


def target_bytes(manifest: dict, config: dict, depth: int, rows: int, context: int) -> dict:
    """Bytes one target forward of `rows` rows reads at the published depth: weights,
    gated-DeltaNet state read + written, KV read."""
    tc = config.get("text_config", config)
    layers, types = tc["num_hidden_layers"], tc["layer_types"]
    gdn_share = sum(t == "linear_attention" for t in types) / layers
    state = int(depth * gdn_share) * tc["linear_num_value_heads"] * tc["linear_value_head_dim"] * \
        tc["linear_key_head_dim"] * 4 * 2
    kv = int(depth * (1 - gdn_share)) * tc["num_key_value_heads"] * tc["head_dim"] * 2 * 2 * (context + rows)
    fixed, per_layers = period_bytes(manifest, rows, tc.get("num_experts_per_tok", 1))
    weights = fixed + per_layers * depth // layers
    return {"weights": weights, "state": state, "kv": kv, "total": weights + state + kv}


def projection(target_manifest: dict, draft_manifest: dict, config: dict, depth: int, context: int) -> dict:
    """Bytes (and their time floor at BANDWIDTH) of one decode step and one DSpark round
    (gamma = GAMMA) at the published depth."""
    out = {label: target_bytes(target_manifest, config, depth, rows, context)
           for label, rows in (("decode_step", 1), ("verify", GAMMA + 1))}
    draft_fixed, draft_layers = period_bytes(draft_manifest, GAMMA + 1, 1)
    draft_total = draft_fixed + draft_layers
    out["draft"] = {"weights": draft_total, "total": draft_total}
    out["round"] = {"total": out["verify"]["total"] + draft_total + out["verify"]["state"]}  # + the commit's write
    for value in out.values():
        value["floor_ms"] = value["total"] / BANDWIDTH * 1e3
    return out


def dispatch_terms(results: Path) -> dict:
    """Metal-path primitives per decode step and per round at 40 layers (bench/primitives.py)."""
    path = results / "primitives.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    step, rnd = data["decode"]["kernels"]["total"], data["round"]["kernels"]["total"]
    return {"decode_step": step, "round": rnd,
            "decode_step_ms": {f"{us} us": step * us / 1e3 for us in DISPATCH_US},
            "round_ms": {f"{us} us": rnd * us / 1e3 for us in DISPATCH_US}}


def count_mtp_step(model, target_pack: str, context_rows: int) -> int:
    """Primitives of one MTP proposal (a step over one row and its greedy pick), with the
    real MTPHead on `model` from its pack, after `context_rows` rows in its cache."""
    import mlx.core as mx

    from bench.common import count_primitives
    from monolith.models import load_mtp
    from monolith.models.layers import whole_graphs

    head = load_mtp(target_pack, model)
    cache = head.make_cache(context_rows + 32)
    hidden = mx.zeros((context_rows, model.args.hidden_size), model.dtype)
    out, _ = head(hidden, list(range(1, context_rows + 1)), cache)
    mx.eval(out, cache.arrays())
    with whole_graphs():
        out, logits = head(out[-1:], [1], cache)
        return count_primitives(mx.argmax(logits[-1]), out, *cache.arrays())


def mtp_step_bytes(manifest: dict, config: dict, rows: float, context: int) -> dict:
    """Bytes one MTP step over `rows` rows reads: the head's weights (experts by the
    expected distinct count), the target's embedding rows, final norm and lm_head, and
    the head's KV cache."""
    tc = config.get("text_config", config)
    top_k = tc.get("num_experts_per_tok", 1)
    head = sum(period_bytes(manifest, rows, top_k, mtp=True))
    shared, _ = period_bytes(manifest, rows, top_k)  # embedding rows, model.norm, lm_head
    lm_head = weight_bytes(manifest).get("lm_head", 0)
    kv = int(tc["num_key_value_heads"] * tc["head_dim"] * 2 * 2 * (context + rows))
    return {"head": head, "lm_head": lm_head, "embedding_and_norm": shared - lm_head, "kv": kv,
            "total": head + shared + kv}


def tau(a: float, k: int) -> float:
    return sum(a ** i for i in range(k + 1))


def mtp_round_ms(target_manifest: dict, config: dict, depth: int, context: int, k: int, a: float,
                 counts: dict, dispatch: dict) -> dict:
    """Bytes, floor ms and projected ms (floor + dispatch) of a round of k MTP proposals."""
    verify = target_bytes(target_manifest, config, depth, k + 1, context)
    first = mtp_step_bytes(target_manifest, config, tau(a, k), context)["total"]
    rest = mtp_step_bytes(target_manifest, config, 1, context)["total"] * (k - 1)
    total = verify["total"] + verify["state"] + first + rest  # + the commit's state write
    primitives = dispatch.get("round", 0) + k * counts["mtp_step"]
    ms = total / BANDWIDTH * 1e3 + primitives * MTP_DISPATCH_US / 1e3
    return {"bytes": total, "draft_bytes": first + rest, "primitives": primitives, "ms": ms,
            "tau": tau(a, k), "tok_s": tau(a, k) * 1e3 / ms}


def dspark_round(pair: dict, dispatch: dict, tau_value: float) -> dict:
    """A pair's DSpark round as the MTP rounds are projected: its bytes floor, the
    target's Metal-path round and the draft's proposal primitives at MTP_DISPATCH_US."""
    p, j = pair["serve"]["primitives"], pair["projection"]
    primitives = dispatch.get("round", 0) + p["draft_proposal"]
    ms = j["round"]["floor_ms"] + primitives * MTP_DISPATCH_US / 1e3
    return {"draft": pair["draft"], "bytes": j["round"]["total"], "draft_bytes": j["draft"]["total"],
            "primitives": primitives, "ms": ms, "tau": tau_value, "tok_s": tau_value * 1e3 / ms}


def best_mtp(target_manifest, config, depth, context, a, counts, dispatch) -> dict:
    rounds = [mtp_round_ms(target_manifest, config, depth, context, k, a, counts, dispatch) | {"k": k}
              for k in STEPS]
    return max(rounds, key=lambda r: r["tok_s"])


def crossover(target_manifest, config, depth, context, counts, dispatch, tok_s: float) -> float | None:
    """The least per-position acceptance at which MTP (its best k) reaches `tok_s`
    (bisection to 0.001), None where even a = 0.999 does not."""
    def speed(a):
        return best_mtp(target_manifest, config, depth, context, a, counts, dispatch)["tok_s"]

    lo, hi = 0.0, 0.999
    if speed(hi) < tok_s:
        return None
    if speed(lo) >= tok_s:
        return 0.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speed(mid) < tok_s else (lo, mid)
    return round(hi, 3)


def mtp_section(target_manifest: dict, config: dict, depth: int, context: int, counts: dict, dispatch: dict,
                pairs: list[dict], card_taus: dict) -> dict:
    """The MTP projection of one target layout beside its DSpark pairs at their
    published acceptance lengths (card_taus: draft layout -> taus)."""
    section = {"primitives_per_step": counts["mtp_step"], "dispatch_us": MTP_DISPATCH_US, "context": context,
               "step_bytes": mtp_step_bytes(target_manifest, config, 1, context),
               "rounds": [mtp_round_ms(target_manifest, config, depth, context, k, a, counts, dispatch)
                          | {"k": k, "a": a} for a in ACCEPTANCE for k in STEPS],
               "dspark": []}
    for pair in pairs:
        for t in card_taus.get(pair["draft"], ()):
            row = dspark_round(pair, dispatch, t)
            row["mtp_wins_from_acceptance"] = crossover(target_manifest, config, depth, context, counts, dispatch,
                                                        row["tok_s"])
            section["dspark"].append(row)
    return section


def mtp_lines(report: dict) -> list[str]:
    """The markdown tables of the MTP sections."""
    lines = [("\n## The MTP head's round beside DSpark's\n\nPer round, at the published depth: bytes over "
             f"{BANDWIDTH / 1e9:.0f} GB/s plus {MTP_DISPATCH_US} us per primitive (the target round's Metal-path "
             "count, the draft's CPU-graph count: k MTP steps, one DSpark block); an MTP round verifies k + 1 rows "
             "and yields 1 + a + ... + a^k tokens at per-position acceptance a; DSpark at its card's tau "
             "(docs/performance.md).")] if report.get("mtp") else []
    for layout, s in report.get("mtp", {}).items():
        b = s["step_bytes"]
        lines += [(f"\n### MTP head of {layout}: one step reads {b['total'] / 1e6:.0f} MB (head "
                  f"{b['head'] / 1e6:.0f}, lm_head {b['lm_head'] / 1e6:.0f}, embedding row and norm "
                  f"{b['embedding_and_norm'] / 1e6:.2f}, KV {b['kv'] / 1e6:.2f}); {s['primitives_per_step']} "
                  f"primitives a step (CPU graph)\n"),
                  "| a (per position) | " + " | ".join(f"k={k} ms / tau / tok/s" for k in STEPS) + " |",
                  "|---|" + "---|" * len(STEPS)]
        for a in ACCEPTANCE:
            cells = [r for r in s["rounds"] if r["a"] == a]
            lines.append(f"| {a} | " + " | ".join(f"{r['ms']:.1f} / {r['tau']:.2f} / {r['tok_s']:.0f}"
                                                  for r in cells) + " |")
        lines += [("\n| DSpark draft | tau (card) | round MB (draft MB) | primitives | ms | tok/s "
                  "| MTP wins from a = |"), "|---|---|---|---|---|---|---|"]
        for d in s["dspark"]:
            wins = "never (a < 1)" if d["mtp_wins_from_acceptance"] is None else d["mtp_wins_from_acceptance"]
            lines.append(f"| {d['draft']} | {d['tau']} | {d['bytes'] / 1e6:.0f} ({d['draft_bytes'] / 1e6:.0f}) "
                         f"| {d['primitives']} | {d['ms']:.1f} | {d['tok_s']:.0f} | {wins} |")
    return lines
