"""Acceptance of a trained target + DSpark draft pair on held-out prompts (issue 7):
tau, per-position acceptance and decode tok/s of plain vs speculative decoding, greedy
and sampled (temperature 0.7), for the BF16 and the NVFP4 draft and, beside them, the
target's own MTP head (`--draft mtp`, when the target has its trained head,
model_mtp.safetensors: the target then loads from its --with-mtp pack, the head served
as serve serves it); the matched-prefix acceptance of every drafter against the target's
greedy continuations; the goals.

    python -m bench.acceptance [--pair DIR] [--target target] [--prompts 96] [--prompt-tokens 64]
                               [--prompt-set corpus|chat] [--max-tokens 128] [--block-size 7]
                               [--repeats 1] [--temperature 0.7] [--seed 0] [--json FILE]

DIR is either the output of the packs/demo recipe (train.py + draft.py): DIR/target
(ModelOpt NVFP4), DIR/target-bf16, DIR/draft (DeepSpec NVFP4), DIR/draft-bf16,
DIR/tokens.npz (train / held-out token streams; packs are cached in DIR/packs), or the
bundled pair packs/demo (the default: DIR/target, DIR/draft, DIR/expected.json; its
packs are built and checked in the pack cache exactly as the first start of serve does).
The bundle holds no tokens.npz: the held-out stream is then rebuilt from the corpus
(packs/demo/corpus.py, the held-out files only) with the pair's tokenizer and checked
against the corpus SHA-256 the bundle records. The bundle holds no BF16 draft either,
and loading its NVFP4 draft with quantization "none" only repacks the NVFP4 weights: the
BF16 rows and the NVFP4/BF16 comparison need a BF16 draft checkpoint (--draft-bf16, e.g.
OUT/draft-bf16 of the recipe that produced the bundle); without one they are skipped.

Prompts (--prompt-set): "corpus" (the default), --prompt-tokens of the held-out stream at
evenly spaced places, each continued for --max-tokens; "chat", the prompts bench/demo.py
judges (held-out chat transcripts cut before an assistant turn, rendered by the pair's
template), each reply ending at the tokenizer's end-of-sequence ids as served.

Measures (as monolith/runtime/stats.py defines them), gamma = --block-size (7):
- timed runs: per prompt and repeat, plain then each draft, greedy then sampled at
  --temperature (seed --seed + prompt index, the same for plain and every draft);
  tok/s = decode tok/s, medians over repeats; speedup = draft tok/s / plain tok/s of
  the same prompt and mode, median over prompts. tau = accepted + 1 per round, pooled
  over the rounds of all prompts (95% interval: prompts resampled); per-position
  conditional acceptance pooled likewise (rounds that accepted position j / rounds that
  verified j after accepting all before).
  Greedy speculative output must equal plain greedy output (same_as_plain); sampled
  outputs differ from plain ones by construction (same distribution, other draws).
- "served": what serve and chat run by default, the NVFP4 draft with a
  fallback.Fallback (plain one-row rounds while drafting does not pay; break-even from
  calibrate.measure_break_even; the decoder monolith.engine_setup builds for serve): tok/s,
  speedup, drafted and plain rounds.
- matched prefix (untimed, greedy proposals): the reference continuation of a prompt is
  the target's plain greedy output. One target forward over prompt + reference gives
  every row's tap features; at every anchor position p of the reference (p = len(prompt)
  .. len(seq) - gamma - 1) the draft has observed exactly the rows < p, proposes gamma
  tokens after seq[p], and the leading ones equal to seq[p+1 : p+1+gamma] are counted.
  Mean over anchors (out of gamma) per draft, and NVFP4/BF16: both drafts see identical
  contexts, so the ratio isolates the draft's quantization.

Goals (issue 7), judged on the NVFP4 draft (the one the bundle ships): tau >= 3.0 at
gamma 7 greedy; NVFP4 matched prefix >= 97% of the BF16 draft's; greedy speculative
>= 1.5x plain tok/s. Prints per-prompt rows, a summary table and the goals; writes the
JSON (default bench/results/acceptance.json): settings, "rows" (per prompt) and
"summary" (keys "<mode>/<draft>", mode greedy or t<T>, draft plain / bf16 / nvfp4 / mtp).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.acceptance_report import (
    print_goals,
    print_rows,
    print_summary,
    report_json,
    summarize,
)

REPO = Path(__file__).resolve().parents[1]
TRAINED_HEAD = "model_mtp.safetensors"  # the demo target's trained MTP head (packs/demo/mtp.py)
NO_BF16 = ("no BF16 draft checkpoint ({path} missing): the bundled draft is NVFP4, and loading it with "
           'quantization "none" repacks the same NVFP4 weights, so there is no BF16 baseline; the BF16 rows '
           "and the NVFP4/BF16 comparison need --draft-bf16 DIR (e.g. OUT/draft-bf16 of the recipe) or "
           "--pair OUT (a recipe output with draft-bf16)")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------- the pair


def locate_pair(args) -> dict:
    """Where the target, the drafts, the pack cache and the held-out tokens are."""
    pair = args.pair
    if pair is None:
        from monolith.pack.demo import bundle_dir

        pair = bundle_dir()
    pair = pair.absolute()
    bundle = (pair / "expected.json").is_file()
    bf16 = args.draft_bf16 if args.draft_bf16 is not None else pair / "draft-bf16"
    info = {
        "pair": pair,
        "kind": "bundle" if bundle else "recipe output",
        "target": pair / args.target,
        "draft": pair / "draft",
        "draft_bf16": bf16 if (bf16 / "config.json").is_file() else None,
        "bf16_note": None if (bf16 / "config.json").is_file() else NO_BF16.format(path=bf16),
        # a recipe output caches its packs beside it (as the recipe does); the bundle's
        # packs live in the pack cache, where serve builds and checks them
        "cache": args.cache if args.cache is not None else (None if bundle else pair / "packs"),
        "tokens": args.tokens if args.tokens is not None else pair / "tokens.npz",
    }
    for role in ("target", "draft"):
        if not (info[role] / "config.json").is_file():
            sys.exit(f"error: {info[role]}: no checkpoint (config.json); --pair takes a packs/demo recipe output "
                     "or the bundle packs/demo")
    return info


def held_out_stream(info: dict) -> tuple[np.ndarray, str]:
    """The held-out token stream: DIR/tokens.npz "held", or (the bundle) rebuilt from the
    corpus's held-out files with the pair's tokenizer as train.py builds it."""
    path = info["tokens"]
    if path.is_file():
        return np.load(path)["held"], f"{path} (held)"
    tokenizer = next((p for p in (info["pair"] / "tokenizer.json", info["target"] / "tokenizer.json") if p.is_file()),
                     None)
    corpus_py = REPO / "packs" / "demo" / "corpus.py"
    if tokenizer is None or not corpus_py.is_file():
        sys.exit(f"error: no held-out tokens: {path} is missing and the stream cannot be rebuilt "
                 f"(tokenizer {tokenizer}, {corpus_py}); give --tokens OUT/tokens.npz")
    spec = importlib.util.spec_from_file_location("demo_corpus", corpus_py)
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    from tokenizers import Tokenizer

    _, held_docs, corpus_info = corpus.load()
    tk = Tokenizer.from_file(str(tokenizer))
    sep = tk.token_to_id("<|endoftext|>")
    held = np.array([t for doc in held_docs for t in [*tk.encode(doc).ids, sep]], dtype=np.int32)
    source = f"rebuilt from the held-out files of {corpus_py} with {tokenizer}"
    record = {}
    expected = info["pair"] / "expected.json"
    if expected.is_file():
        record = json.loads(expected.read_text()).get("origin", {}).get("corpus", {})
    want = (record.get("sha256"), record.get("heldout_tokens"))
    if want == (None, None):
        log(f"warning: {source}; no corpus record to check it against (prompts may not be held out)")
    elif want != (corpus_info["sha256"], int(held.size)):
        log(f"warning: the corpus here (sha256 {corpus_info['sha256'][:16]}..., {held.size} held-out tokens) is not "
            f"the one the pair was trained on ({str(want[0])[:16]}..., {want[1]} tokens): another Python version? "
            "The prompts may not be held out; give --tokens OUT/tokens.npz")
        source += " (corpus differs from the recorded one)"
    else:
        source += " (corpus SHA-256 and token count as recorded)"
    return held, source


def load_pair(info: dict, dtype):
    """The target (from its --with-mtp pack when it has a trained MTP head) and the drafters
    by label: "bf16" (when there is a BF16 draft), "nvfp4", "mtp" (the MTP head)."""
    from monolith.engine_setup import load_drafter, load_target
    from monolith.models import load_mtp
    from monolith.pack import read_manifest, resolve_pack
    from monolith.runtime.mtp_drafter import MTPDrafter

    with_mtp = (info["target"] / TRAINED_HEAD).is_file()
    if not with_mtp:
        log(f"note: {info['target']} has no {TRAINED_HEAD} (packs/demo/mtp.py): no MTP rows")
    if info["kind"] == "bundle" and info["cache"] is None:
        from monolith.pack.demo import demo_pair

        demo_pair(log, bundle=info["pair"], with_mtp=with_mtp)  # builds (first use) and checks the packs
    cache = {"cache_dir": info["cache"]}
    target_pack = resolve_pack(info["target"], role="target", with_mtp=with_mtp, **cache)
    model = load_target(target_pack, dtype=dtype)
    drafters = {}
    if info["draft_bf16"] is not None:
        pack = resolve_pack(info["draft_bf16"], role="draft", quantization="none", **cache)
        quantized = sorted(n for n, e in read_manifest(pack)["entries"].items() if e.get("precision") == "nvfp4")
        if quantized:
            sys.exit(f"error: {info['draft_bf16']} is not a BF16 draft: {len(quantized)} NVFP4 matrices "
                     f"({', '.join(quantized[:3])}, ...)")
        drafters["bf16"] = load_drafter(pack, model, dtype=dtype)
    drafters["nvfp4"] = load_drafter(info["draft"], model, dtype=dtype, quantization="auto", **cache)
    if with_mtp:
        drafters["mtp"] = MTPDrafter(load_mtp(target_pack, model))
    return model, drafters


# ----------------------------------------------------------------- measures


def spec_row(runs, plain_tok_s: float) -> dict:
    s = runs[-1].speculative  # the runs of one prompt and seed are identical but for timing
    tok_s = statistics.median(r.decode_tok_s for r in runs)
    return {
        "decode_tok_s": tok_s, "speedup": tok_s / plain_tok_s, "generated": len(runs[-1].token_ids),
        "tau": s.acceptance_length, "rounds": s.rounds,
        "accepted": sum(s.accepted_per_round), "proposed": sum(s.proposed_per_round),
        "accepted_per_position": s.accepted_per_position(), "reached_per_position": s.reached_per_position(),
        "per_position_acceptance": s.per_position_acceptance(),
    }


def matched_prefix(drafter, seq: list[int], start: int, gamma: int, max_context: int,
                   features: mx.array) -> list[int]:
    """Leading greedy proposals equal to the reference, at every anchor p in [start,
    len(seq) - gamma - 1]; the drafter has observed exactly the rows < p."""
    from monolith.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    drafter.start(max_context)
    drafter.observe(features[:start])
    matched = []
    for p in range(start, len(seq) - gamma):
        proposal = np.array(drafter.propose(seq[p], gamma, greedy, None).tokens[:gamma])
        hits = proposal == np.array(seq[p + 1:p + 1 + gamma])
        matched.append(int(np.cumprod(hits).sum()))
        drafter.observe(features[p:p + 1])
    return matched


def tap_features(model, taps: list[int], seq: list[int], max_context: int) -> mx.array:
    """Every row's tap features from one target forward over seq (as the prefill's)."""
    cache = model.make_cache(max_context)
    _, features = model.forward(mx.array(seq, dtype=mx.int32), cache, taps=taps, logits="none")
    mx.eval(features)
    return features


# ----------------------------------------------------------------- output


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=None, help="recipe output or bundle (default: the bundled pair)")
    ap.add_argument("--target", default="target", help="target subdirectory (target = NVFP4, target-bf16)")
    ap.add_argument("--draft-bf16", type=Path, default=None, help="BF16 draft checkpoint (default DIR/draft-bf16)")
    ap.add_argument("--tokens", type=Path, default=None, help="token streams .npz with 'held' (default DIR/tokens.npz)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="pack cache (default DIR/packs for a recipe output, the monolith pack cache for the bundle)")
    ap.add_argument("--prompts", type=int, default=96,
                    help="held-out prompts, evenly spaced over the held-out stream (acceptance varies a lot "
                         "from prompt to prompt: one draft gave tau 2.90 on 24 prompts and 3.19 on 96)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="the length of a corpus prompt")
    ap.add_argument("--prompt-set", choices=("corpus", "chat"), default="corpus",
                    help="held-out corpus text, or the held-out chat prompts bench/demo.py judges")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=7, help="gamma")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per prompt, mode and draft (medians)")
    ap.add_argument("--temperature", type=float, default=0.7, help="the sampled mode (0: greedy only)")
    ap.add_argument("--seed", type=int, default=0, help="sampled runs of prompt i use seed + i")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="compute dtype (default: the device's, float32 on the CPU)")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "acceptance.json")
    return ap.parse_args()


def served_decoder(args, model, drafter, gamma: int, max_context: int):
    """What serve and chat run by default with this draft (monolith.engine_setup builds it: the
    NVFP4 draft with a Fallback to plain steps, or plain decoding where a round cannot
    pay), and the break-even it measured."""
    from monolith.engine_setup import drafting_decoder
    from monolith.runtime.decoder import Decoder

    flags = argparse.Namespace(draft_block_size=gamma, spec_sched=None, spec_threshold=None, max_context=max_context,
                               prefill_chunk_size=512)
    decoder, measured = drafting_decoder(flags, model, drafter, log)
    return decoder or Decoder(model, None, max_context), measured.steps


class Decoders:
    """Every decoder a prompt runs under, built once: plain, each draft (fixed scheduler,
    always drafting) and the served one."""

    def __init__(self, args, model, drafters: dict, gamma: int, max_context: int):
        from monolith.runtime.decoder import Decoder
        from monolith.runtime.scheduler import make_scheduler

        self.plain = Decoder(model, None, max_context)
        self.drafts = {label: Decoder(model, d, max_context, gamma=gamma, scheduler=make_scheduler("fixed"))
                       for label, d in drafters.items()}
        self.served, self.break_even = served_decoder(args, model, drafters["nvfp4"], gamma, max_context)
        log(f"serve's fallback break-even: {self.break_even:.2f} tokens per round"
            + ("" if self.served.drafter is not None else " (serve decodes plainly)"))


def timed_runs(args, prompt: list[int], params: dict, decoders: Decoders, stop_ids=()) -> dict:
    """(mode, draft) -> the outcomes of --repeats alternating runs: plain, then each
    draft, then the served decoder, per mode."""
    from monolith.runtime.engine import run_decoder

    runs = {(m, d): [] for m in params for d in ("plain", *decoders.drafts, "served")}
    for _ in range(args.repeats):
        for mode, p in params.items():
            runs[mode, "plain"].append(run_decoder(decoders.plain, prompt, args.max_tokens, p, stop_ids))
            for label, decoder in decoders.drafts.items():
                runs[mode, label].append(run_decoder(decoder, prompt, args.max_tokens, p, stop_ids))
            runs[mode, "served"].append(run_decoder(decoders.served, prompt, args.max_tokens, p, stop_ids))
    return runs


def chat_prompts(info: dict, count: int, seed: int) -> tuple[list[list[int]], str, tuple[int, ...]]:
    """(the first `count` prompts bench/demo.py judges, tokenized; where they come from;
    the tokenizer's end-of-sequence ids)."""
    from bench import demo
    from monolith.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(info["target"])
    data = demo.load_data()
    prompts = [tokenizer.encode(data.render(tokenizer, case)[0], add_special_tokens=False)
               for case in demo.cases(data, seed, count)][:count]
    return prompts, f"bench/demo.py's held-out chat prompts (seed {seed})", tuple(tokenizer.eos_token_ids)


def corpus_prompts(info: dict, count: int, length: int) -> tuple[list[list[int]], str]:
    held, source = held_out_stream(info)
    stride = (held.size - length) // count
    return [held[i * stride:i * stride + length].tolist() for i in range(count)], source


def prompt_rows(index: int, seed: int, params: dict, runs: dict, drafters: dict) -> tuple[list[dict], list[dict]]:
    """(per-draft rows, served rows) of one prompt's timed runs."""
    rows, served_rows = [], []
    for mode, p in params.items():
        plain = runs[mode, "plain"]
        plain_tok_s = statistics.median(r.decode_tok_s for r in plain)
        base = {"prompt": index, "mode": mode, "seed": None if p.greedy else seed}
        rows.append({**base, "draft": "plain", "decode_tok_s": plain_tok_s, "speedup": 1.0,
                     "generated": len(plain[-1].token_ids)})
        served = runs[mode, "served"]
        tok_s = statistics.median(r.decode_tok_s for r in served)
        spec = served[-1].speculative
        served_rows.append({**base, "decode_tok_s": tok_s, "speedup": tok_s / plain_tok_s,
                            "drafted_rounds": spec.rounds if spec else 0,
                            "plain_rounds": spec.plain_rounds if spec else served[-1].decode_steps + 1})
        for label in drafters:
            row = {**base, "draft": label, **spec_row(runs[mode, label], plain_tok_s)}
            if p.greedy:
                row["same_as_plain"] = runs[mode, label][-1].token_ids == plain[-1].token_ids
            rows.append(row)
    return rows, served_rows


def matched_rows(index: int, model, drafters: dict, prompt: list[int], reference: list[int], gamma: int,
                 max_context: int) -> list[dict]:
    """Matched prefix (untimed): reference = the target's plain greedy continuation."""
    seq, features, rows = prompt + reference, {}, []
    for label, drafter in drafters.items():
        taps = tuple(drafter.taps)
        if taps not in features:
            features[taps] = tap_features(model, list(taps), seq, max_context)
        counts = matched_prefix(drafter, seq, len(prompt), gamma, max_context, features[taps])
        rows.append({"prompt": index, "mode": "matched_prefix", "draft": label, "anchors": len(counts),
                     "matched_prefix": float(np.mean(counts)) if counts else None,
                     "histogram": np.bincount(counts, minlength=gamma + 1).tolist()})  # anchors matching 0..gamma
    return rows


def main() -> None:
    args = parse_args()
    from monolith.sampling import SamplingParams

    info = locate_pair(args)
    t = time.time()
    model, drafters = load_pair(info, args.dtype)
    log(f"loaded {info['kind']} {info['pair']} in {time.time() - t:.1f}s")
    if info["bf16_note"]:
        log(f"note: {info['bf16_note']}")
    stop_ids = ()
    if args.prompt_set == "chat":
        prompts, held_source, stop_ids = chat_prompts(info, args.prompts, args.seed)
    else:
        prompts, held_source = corpus_prompts(info, args.prompts, args.prompt_tokens)
    max_context = max(map(len, prompts)) + args.max_tokens + 16
    gamma = min(args.block_size, *(d.max_proposals for d in drafters.values()))
    modes = {"greedy": None}
    if args.temperature > 0:
        modes[f"t{args.temperature:g}"] = args.temperature
    decoders = Decoders(args, model, drafters, gamma, max_context)
    rows, served_rows = [], []
    for index, prompt in enumerate(prompts):
        seed = args.seed + index
        params = {m: SamplingParams() if temp is None else SamplingParams(temperature=temp, seed=seed)
                  for m, temp in modes.items()}
        runs = timed_runs(args, prompt, params, decoders, stop_ids)
        mine, served = prompt_rows(index, seed, params, runs, drafters)
        rows += mine + matched_rows(index, model, drafters, prompt, runs["greedy", "plain"][-1].token_ids, gamma,
                                    max_context)
        served_rows += served
        log(f"prompt {index + 1}/{len(prompts)} done ({time.time() - t:.0f}s)")
    summary = summarize(rows, served_rows, modes, drafters, gamma, decoders.break_even)
    print(f"pair {info['pair']} ({info['kind']}), target {args.target}, compute dtype {model.dtype}; "
          f"{len(prompts)} held-out {args.prompt_set} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, {args.max_tokens} generated at most, gamma {gamma}")
    print(f"prompts: {held_source}; tok/s: medians of {args.repeats} alternating runs; sampled runs of prompt i "
          f"use seed {args.seed} + i")
    print_rows(rows, len(prompts))
    print_summary(summary, modes, drafters, gamma, decoders.break_even, info)
    print_goals(summary, modes, "bf16" in drafters)
    report = {"machine": platform.platform(), "mlx": mx.__version__, "dtype": str(model.dtype),
              "pair": str(info["pair"]), "pair_kind": info["kind"], "target": args.target,
              "drafts": {"nvfp4": str(info["draft"]),
                         "bf16": None if info["draft_bf16"] is None else str(info["draft_bf16"]),
                         "mtp": f"{info['target']}/{TRAINED_HEAD}" if "mtp" in drafters else None},
              "bf16_note": info["bf16_note"], "prompts_source": held_source, "gamma": gamma,
              "prompts": len(prompts), "prompt_set": args.prompt_set, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens,
              "repeats": args.repeats, "modes": {m: (0.0 if t is None else t) for m, t in modes.items()},
              "seed": args.seed, "summary": summary, "rows": rows, "served_rows": served_rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(report_json(report, ("rows", "served_rows")))
    log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
