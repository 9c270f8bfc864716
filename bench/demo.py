"""The demo pair as an assistant (issue 53): its target's greedy replies to held-out
chat transcripts (packs/demo/assistant_data.py, `build(held=True)`: functions of the
corpus's held-out files, held-out cities and time zones), judged as the server would
read them.

    python -m bench.demo [--pair DIR] [--count 240] [--max-tokens 96] [--seed 0] [--json FILE]

DIR is a packs/demo recipe output (DIR/target, packs cached in DIR/packs) or the bundle
packs/demo (the default; its packs are built and checked as the first start of serve
does). Each transcript is cut before one assistant turn; the prompt is what the server
renders for the messages before it (the pair's chat template, the transcript's tools and
template arguments), and the reply is decoded greedily up to --max-tokens, stopping at
the tokenizer's end-of-sequence ids. The reply's reasoning is split off with the server's
ReasoningSplitter, and its calls read from the rest with the server's parse_tool_calls
(serving/tools/calls.py) over the tools offered. Measures:
- stdlib: the share of questions about a held-out function whose reply contains at least
  half of the docstring's key words (assistant_data.key_words: its first sentence's
  first four words of 4+ letters, stop words left out), and the mean share of key words;
- tool: the share of requests a tool serves answered with a valid call to the right
  tool: the parser's first call names it, is whole, and its arguments are a JSON object
  valid under the tool's parameter schema (jsonschema); beside it, the share whose
  arguments are exactly the expected ones;
- no tool: the share of stdlib questions and small talk with tools offered answered
  without a call;
- ended: the share of all replies that end by themselves (a stop token) within
  --max-tokens. Goals (issue 53): tool >= 90%, ended >= 95%.
Each is measured as served ("summary": where tools are offered, decoded as serve decodes
tool_choice "auto", a call the model opens held to an offered tool and its schema by the
grammar of serving/structured.py) and of the model alone ("summary_without_grammar": the
tool-offering cases decoded again with no grammar; the goals are judged on the first).
Transcripts of kind "source" (code listings) are left out: they are meant to run long.
Writes the JSON (default bench/results/demo.json): settings, machine, "summary", "rows".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import jsonschema

from bench.common import RESULTS, machine

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "packs" / "demo"
GOALS = {"tool": 0.9, "ended": 0.95}
AGENT_PROMPT_CHARS = 100  # a system message longer than this is a coding agent's (assistant_data.py)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_data():
    """packs/demo/assistant_data.py, with the recipe's modules it imports by their plain
    names (corpus, tools_data, agent_prompts), as the recipe runs them."""
    for name in ("corpus", "tools_data", "agent_prompts", "assistant_data"):
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, DEMO / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    return sys.modules["assistant_data"]


def load(pair: Path):
    """(the target as served, F32 compute; its tokenizer)."""
    from monolith.engine_setup import load_target
    from monolith.pack import resolve_pack
    from monolith.tokenizer import load_tokenizer

    cache = None
    if (pair / "expected.json").is_file():
        from monolith.pack.demo import demo_pair

        demo_pair(log, bundle=pair)  # builds (first use) and checks the packs
    else:
        cache = pair / "packs"
    pack = resolve_pack(pair / "target", role="target", cache_dir=cache)
    return load_target(pack, dtype="float32"), load_tokenizer(pair / "target")


def cases(data, seed: int, count: int) -> list[dict]:
    """Held-out transcripts cut before the assistant turn each one judges: a stdlib or
    no-tool question's first answer, a tool request's call, a tool result's answer."""
    out = []
    for t in data.build(seed, held=True, count=count):
        kind, messages = t["kind"], t["messages"]
        first = t["start"]  # the final exchange's user message (after a system message, earlier exchanges)
        if kind == "source":
            continue
        if kind in ("tool_call", "tool_answer"):  # the call
            call = messages[first + 1]["tool_calls"][0]["function"]
            out.append({**t, "kind": "tool", "messages": messages[:first + 2],
                        "expect": {"tool": call["name"], "arguments": call["arguments"]}})
            if kind == "tool_answer":
                out.append({**t, "messages": messages[:first + 4]})
        else:
            out.append({**t, "messages": messages[:first + 2]})
    return out


def reply(model, tokenizer, data, case: dict, max_tokens: int, vocabulary=None) -> dict:
    """The target's greedy reply to the case's prompt, read as the server reads it; with
    the `vocabulary` (a GrammarTokenizer) and tools offered, decoded as serve decodes
    tool_choice "auto": a call the model opens is held to an offered tool and its schema."""
    from monolith.runtime.decoder import Decoder
    from monolith.runtime.generation import Generation
    from monolith.sampling import SamplingParams
    from monolith.serving import structured
    from monolith.serving.reasoning import ReasoningSplitter, prompt_opens_reasoning
    from monolith.serving.tools.calls import parse_tool_calls

    prompt, _ = data.render(tokenizer, case)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    decoder = Decoder(model, None, len(ids) + max_tokens + 8)
    guide = None
    if vocabulary is not None and case["tools"]:
        structure = structured.calls_once_opened(case["tools"], tokenizer)
        guide = vocabulary.guide(structured.grammar(structure, tokenizer, reasoning_open=False))
    r = decoder(Generation(ids, max_tokens, SamplingParams(temperature=0.0), frozenset(tokenizer.eos_token_ids),
                           guide=guide))
    text = tokenizer.decode(r.token_ids)
    splitter = ReasoningSplitter(prompt_opens_reasoning(prompt))
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    ended = r.finish_reason == "stop"
    calls = []
    if case["tools"]:
        content, calls = parse_tool_calls(content + more_content, case["tools"], cut=not ended)
    else:
        content = content + more_content
    return {"kind": case["kind"], "prompt_tokens": len(ids), "tokens": len(r.token_ids), "ended": ended,
            "reasoning": reasoning + more_reasoning, "content": content or "",
            "calls": [{"name": c.name, "arguments": c.arguments, "whole": c.whole} for c in calls]}


def judge(row: dict, case: dict) -> dict:
    """The row with every judgement (None where it does not apply to the case's kind)."""
    expect = case["expect"]
    row["context"] = context(case)
    row.update(expected=None, valid_call=None, exact_call=None, key_words=None, key_share=None, key_pass=None,
               no_call=None)
    if row["kind"] == "tool":
        row.update(valid_call=valid_call(row["calls"], expect["tool"], case["tools"]),
                   exact_call=bool(row["calls"]) and row["calls"][0]["name"] == expect["tool"]
                   and json_or_none(row["calls"][0]["arguments"]) == expect["arguments"], expected=expect)
        return row
    words = expect.get("key_words") or []
    text = row["content"].lower()
    found = sum(w in text for w in words)
    row.update(key_words=words, key_share=found / len(words) if words else None,
               key_pass=found * 2 >= len(words) if words else None)
    if row["kind"] == "no_tool":
        row["no_call"] = not row["calls"]
    return row


def context(case: dict) -> str:
    """"agent prompt" (under a coding agent's long system message), "after earlier turns",
    or "plain"."""
    messages = case["messages"]
    system = messages[0]["role"] == "system"
    if system and len(messages[0]["content"]) > AGENT_PROMPT_CHARS:
        return "agent prompt"
    return "after earlier turns" if case["start"] > int(system) else "plain"


def valid_call(calls: list[dict], name: str, tools: list[dict]) -> bool:
    if not calls or not calls[0]["whole"] or calls[0]["name"] != name:
        return False
    arguments = json_or_none(calls[0]["arguments"])
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    return isinstance(arguments, dict) and jsonschema.Draft202012Validator(schema).is_valid(arguments)


def json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def share(rows, key, kinds=None) -> dict:
    picked = [r[key] for r in rows if key in r and r[key] is not None and (kinds is None or r["kind"] in kinds)]
    return {"share": sum(picked) / len(picked) if picked else None, "n": len(picked)}


def summarize(rows: list[dict]) -> dict:
    keyed = [r["key_share"] for r in rows if r["kind"] == "stdlib" and r.get("key_share") is not None]
    return {
        "stdlib_key_words": {**share(rows, "key_pass", ("stdlib",)),
                             "mean_key_share": sum(keyed) / len(keyed) if keyed else None},
        "tool_valid_call": share(rows, "valid_call"),
        "tool_exact_call": share(rows, "exact_call"),
        "no_tool_without_call": share(rows, "no_call"),
        "tool_answer_key_words": share(rows, "key_pass", ("tool_answer",)),
        "ended": share(rows, "ended"),
        "ended_by_kind": {k: share(rows, "ended", (k,)) for k in sorted({r["kind"] for r in rows})},
        "tool_valid_call_by_context": {c: share([r for r in rows if r.get("context") == c], "valid_call")
                                       for c in ("plain", "after earlier turns", "agent prompt")},
    }


def table(summary: dict) -> str:
    measures = [(key, summary[key]) for key in ("stdlib_key_words", "tool_valid_call", "tool_exact_call",
                                                "no_tool_without_call", "tool_answer_key_words", "ended")]
    measures += [(f"tool_valid_call, {where}", s) for where, s in summary["tool_valid_call_by_context"].items()]
    lines = ["| measure | share | n |", "|---|---|---|"]
    for label, s in measures:
        value = "-" if s["share"] is None else f"{s['share']:.3f}"
        lines.append(f"| {label} | {value} | {s['n']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=DEMO, help="a packs/demo recipe output or the bundle (default)")
    ap.add_argument("--count", type=int, default=240, help="held-out transcripts drawn")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default=None, help="what the pair is (recorded in the JSON)")
    ap.add_argument("--json", type=Path, default=RESULTS / "demo.json")
    args = ap.parse_args()
    from monolith.runtime.grammar import GrammarTokenizer

    data = load_data()
    model, tokenizer = load(args.pair.absolute())
    vocabulary = GrammarTokenizer.of(tokenizer, model.args.vocab_size)
    rows, raw_rows, t0 = [], [], time.time()
    for i, case in enumerate(cases(data, args.seed, args.count)):
        rows.append(judge(reply(model, tokenizer, data, case, args.max_tokens, vocabulary), case))
        raw_rows.append(judge(reply(model, tokenizer, data, case, args.max_tokens), case) if case["tools"]
                        else rows[-1])
        if (i + 1) % 25 == 0:
            log(f"{i + 1} replies in {time.time() - t0:.0f}s")
    summary, raw = summarize(rows), summarize(raw_rows)
    print("as served (tool_choice auto: a call the model opens is held to the offered tools' grammar):")
    print(table(summary))
    print("the model alone (no grammar):")
    print(table(raw))
    for key, goal in GOALS.items():
        got = summary["tool_valid_call" if key == "tool" else key]["share"]
        print(f"goal {key} >= {goal}: {'met' if got is not None and got >= goal else 'not met'} ({got})")
    report = {"pair": str(args.pair), "label": args.label, "settings": vars(args) | {"pair": str(args.pair),
                                                                                      "json": str(args.json)},
              "machine": machine(), "seconds": round(time.time() - t0, 1), "goals": GOALS, "summary": summary,
              "summary_without_grammar": raw, "rows": rows,
              "rows_without_grammar": [r for r, case_row in zip(raw_rows, rows) if r is not case_row]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
