"""bench/acceptance.py's summary (pooled tau with a bootstrap interval, per-position
acceptance, matched prefix, the goals), its printed tables and its JSON layout."""

from __future__ import annotations

import json

import numpy as np

GOAL_TAU, GOAL_RATIO, GOAL_SPEEDUP, GOAL_GAMMA = 3.0, 0.97, 1.5, 7


def fmt(x, spec: str, width: int) -> str:
    return format("-" if x is None else format(x, spec), f">{width}")


def positions(values) -> str:
    return " ".join("   -" if v is None else f"{v:.2f}" for v in values)


def print_rows(rows: list[dict], prompts: int) -> None:
    print(f"\n{'prompt':>6} {'mode':>7} {'draft':>6} {'tok/s':>8} {'speedup':>8} {'tau':>6} {'acc/prop':>9} "
          f"{'same':>5} {'matched':>8}")
    for index in range(prompts):
        mp = {r["draft"]: r for r in rows if r["prompt"] == index and r["mode"] == "matched_prefix"}
        for r in rows:
            if r["prompt"] != index or r["mode"] == "matched_prefix":
                continue
            spec = r["draft"] != "plain"
            match = mp[r["draft"]]["matched_prefix"] if spec and r["mode"] == "greedy" else None
            print(f"{index:>6} {r['mode']:>7} {r['draft']:>6} {r['decode_tok_s']:8.1f} {r['speedup']:8.2f} "
                  f"{fmt(r.get('tau'), '.2f', 6)} "
                  f"{(str(r['accepted']) + '/' + str(r['proposed'])) if spec else '-':>9} "
                  f"{str(r['same_as_plain']) if 'same_as_plain' in r else '-':>5} {fmt(match, '.2f', 8)}")


def print_summary(summary: dict, modes, drafters, gamma: int, break_even: float, info: dict) -> None:
    print(f"\nsummary (tau and per-position acceptance pooled over all rounds; tok/s and speedup: medians over "
          f"prompts; matched prefix: mean over {summary['greedy/nvfp4']['matched_prefix_anchors']} anchors, "
          f"greedy proposals, out of {gamma})")
    print(f"{'mode':>7} {'draft':>6} {'tau':>6} {'tau 95%':>11} {'tok/s':>7} {'speedup':>7} {'matched':>9} "
          f"{'same':>5}  per-position acceptance 1..{gamma}")
    for mode in modes:
        for label in ("plain", *drafters):
            s = summary[f"{mode}/{label}"]
            pos = positions(s["per_position_acceptance"]) if "per_position_acceptance" in s else ""
            matched = f"{s['matched_prefix']:.2f}/{gamma}" if s.get("matched_prefix") is not None else "-"
            ci = f"{s['tau_ci95'][0]:.2f}-{s['tau_ci95'][1]:.2f}" if "tau_ci95" in s else "-"
            print(f"{mode:>7} {label:>6} {fmt(s.get('tau'), '.3f', 6)} {ci:>11} {s['decode_tok_s']:7.1f} "
                  f"{s['speedup']:7.2f} {matched:>9} {str(s['same_as_plain']) if 'same_as_plain' in s else '-':>5}  "
                  f"{pos}")
        if mode == "greedy":
            for label in drafters:
                s = summary[f"greedy/{label}"]
                print(f"{'':>7} {label:>6} matched-prefix per position (of anchors matching all before): "
                      f"{positions(s['matched_prefix_per_position'])}")
    for mode in modes:
        s = summary[f"{mode}/served"]
        print(f"{mode:>7} served: NVFP4 draft with serve's fallback (break-even {break_even:.2f} tokens/round): "
              f"{s['decode_tok_s']:.1f} tok/s, {s['speedup']:.2f}x plain, {s['drafted_rounds']} drafted and "
              f"{s['plain_rounds']} plain rounds")
    if "bf16" in drafters:
        taus = ", ".join(f"tau {mode} {summary[f'nvfp4_over_bf16_tau_{mode}']:.3f}" for mode in modes)
        print(f"NVFP4/BF16 draft: matched prefix {summary['nvfp4_over_bf16_matched_prefix']:.3f}, {taus}")
    else:
        print(f"NVFP4/BF16 draft: not measured ({info['bf16_note']})")


def print_goals(summary: dict, modes, have_bf16: bool) -> None:
    print("\ngoals:")
    goal_rows = summary["goals"]
    for g in goal_rows:
        verdict = "n/a" if g["met"] is None else "met" if g["met"] else "NOT met"
        value = "-" if g["value"] is None else f"{g['value']:.3f}"
        extra = []
        if g is goal_rows[0] and have_bf16:
            extra.append(f"BF16 draft {summary['greedy/bf16']['tau']:.3f}")
        if g is goal_rows[2]:
            extra += [f"BF16 draft {summary['greedy/bf16']['speedup']:.2f}x"] if have_bf16 else []
            extra += [f"{m} NVFP4 {summary[f'{m}/nvfp4']['speedup']:.2f}x" for m in modes if m != "greedy"]
        if g["note"]:
            extra.append(g["note"])
        print(f"  [{verdict:>7}] {g['goal']}: {value}" + (f" ({'; '.join(extra)})" if extra else ""))


def report_json(report: dict, tables: tuple[str, ...]) -> str:
    """The report as indented JSON, except the lists in `tables`: one line per row."""
    text = json.dumps({k: v for k, v in report.items() if k not in tables}, indent=1)[:-2]
    for key in tables:
        text += f',\n "{key}": [\n' + ",\n".join("  " + json.dumps(row) for row in report[key]) + "\n ]"
    return text + "\n}\n"


def pooled_positions(rows: list[dict], gamma: int) -> list[float | None]:
    acc = [sum(r["accepted_per_position"][j] for r in rows) for j in range(gamma)]
    reached = [sum(r["reached_per_position"][j] for r in rows) for j in range(gamma)]
    return [a / n if n else None for a, n in zip(acc, reached)]


def tau_interval(rows: list[dict], resamples: int = 4000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of the pooled tau over prompts (prompts resampled with
    replacement): acceptance varies far more from prompt to prompt than within one."""
    accepted = np.array([r["accepted"] for r in rows], dtype=np.float64)
    rounds = np.array([r["rounds"] for r in rows], dtype=np.float64)
    pick = np.random.default_rng(seed).integers(0, len(rows), (resamples, len(rows)))
    taus = (accepted[pick].sum(1) + rounds[pick].sum(1)) / rounds[pick].sum(1)
    return [float(v) for v in np.percentile(taus, [2.5, 97.5])]


def matched_positions(histogram: list[int], gamma: int) -> list[float | None]:
    """Conditional match rate by position: anchors matching j + 1 of those matching j."""
    at_least = [sum(histogram[j:]) for j in range(gamma + 1)]
    return [at_least[j + 1] / at_least[j] if at_least[j] else None for j in range(gamma)]


def draft_summary(rows: list[dict], mode: str, label: str, gamma: int) -> dict:
    mine = [r for r in rows if r["mode"] == mode and r["draft"] == label]
    entry = {"decode_tok_s": float(np.median([r["decode_tok_s"] for r in mine])),
             "speedup": float(np.median([r["speedup"] for r in mine]))}
    if label == "plain":
        return entry
    rounds = sum(r["rounds"] for r in mine)
    entry["tau"] = (sum(r["accepted"] for r in mine) + rounds) / rounds  # pooled over rounds
    entry["tau_ci95"] = tau_interval(mine)
    entry["rounds"] = rounds
    entry["per_position_acceptance"] = pooled_positions(mine, gamma)
    if mode == "greedy":
        entry["same_as_plain"] = all(r["same_as_plain"] for r in mine)
        histogram = np.sum([r["histogram"] for r in rows if r["mode"] == "matched_prefix" and r["draft"] == label],
                           axis=0)
        anchors = int(histogram.sum())
        entry["matched_prefix"] = float(histogram @ np.arange(gamma + 1)) / anchors if anchors else None
        entry["matched_prefix_anchors"] = anchors
        entry["matched_prefix_per_position"] = matched_positions(histogram.tolist(), gamma)
    return entry


def summarize(rows, served_rows, modes, drafters, gamma: int, break_even: float) -> dict:
    summary: dict = {f"{mode}/{label}": draft_summary(rows, mode, label, gamma)
                     for mode in modes for label in ("plain", *drafters)}
    have_bf16 = "bf16" in drafters

    def ratio(key: str, mode: str = "greedy"):
        if not have_bf16:
            return None
        bf16, nvfp4 = summary[f"{mode}/bf16"][key], summary[f"{mode}/nvfp4"][key]
        return nvfp4 / bf16 if bf16 else None

    summary["nvfp4_over_bf16_matched_prefix"] = ratio("matched_prefix")
    for mode in modes:
        summary[f"nvfp4_over_bf16_tau_{mode}"] = ratio("tau", mode)
    summary["goals"] = goals(summary, gamma, have_bf16)
    for mode in modes:
        mine = [r for r in served_rows if r["mode"] == mode]
        summary[f"{mode}/served"] = {"decode_tok_s": float(np.median([r["decode_tok_s"] for r in mine])),
                                     "speedup": float(np.median([r["speedup"] for r in mine])),
                                     "drafted_rounds": sum(r["drafted_rounds"] for r in mine),
                                     "plain_rounds": sum(r["plain_rounds"] for r in mine),
                                     "break_even": break_even}
    return summary


def goals(summary: dict, gamma: int, have_bf16: bool) -> list[dict]:
    served, ratio = summary["greedy/nvfp4"], summary["nvfp4_over_bf16_matched_prefix"]
    return [
        {"goal": f"tau >= {GOAL_TAU} at gamma {GOAL_GAMMA}, greedy, held-out prompts (NVFP4 draft)",
         "value": served["tau"], "met": served["tau"] >= GOAL_TAU and gamma == GOAL_GAMMA,
         "note": (f"95% interval over prompts {served['tau_ci95'][0]:.2f}-{served['tau_ci95'][1]:.2f}"
                  + ("" if gamma == GOAL_GAMMA else f"; measured at gamma {gamma}, not {GOAL_GAMMA}"))},
        {"goal": f"NVFP4 draft keeps >= {GOAL_RATIO:.0%} of the BF16 draft's matched-prefix acceptance",
         "value": ratio, "met": None if ratio is None else ratio >= GOAL_RATIO,
         "note": None if have_bf16 else "not measured: no BF16 draft"},
        {"goal": f"speculative >= {GOAL_SPEEDUP}x plain tok/s (greedy, NVFP4 draft, median over prompts)",
         "value": served["speedup"], "met": served["speedup"] >= GOAL_SPEEDUP, "note": None},
    ]
