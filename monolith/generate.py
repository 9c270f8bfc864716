"""python -m monolith.generate --model M [--draft D] (--prompt TEXT | --prompt-ids 1,2,3 | --chat TEXT):
generate from a prompt, streaming the text to stdout (then one stats line on stderr),
or print one JSON object with --json. Greedy unless --temperature is above 0. With
--draft, speculative decoding: the same output distribution (greedy: the same tokens),
and the stats gain rounds and acceptance; --json then also times the draft, verify and
commit stages (which adds host syncs per round)."""

from __future__ import annotations

import argparse
import json
import sys

from .runtime.decode import ContextLengthError, generate
from .sampling import SamplingParams
from .runtime.scheduler import DEFAULT_THRESHOLD, SCHEDULERS, make_scheduler
from .tokenizer import IncrementalDetokenizer, load_tokenizer

SPECULATIVE_FLAGS = ("draft_block_size", "draft_quantization", "spec_sched", "spec_threshold")


class CliError(Exception):
    """A user-facing error: printed as `error: ...`, exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, exit 1 (argparse would print usage, exit 2)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m monolith.generate", description=__doc__)
    ap.add_argument("--model", required=True, help="target: hub id, checkpoint directory or pack directory")
    ap.add_argument("--draft", help="DSpark/DFlash draft for speculative decoding: hub id, checkpoint or pack "
                                    "directory")
    prompt = ap.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="raw prompt text")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    prompt.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"),
                    help="compute dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    ap.add_argument("--max-context", type=int, default=32768, help="prompt + generated tokens, at most")
    ap.add_argument("--prefill-chunk-size", type=int, default=512)
    ap.add_argument("--draft-block-size", type=int,
                    help="with --draft: proposals per round, 1..the draft's (default min(7, the draft's))")
    ap.add_argument("--draft-quantization", choices=("auto", "none", "nvfp4"),
                    help="with --draft: how the draft's pack is built (default auto: BF16 linears to NVFP4)")
    ap.add_argument("--spec-sched", choices=SCHEDULERS,
                    help="with --draft: proposals verified per round: fixed (all, default), threshold (cut at the "
                         "first estimated survival below --spec-threshold), cost (maximize expected tokens per "
                         "second from timings measured at start)")
    ap.add_argument("--spec-threshold", type=float,
                    help=f"with --spec-sched threshold: the survival cut-off (default {DEFAULT_THRESHOLD})")
    ap.add_argument("--revision", help="hub revision of --model")
    ap.add_argument("--local-files-only", action="store_true", help="never download (--model and --draft)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return ap


def load_target(pack, dtype: str):
    """The real model loader (imported late: the CLI's argument errors need no MLX model code)."""
    from .models import load_model

    return load_model(pack, dtype=dtype)


def load_drafter(source, model, dtype: str, quantization: str, local_files_only: bool = False):
    """The real draft loader (late import, as load_target)."""
    from .launch import load_drafter as load

    return load(source, model, dtype=dtype, quantization=quantization, local_files_only=local_files_only)


def main(argv=None, load=load_target, load_draft=load_drafter) -> int:
    args = build_parser().parse_args(argv)
    return run(args, load=load, load_draft=load_draft)


def run(args: argparse.Namespace, load=load_target, stdout=None, stderr=None, load_draft=load_drafter) -> int:
    """Run one generation from parsed arguments; `load(pack_dir, dtype)` makes the model,
    `load_draft(source, model, dtype, quantization)` the drafter (with --draft)."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    try:
        return _run(args, load, load_draft, stdout, stderr)
    except KeyboardInterrupt:
        print("\nerror: interrupted", file=stderr)
        return 130
    except (CliError, ValueError, OSError) as e:  # bad input, missing or corrupt files
        message = str(e)
    except Exception as e:  # noqa: BLE001 - an unreadable model must not end in a traceback
        message = f"{type(e).__name__}: {e}"
    print(f"error: {message}".replace("\n", " "), file=stderr)
    return 1


def _run(args, load, load_draft, stdout, stderr) -> int:
    given = [f"--{name.replace('_', '-')}" for name in SPECULATIVE_FLAGS if getattr(args, name) is not None]
    if given and args.draft is None:
        raise CliError(f"{', '.join(given)} only apply with --draft")
    if args.spec_threshold is not None and args.spec_sched != "threshold":
        raise CliError("--spec-threshold only applies with --spec-sched threshold")
    if args.spec_threshold is not None and not 0 <= args.spec_threshold <= 1:
        raise CliError(f"--spec-threshold must be in [0, 1], got {args.spec_threshold}")
    if args.draft_block_size is not None and args.draft_block_size < 1:
        raise CliError(f"--draft-block-size must be at least 1, got {args.draft_block_size}")
    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.min_p, args.seed)
    for flag, value, least in (("--max-tokens", args.max_tokens, 1), ("--max-context", args.max_context, 2),
                               ("--prefill-chunk-size", args.prefill_chunk_size, 1)):
        if value < least:
            raise CliError(f"{flag} must be at least {least}, got {value}")
    prompt_ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None

    from .pack import resolve_pack

    pack = resolve_pack(args.model, role="target", revision=args.revision, local_files_only=args.local_files_only)
    tokenizer = load_tokenizer(pack)
    if args.chat is not None:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.chat}])
    elif args.prompt is not None:
        prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise CliError("the prompt is empty")
    if len(prompt_ids) + 1 > args.max_context:  # checked before loading the model
        raise ContextLengthError(len(prompt_ids), args.max_context)
    model = load(pack, args.dtype)
    stop_ids = set(tokenizer.eos_token_ids) | set(_as_list(getattr(model.args, "eos_token_id", None)))
    drafter = None
    if args.draft is not None:
        drafter = load_draft(args.draft, model, args.dtype, args.draft_quantization or "auto",
                             local_files_only=args.local_files_only)
        if args.draft_block_size is not None and args.draft_block_size > drafter.max_proposals:
            raise CliError(f"--draft-block-size must be at most {drafter.max_proposals} "
                           f"(the draft's proposals per block), got {args.draft_block_size}")

    on_token = None
    if not args.json:
        detok = IncrementalDetokenizer(tokenizer)

        def on_token(token_id):
            piece = detok.add(token_id)
            if piece:
                stdout.write(piece)
                stdout.flush()

    if drafter is None:
        result = generate(model, prompt_ids, args.max_tokens, params, stop_ids, args.max_context,
                          prefill_chunk_size=args.prefill_chunk_size, on_token=on_token)
    else:
        from .runtime.speculative import generate_speculative

        scheduler = make_scheduler(args.spec_sched or "fixed", drafter.max_proposals, args.spec_threshold)
        result = generate_speculative(model, drafter, prompt_ids, args.max_tokens, params, stop_ids,
                                      args.max_context, prefill_chunk_size=args.prefill_chunk_size,
                                      block_size=args.draft_block_size, scheduler=scheduler,
                                      on_token=on_token, profile=args.json)
    if args.json:
        stdout.write(json.dumps(result_json(result, tokenizer.decode(result.token_ids)), ensure_ascii=False) + "\n")
    else:
        stdout.write(detok.flush() + "\n")
        stdout.flush()
        spec = result.speculative
        acceptance = "" if spec is None or not spec.rounds else (
            f" | rounds: {spec.rounds}, acceptance length {spec.acceptance_length:.2f} "
            f"({sum(spec.accepted_per_round)}/{sum(spec.proposed_per_round)} proposals accepted)")
        print(f"prompt: {result.prompt_tokens} tokens, {result.prefill_tok_s:.1f} tok/s | "
              f"generated: {len(result.token_ids)} tokens, {result.decode_tok_s:.1f} tok/s{acceptance} | "
              f"finish: {result.finish_reason}", file=stderr)
    return 0


def result_json(result, text: str) -> dict:
    """The --json object; the speculative fields are null in plain decoding, and
    speculative decoding adds the rest of `SpecStats.as_json()` (acceptance length,
    proposals per round, draft/verify/commit seconds, vLLM's counters)."""
    doc = {
        "token_ids": result.token_ids,
        "text": text,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "stats": {
            "prefill_tok_s": result.prefill_tok_s,
            "decode_tok_s": result.decode_tok_s,
            "prefill_seconds": result.prefill_seconds,
            "decode_seconds": result.decode_seconds,
            "rounds": None,
            "accepted_per_round": None,
            "per_position_acceptance": None,
        },
    }
    if result.speculative is not None:
        doc["stats"].update(result.speculative.as_json())
    return doc


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise CliError(f"--prompt-ids must be comma-separated token ids >= 0 (e.g. 1,2,3), got {text!r}")
    return ids


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


if __name__ == "__main__":
    sys.stdout.reconfigure(encoding="utf-8")  # generated text is UTF-8 whatever the locale says
    sys.exit(main())
