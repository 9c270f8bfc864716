"""What tool_choice "auto" costs a request's decoding (issue 53): the calls' grammar waits
for the model's `<tool_call>` token, and until then the rounds run unguided.

    python -m bench.waiting_guide [--prompts 4] [--max-tokens 128] [--repeats 3] [--out-dir DIR]

On the bundled demo pair (F32), greedy, the same prompts (stdlib questions with two tools
offered, which the model answers in text; the share of tokens before it writes a
`<tool_call>`, if it does, is reported) decoded three ways:
- `none`: no grammar (a request without tools);
- `waiting`: the calls' grammar (structured.calls_once_opened) as serve builds it for
  tool_choice "auto": a guide waiting for `<tool_call>`, engaged only when the model
  writes it (runtime/rounds.py);
- `guided`: the same grammar on the guided decode path from the first token, the path a
  waiting guide took before it engaged lazily (pipelined plain steps lost, proposals
  drawn one by one by propose_guided, out of the chained batch); reproduced here by
  giving the guide a reasoning budget larger than --max-tokens, which keeps it there.
Each plain and speculative (the pair's DSpark draft), one sequence at a time and all
prompts batched (runtime/batch.py, as the engine steps them). Decoding runs to
--max-tokens (no stop tokens), so every mode decodes as many tokens; the `waiting` and
`guided` outputs are asserted equal. Reported: decode tok/s, the median of --repeats
interleaved runs, and each mode's ratio to `none` measured in the same run. Writes
bench/results/waiting_guide.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from bench.common import RESULTS, machine, machine_note, write

QUESTIONS = ["What does json.dumps do?", "What does os.path.join do?", "How do I split a string?",
             "What does shutil.copyfile do?"]  # the demo model answers these in text
TOOLS = [{"type": "function", "function": {"name": name, "description": text, "parameters": {
    "type": "object", "properties": {key: {"type": "string"}}, "required": [key]}}}
    for name, text, key in (("read_file", "Read a file and return its contents.", "path"),
                            ("get_weather", "Get the current weather for a location.", "location"))]
MODES = ("none", "waiting", "guided")


def load(cache: Path):
    import os

    os.environ["MONOLITH_CACHE"] = str(cache)
    from monolith.engine_setup import load_drafter, load_target
    from monolith.pack.demo import demo_pair
    from monolith.tokenizer import load_tokenizer

    target, draft = demo_pair()
    model = load_target(target, dtype="float32")
    return model, load_drafter(draft, model, dtype="float32"), load_tokenizer(target)


def guides(mode: str, grammar, vocabulary, count: int, max_tokens: int) -> list:
    if mode == "none":
        return [None] * count
    if mode == "guided":  # a budget keeps a waiting guide on the guided path (never spent here)
        grammar = dataclasses.replace(grammar, budget=max_tokens + 1)
    return [vocabulary.guide(grammar) for _ in range(count)]


def decode(decoder, prompts, guide_list, max_tokens: int, batched: bool) -> tuple[float, list[list[int]]]:
    """(decode tok/s after each sequence's first token, the outputs)."""
    from monolith.runtime.batch import Batch
    from monolith.runtime.generation import Generation, Tokens

    outputs: list[list[int]] = [[] for _ in prompts]
    groups = [list(range(len(prompts)))] if batched else [[i] for i in range(len(prompts))]
    tokens, seconds = 0, 0.0
    for group in groups:
        batch = Batch()
        for i in group:
            emit = Tokens(lambda token, logprob, out=outputs[i]: out.append(token) or True)
            batch.add(decoder.steps(Generation(prompts[i], max_tokens, emitter=emit, guide=guide_list[i])))
        batch.step()  # the prefills and the first tokens
        mx.synchronize()
        first, start = sum(len(outputs[i]) for i in group), time.perf_counter()
        while len(batch):
            batch.step()
        mx.synchronize()
        seconds += time.perf_counter() - start
        tokens += sum(len(outputs[i]) for i in group) - first
    return tokens / seconds, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()

    from monolith.runtime.decoder import Decoder
    from monolith.runtime.grammar import GrammarTokenizer
    from monolith.serving import structured

    model, drafter, tok = load(Path(tempfile.mkdtemp(prefix="monolith-bench-")))
    vocabulary = GrammarTokenizer.of(tok, model.args.vocab_size)
    grammar = structured.grammar(structured.calls_once_opened(TOOLS, tok), tok, reasoning_open=False)
    prompts = [tok.encode_chat([{"role": "user", "content": q}], TOOLS, enable_thinking=False)
               for q in QUESTIONS[:args.prompts]]
    decoders = {"plain": Decoder(model, None, 2048), "speculative": Decoder(model, drafter, 2048)}
    rates: dict = {}
    for _ in range(args.repeats):
        for name, decoder in decoders.items():
            for batched in (False, True):
                outs = {}
                for mode in MODES:
                    rate, outs[mode] = decode(decoder, prompts, guides(mode, grammar, vocabulary, len(prompts),
                                                                       args.max_tokens), args.max_tokens, batched)
                    rates.setdefault((name, batched, mode), []).append(rate)
                assert outs["waiting"] == outs["guided"], f"{name}: the waiting guide changed the output"
                opener = tok.token_to_id(structured.OPEN)
                before = [out.index(opener) if opener in out else len(out) for out in outs["waiting"]]
    rows = []
    for (name, batched, mode), values in rates.items():
        rate = statistics.median(values)
        none = statistics.median(rates[(name, batched, "none")])
        rows.append({"decoder": name, "sequences": len(prompts) if batched else 1, "mode": mode,
                     "tok_s": round(rate, 1), "vs_none": round(rate / none, 3), "runs": [round(v, 1) for v in values]})
    unguided = sum(before) / (len(prompts) * args.max_tokens)
    m = machine()
    notes = [(f"the bundled demo pair, F32, greedy, {len(prompts)} prompts (stdlib questions, two tools offered), "
              f"{args.max_tokens} tokens each without stop tokens; median of {args.repeats} interleaved runs"),
             f"{unguided:.0%} of the tokens came before the model wrote <tool_call> (the waiting guide's unguided part)",
             ("none: no grammar; waiting: the calls' grammar of tool_choice auto, engaged at <tool_call>; "
              "guided: the same grammar on the guided path from the first token (the path before the lazy engagement)"),
             machine_note(m)]
    table = "| decoder | sequences | mode | decode tok/s | vs none |\n|---|---|---|---|---|\n" + "".join(
        f"| {r['decoder']} | {r['sequences']} | {r['mode']} | {r['tok_s']} | {r['vs_none']} |\n" for r in rows)
    print(table, file=sys.stderr)
    write({"notes": notes, "settings": vars(args) | {"out_dir": str(args.out_dir)}, "machine": m,
           "unguided_share": round(unguided, 3), "rows": rows},
          "waiting_guide", table, args.out_dir)


if __name__ == "__main__":
    main()
