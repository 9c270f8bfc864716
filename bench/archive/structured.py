"""Structured output (issue 16): what the grammar costs and what it does to speculation.

    python -m bench.archive.structured [--runs 4] [--max-tokens 400] [--json FILE]

1. Mask cost at a 248,320-token vocabulary (Qwen3.5/3.6's; the byte-level BPE that
   bench/archive/grammar_engines.py trains on this machine's text): per output token of a valid
   instance of each schema, the host time of `Guide.words()` (llguidance's mask, copied
   out) + `forced()` (the popcount for jump-forward) + `push()`, and the device time of
   `sampling.mask_logits` on one row and on a round's 8 rows. The share of a decode step
   is given against the 35B-A3B's plain decode step on a Mac (docs/performance.md: mlx-lm
   decodes it at about 140 tok/s, 7.1 ms a token; the bandwidth roofline is about 340
   tok/s on an M5 Max, 2.9 ms). In plain decoding the mask is computed while the forward
   runs (the forward is queued first), so its share there is an upper bound.
2. The demo pair (packs/demo), greedy: tau (accepted + 1 per round) and tok/s of
   speculative decoding of the same prompts with and without each schema, the tokens
   the grammar forced (emitted without sampling), and greedy speculative == plain.
3. Validation: every output (greedy and sampled at temperature 0.8, plain and
   speculative) parsed and checked with `jsonschema`; the fraction that validates, how
   many ended by max_tokens instead of the end token (a JSON prefix: the demo model
   can write a free string for ever), and the fraction of the others that validates.
Writes bench/archive/results/structured.json (default) and prints the tables.

Archived, a finished study (issue 16): what the grammar costs per token and what it does
to tau are recorded in bench/archive/results/structured.json (docs/serving.md cites it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np

from bench.archive.vocabulary import (  # the 248K vocabulary, built once and cached
    VOCAB_SIZE,
    vocabulary,
)
from monolith.engine_setup import load_drafter, load_target
from monolith.pack.demo import demo_pair
from monolith.runtime.decoder import Decoder
from monolith.runtime.grammar import GrammarTokenizer
from monolith.runtime.generation import Generation
from monolith.sampling import SamplingParams, mask_logits
from monolith.serving import structured
from monolith.tokenizer import load_tokenizer

MAC_STEP_MS = {"mlx-lm plain, 140 tok/s": 1000 / 140, "roofline, 340 tok/s": 1000 / 340}
SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                                 "minItems": 1, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["a", "c"]}),
    "order": ({"$defs": {"item": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1,
                                                                             "maximum": 99},
        "price": {"type": "number", "minimum": 0, "maximum": 1000}}, "required": ["sku", "qty", "price"],
        "additionalProperties": False}},
        "type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                         "items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                   "minItems": 1, "maxItems": 5},
                                         "status": {"enum": ["new", "paid", "shipped"]},
                                         "note": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]}},
        "required": ["id", "items", "status"], "additionalProperties": False},
        {"id": "0b6f9a52-8a8e-4c55-9d9b-3a8f1e2c7d10", "items": [{"sku": "ABC-1234", "qty": 2, "price": 19.5},
                                                                  {"sku": "XYZ-0001", "qty": 1, "price": 250}],
         "status": "paid", "note": None}),
    "any_object": ({"type": "object"}, {"files": ["a.py", "b.py"], "ok": True, "count": 2, "meta": {"x": [1, 2.5]}}),
}
PROMPTS = ["Describe a person as JSON.", "Give me an order as JSON.", "Reply with a JSON object.",
           "Summarize the file in JSON.", "Return the result as JSON.", "Fill in the form."]


def percentile(values, q) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q))


def mask_cost(runs: int) -> dict:
    """Per-token host and device cost of the grammar at the 248K vocabulary."""
    from tokenizers import Tokenizer

    hf_json, _ = vocabulary(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "monolith-bench")
    tok, width = Tokenizer.from_str(hf_json), VOCAB_SIZE
    built = time.perf_counter()
    gt = GrammarTokenizer(hf_json, width, [tok.token_to_id("<|im_end|>")])
    build_s = time.perf_counter() - built
    out = {"vocab": width, "tokenizer_build_s": round(build_s, 3), "schemas": {}}
    for name, (schema, instance) in SCHEMAS.items():
        form = structured.Structure("json", "bench", schema)
        grammar = structured.grammar(form, _NoTemplate(), reasoning_open=False)
        gt.check(grammar)
        ids = tok.encode(json.dumps(instance), add_special_tokens=False).ids
        per_token, compile_s = [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            guide = gt.guide(grammar)
            compile_s.append(time.perf_counter() - t0)
            for token in ids:
                t0 = time.perf_counter()
                guide.words()
                guide.forced()
                guide.push(token)
                per_token.append((time.perf_counter() - t0) * 1e6)
        mean = statistics.fmean(per_token)
        out["schemas"][name] = {
            "tokens": len(ids), "compile_ms": round(1e3 * statistics.median(compile_s), 2),
            "host_us": {"mean": round(mean, 1), "p50": round(percentile(per_token, 50), 1),
                        "p99": round(percentile(per_token, 99), 1), "max": round(max(per_token), 1)},
            "share_of_mac_step": {k: round(mean / 1e3 / ms, 4) for k, ms in MAC_STEP_MS.items()}}
    words = np.full(((width + 31) // 32,), -1, np.int32)
    device = {}
    for rows in (1, 8):
        logits = mx.random.normal((rows, width))
        masks = np.stack([words] * rows)
        mx.eval(mask_logits(logits, masks))
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            mx.eval(mask_logits(logits, masks))
            times.append((time.perf_counter() - t0) * 1e6)
        device[f"{rows}_rows_us"] = round(statistics.median(times), 1)
    out["device_mask_here"] = device  # MLX's CPU backend here; on a Mac it runs on the GPU
    return out


class _NoTemplate:
    """A tokenizer stand-in for JSON grammars (no tags, no template)."""

    chat_template = ""

    def token_to_id(self, text):
        return None


def forced_count(gt: GrammarTokenizer, grammar, tokens) -> int:
    guide, n = gt.guide(grammar), 0
    for token in tokens:
        n += guide.forced() is not None
        guide.push(token)
    return n


def demo_runs(max_tokens: int) -> dict:
    target, draft = demo_pair()
    model = load_target(target, dtype="float32")
    drafter = load_drafter(draft, model, dtype="float32")
    tok = load_tokenizer(target)
    gt = GrammarTokenizer.of(tok, model.args.vocab_size)
    stops = frozenset(tok.eos_token_ids) | frozenset(model.args.eos_token_ids)
    context = 2048
    plain, spec = Decoder(model, None, context), Decoder(model, drafter, context)
    table, checked = {}, {"outputs": 0, "valid": 0, "length": 0}

    def decode(decoder, prompt, params, grammar):
        return decoder(Generation(prompt, max_tokens, params, stops,
                              guide=None if grammar is None else gt.guide(grammar)))

    for name, (schema, _) in [("none", (None, None)), *SCHEMAS.items()]:
        grammar = None if schema is None else structured.grammar(structured.Structure("json", "bench", schema), tok,
                                                                 False)
        rounds = accepted = tokens = forced = 0
        seconds, same = 0.0, True
        for text in PROMPTS:
            prompt = tok.encode_chat([{"role": "user", "content": text}])
            for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=len(text))):
                outs = {kind: decode(dec, prompt, params, grammar) for kind, dec in (("plain", plain),
                                                                                     ("speculative", spec))}
                if params.greedy:
                    s = outs["speculative"]
                    rounds += len(s.speculative.accepted_per_round)
                    accepted += sum(s.speculative.accepted_per_round)
                    tokens += len(s.token_ids)
                    seconds += s.decode_seconds
                    same &= s.token_ids == outs["plain"].token_ids
                    if grammar is not None:
                        forced += forced_count(gt, grammar, s.token_ids)
                if grammar is None:
                    continue
                for out in outs.values():
                    checked["outputs"] += 1
                    checked["length"] += out.finish_reason == "length"
                    try:
                        jsonschema.validate(json.loads(tok.decode(out.token_ids)), schema)
                        checked["valid"] += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
        table[name] = {"tau": round(1 + accepted / max(rounds, 1), 3), "rounds": rounds, "tokens": tokens,
                       "forced_tokens": forced, "spec_tok_s": round(tokens / max(seconds, 1e-9), 1),
                       "greedy_spec_equals_plain": bool(same)}
    checked["valid_fraction"] = checked["valid"] / max(checked["outputs"], 1)
    completed = checked["outputs"] - checked["length"]
    checked["valid_of_completed"] = checked["valid"] / max(completed, 1)  # an output cut short is a JSON prefix
    return {"acceptance": table, "validation": checked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "structured.json"))
    args = ap.parse_args()
    started = time.time()
    result = {"settings": vars(args), "machine": platform.platform(), "mlx": mx.__version__,
              "mask": mask_cost(args.runs), **demo_runs(args.max_tokens)}
    result["seconds"] = round(time.time() - started, 1)
    print(f"\nmask at vocab {result['mask']['vocab']} (tokenizer built in {result['mask']['tokenizer_build_s']} s)")
    print(f"{'schema':12} {'tokens':>6} {'compile ms':>10} {'mean us':>8} {'p50':>7} {'p99':>8} {'max':>8} "
          f"{'share 7.1ms':>11} {'share 2.9ms':>11}")
    for name, row in result["mask"]["schemas"].items():
        h, share = row["host_us"], list(row["share_of_mac_step"].values())
        print(f"{name:12} {row['tokens']:6} {row['compile_ms']:10} {h['mean']:8} {h['p50']:7} {h['p99']:8} "
              f"{h['max']:8} {share[0]:11.2%} {share[1]:11.2%}")
    print(f"device mask here (MLX CPU): {result['mask']['device_mask_here']}")
    print(f"\n{'schema':12} {'tau':>6} {'rounds':>6} {'tokens':>6} {'forced':>6} {'tok/s':>7} {'spec==plain':>11}")
    for name, row in result["acceptance"].items():
        print(f"{name:12} {row['tau']:6} {row['rounds']:6} {row['tokens']:6} {row['forced_tokens']:6} "
              f"{row['spec_tok_s']:7} {row['greedy_spec_equals_plain']!s:>11}")
    v = result["validation"]
    print(f"\nvalidated {v['valid']}/{v['outputs']} ({v['valid_fraction']:.0%}); {v['length']} cut by max_tokens; "
          f"of the outputs that ended with the end token, {v['valid_of_completed']:.0%} validate")
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
