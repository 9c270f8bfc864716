"""python -m monolith.generate --model M [--draft D] (--prompt TEXT | --prompt-ids 1,2,3 | --chat TEXT):
generate from a prompt, streaming the text to stdout (then one stats line on stderr),
or print one JSON object with --json. Greedy unless --temperature is above 0. With
--draft, speculative decoding: the same output distribution (greedy: the same tokens),
and the stats gain rounds and acceptance; --json then also times the draft, verify and
commit stages (which adds host syncs per round). The model flags are serve's and
chat's (monolith.engine_setup); generate drafts every round unless --spec-sched says otherwise."""

from __future__ import annotations

import argparse
import json
import sys

from .blas import describe as describe_blas
from .blas import loaded_openblas, preload_openblas
from .cli import ArgumentParser, print_failure, quiet_when_stdout_closes
from .distributed import add_distributed_arguments, join
from .engine_setup import load_drafter, load_engine, load_target, resolve_sources
from .model_flags import NOT_A_BUG, SetupError, add_model_arguments, plan_model
from .runtime.events import ContextLengthError, Finished, GenerationRequest
from .sampling import SamplingParams, add_sampling_arguments
from .tokenizer import load_tokenizer


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m monolith.generate", description=__doc__)
    add_model_arguments(ap, model_required=True)
    prompt = ap.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="raw prompt text")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    prompt.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    ap.add_argument("--max-tokens", type=int, default=128)
    add_sampling_arguments(ap)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_distributed_arguments(ap)
    return ap


@quiet_when_stdout_closes
def main(argv=None, load=load_target, load_draft=load_drafter) -> int:
    args = build_parser().parse_args(argv)
    return run(args, load=load, load_draft=load_draft)


def run(args: argparse.Namespace, load=load_target, stdout=None, stderr=None, load_draft=load_drafter) -> int:
    """Run one generation from parsed arguments; `load(pack_dir, dtype)` makes the model,
    `load_draft(source, model, dtype, quantization, ...)` the drafter (with --draft)."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    try:
        return _run(args, load, load_draft, stdout, stderr)
    except KeyboardInterrupt:
        print("\nerror: interrupted", file=stderr)
        return 130
    except BrokenPipeError:
        raise  # stdout's reader left: quiet_when_stdout_closes
    except Exception as e:  # noqa: BLE001 - one error line (and a traceback if it is ours)
        print_failure(e, NOT_A_BUG, stderr)
        return 1


def _run(args, load, load_draft, stdout, stderr) -> int:
    plan = plan_model(args)
    params = SamplingParams.from_args(args)
    if args.max_tokens < 1:
        raise SetupError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    args.no_warmup = True  # one request: its own prefill is the warm-up
    if not args.distributed:
        return _generate(args, plan, params, ids, load, load_draft, stdout, stderr, None)
    rank = join(args, plan, log=lambda message: None)
    if not rank.leader:
        return rank.serve()
    try:
        return _generate(args, plan, params, ids, rank.target, load_draft, stdout, stderr, rank)
    finally:
        rank.close()


def _generate(args, plan, params, ids, load, load_draft, stdout, stderr, rank) -> int:
    sources = rank.sources if rank is not None else resolve_sources(args, plan, log=lambda message: None)
    prompt_ids = ids if ids is not None else prompt_tokens(args, load_tokenizer(sources.target_pack))
    if args.max_context is not None and len(prompt_ids) + 1 > args.max_context:  # checked before loading
        raise ContextLengthError(len(prompt_ids), args.max_context)
    engine = load_engine(args, plan, lambda message: None, sources=sources, fallback=False, profile=args.json,
                         load=load, load_draft=load_draft, cache_by_default=False)
    try:
        text, finished = engine.run_request(GenerationRequest(tuple(prompt_ids), args.max_tokens, params),
                                         on_text=None if args.json else lambda piece: _write(stdout, piece))
    finally:
        engine.close()
    if args.json:
        doc = result_json(finished, text)
        doc["blas"] = loaded_openblas() or "bundled"
        if rank is not None:
            doc["pipeline"] = rank.pipeline.traffic()
        stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
    else:
        stdout.write("\n")
        stdout.flush()
        print(stats_line(finished), file=stderr)
        if (blas := describe_blas()) is not None:
            print(blas, file=stderr)
    return 0


def prompt_tokens(args, tokenizer) -> list[int]:
    """The --chat or --prompt text as token ids."""
    if args.chat is not None:
        ids = tokenizer.encode_chat([{"role": "user", "content": args.chat}])
    else:
        ids = tokenizer.encode(args.prompt)
    if not ids:
        raise SetupError("the prompt is empty")
    return ids


def _write(stream, piece: str) -> None:
    stream.write(piece)
    stream.flush()


def stats_line(f: Finished) -> str:
    spec = f.speculative
    acceptance = "" if spec is None or not spec.rounds else (
        f" | rounds: {spec.rounds}, acceptance length {spec.acceptance_length:.2f} "
        f"({sum(spec.accepted_per_round)}/{sum(spec.proposed_per_round)} proposals accepted)")
    return (f"prompt: {f.usage.prompt_tokens} tokens, {f.prefill_tok_s:.1f} tok/s | "
            f"generated: {len(f.token_ids)} tokens, {f.decode_tok_s:.1f} tok/s{acceptance} | "
            f"finish: {f.finish_reason}")


def result_json(f: Finished, text: str) -> dict:
    """The --json object; the speculative fields are null in plain decoding, and
    speculative decoding adds the rest of `SpecStats.as_json()` (acceptance length,
    proposals per round, draft/verify/commit seconds, vLLM's counters)."""
    doc = {
        "token_ids": list(f.token_ids),
        "text": text,
        "finish_reason": f.finish_reason,
        "prompt_tokens": f.usage.prompt_tokens,
        "stats": {
            "prefill_tok_s": f.prefill_tok_s,
            "decode_tok_s": f.decode_tok_s,
            "prefill_seconds": f.prefill_seconds,
            "decode_seconds": f.decode_seconds,
            "rounds": None,
            "accepted_per_round": None,
            "per_position_acceptance": None,
        },
    }
    if f.speculative is not None:
        doc["stats"].update(f.speculative.as_json())
    return doc


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise SetupError(f"--prompt-ids must be comma-separated token ids >= 0 (e.g. 1,2,3), got {text!r}")
    return ids


if __name__ == "__main__":
    preload_openblas()  # re-executes this command once with OpenBLAS, where one is installed
    sys.stdout.reconfigure(encoding="utf-8")  # generated text is UTF-8 whatever the locale says
    sys.exit(main())
