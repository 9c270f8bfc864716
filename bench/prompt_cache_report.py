"""The report of bench/prompt_cache.py: per-turn tables, hit rates and the goals
(warm TTFT against cold, tokens prefilled per turn, greedy text equal to the cold
server's, the restart's first TTFT, the memory bound), printed as markdown."""

from __future__ import annotations

import statistics


def key(row: dict) -> tuple[str, int]:
    return row["conversation"], row["turn"]


def cold_ttft(row: dict) -> float:
    return row.get("cold_ttft_s", row["ttft_s"])


def turn_table(title: str, cold: list[dict], runs: dict[str, list[dict]]) -> list[str]:
    ref = {key(r): r for r in cold}
    names = list(runs)
    lines = [f"### {title}", "", "| turn | prompt | new | cold TTFT s | "
             + " | ".join(f"{n} TTFT s | {n} prefilled | {n} same text" for n in names) + " |",
             "|---|---|---|---|" + "---|---|---|" * len(names)]
    order = [key(r) for r in next(iter(runs.values()))]
    for k in order:
        c = ref.get(k)
        cells = [f"{k[0]}{k[1]}", str(_first(runs, k, "prompt_tokens")), str(_first(runs, k, "new_tokens")),
                 f"{cold_ttft(c):.3f}" if c else "-"]
        for n in names:
            r = next((x for x in runs[n] if key(x) == k), None)
            if r is None:
                cells += ["-", "-", "-"]
                continue
            cells += [f"{r['ttft_s']:.3f}", str(r["prefilled"]), "-" if c is None else
                      ("yes" if (r["text"], r["tool_calls"]) == (c["text"], c["tool_calls"]) else "NO")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _first(runs: dict, k, field: str):
    for rows in runs.values():
        for r in rows:
            if key(r) == k:
                return r[field]
    return None


def hit_rate(rows: list[dict]) -> dict:
    prompt = sum(r["prompt_tokens"] or 0 for r in rows)
    cached = sum(r["cached_tokens"] or 0 for r in rows)
    return {"requests": len(rows), "requests_hit": sum(1 for r in rows if r["cached_tokens"]),
            "prompt_tokens": prompt, "cached_tokens": cached, "token_hit_rate": cached / prompt if prompt else None}


def goals(report: dict) -> list[dict]:
    cold = {key(r): r for r in report["cold"]["turns"]} if "turns" in report.get("cold", {}) else {}
    out = []

    def goal(name, passed, detail):
        out.append({"goal": name, "pass": passed, "detail": detail})

    for variant, run in report.get("warm", {}).items():
        rows = run["turns"][1:]  # the first request has nothing to reuse
        ratios = {key(r): r["ttft_s"] / cold_ttft(cold[key(r)]) for r in rows if key(r) in cold}
        if ratios:
            above = [f"{r['conversation']}{r['turn']} {ratios[key(r)]:.1%} ({r['new_tokens']} new tokens = "
                     f"{r['new_tokens'] / r['client_prompt_tokens']:.0%} of its prompt)"
                     for r in rows if ratios.get(key(r), 0) > 0.10]
            median = statistics.median(ratios.values())
            goal(f"warm TTFT <= 10% of cold ({variant}, the median turn)", median <= 0.10,
                 f"warm/cold TTFT over {len(ratios)} turns: median {median:.1%}, worst {max(ratios.values()):.1%}"
                 + (f"; above 10%: {', '.join(above)}" if above else ""))
        interval = run.get("interval")
        step = interval or 0
        over = [r for r in rows if r["prefilled"] is None or r["prefilled"] > r["new_tokens"] + step]
        goal(f"prefilled per warm turn <= new + one interval ({variant})", not over,
             f"interval {interval}: {len(rows) - len(over)}/{len(rows)} turns within; worst excess "
             f"{max((r['prefilled'] or 0) - r['new_tokens'] for r in rows)} tokens")
    for variant, run in [("warm " + v, r) for v, r in report.get("warm", {}).items()] + \
            [("restart", report.get("restart", {})), ("memory", report.get("memory", {}))]:
        rows = run.get("turns", []) + run.get("after_restart", [])
        compared = [r for r in rows if key(r) in cold]
        if compared:
            differ = [f"{r['conversation']}{r['turn']}" for r in compared
                      if (r["text"], r["tool_calls"]) != (cold[key(r)]["text"], cold[key(r)]["tool_calls"])]
            goal(f"greedy text equals cold ({variant})", not differ,
                 f"{len(compared) - len(differ)}/{len(compared)} turns equal" + (f"; differ: {differ}" if differ else ""))
    restart = report.get("restart", {})
    if restart.get("after_restart") and cold:
        first = restart["after_restart"][0]
        ratio = first["ttft_s"] / cold_ttft(cold[key(first)])
        goal("restart first TTFT <= 15% of cold", ratio <= 0.15,
             f"{first['conversation']}{first['turn']}: {first['ttft_s']:.3f} s vs cold "
             f"{cold_ttft(cold[key(first)]):.3f} s = {ratio:.1%} ({first['cached_tokens']} cached)")
    memory = report.get("memory", {})
    if "within_budget" in memory:
        goal("memory bound holds", memory["within_budget"],
             f"max {memory['max_bytes']} bytes held over {memory['scrapes']} scrapes, budget {memory['budget']}")
    return out


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def print_report(report: dict) -> None:
    st = report["settings"]
    print(f"\n{st['model']}: system prompt {st['system_tokens']} tokens with {st['tools']} tools, {st['turns']} turns "
          f"per conversation, max_tokens {st['max_tokens']}, save interval {st['save_every_used']}\n")
    cold = report.get("cold", {}).get("turns", [])
    runs = {f"warm {v}": r["turns"] for v, r in report.get("warm", {}).items()}
    if report.get("restart", {}).get("turns"):
        runs["restart"] = report["restart"]["turns"] + report["restart"]["after_restart"]
    if runs:
        print("\n".join(turn_table("TTFT and tokens prefilled per turn", cold, runs)))
    elif cold:
        print("\n".join(turn_table("cold", cold, {"cold": cold})))
    print("### hit rate and memory\n\n| run | requests hit | token hit rate | peak held | budget | saved states "
          "(end) | evictions (end) |\n|---|---|---|---|---|---|---|")
    for name, run in [("cold", report.get("cold", {}))] + [(f"warm {v}", r) for v, r in
                                                             report.get("warm", {}).items()] + \
            [("restart", report.get("restart", {})), ("memory", report.get("memory", {}))]:
        if run.get("turns"):
            h = run["hit_rate"]
            rate = "-" if h["token_hit_rate"] is None else f"{h['token_hit_rate']:.1%}"
            end = (run.get("after_restart") or run["turns"])[-1].get("metrics", {})
            print(f"| {name} | {h['requests_hit']}/{h['requests']} | {rate} | "
                  f"{_mib(run.get('peak', run.get('peak_first')))} | {_mib(end.get('budget'))} | "
                  f"{end.get('saved_states', '-')} | {end.get('evictions', '-')} |")
    if report.get("sweep"):
        print("\n### save interval\n\n| every | cold prefill s | overhead vs 0 | saved states | bytes | "
              "worst-case extra prefilled |\n|---|---|---|---|---|---|")
        for r in report["sweep"]:
            if "skipped" in r:
                print(f"| skipped: {r['skipped']} |")
                continue
            overhead = "-" if r["overhead_vs_0"] is None else f"{r['overhead_vs_0']:+.1%}"
            print(f"| {r['save_every']} | {r['cold_prefill_s']:.2f} | {overhead} | {r['saved_states']} | "
                  f"{_mib(r['bytes'])} | {r['extra_prefilled']} |")
    mlx = report.get("mlx_lm")
    if mlx and mlx.get("turns"):
        print(f"\n### mlx-lm {mlx['version']} (its own weights: texts are not expected to match)\n\n"
              "| turn | prompt | cached | processed (log) | new | TTFT s | its cache before the turn (log) |\n|---|---|---|---|---|---|---|")
        for r in mlx["turns"]:
            held = r["server_cache_before"] and f"{r['server_cache_before']['sequences']} sequences, {r['server_cache_before']['gb']} GB"
            print(f"| {r['conversation']}{r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                  f"{r['processed']} | {r['new_tokens']} | {r['ttft_s']:.3f} | {held} |")
    elif mlx:
        print(f"\nmlx-lm: {mlx.get('failed') or mlx.get('refused')}")
    print("\n### goals\n")
    for g in report["goals"]:
        print(f"- {'PASS' if g['pass'] else 'FAIL'}: {g['goal']}: {g['detail']}")
