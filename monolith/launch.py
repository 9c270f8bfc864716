"""Flags -> packs -> target + drafter -> Engine: the model flags `python -m monolith.serve`,
`chat` and `generate` share, and turning them into a running Engine (pack resolution
with progress, load, warmup). `load_target` and `load_drafter` take anything a user
names (a hub id, a checkpoint directory or a pack directory) and resolve it into a
pack first; the models themselves only read packs."""

from __future__ import annotations

import argparse
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

from .pack.demo import DEMO_NAME, demo_pair

SPECULATIVE_FLAGS = ("draft_block_size", "draft_quantization", "spec_sched", "draft_revision", "draft_pack")
SPECULATIVE_MODULES = ("monolith.runtime.speculative", "monolith.models.dspark")


class SetupError(Exception):
    """Bad flags or a model that cannot be served: one line for the user, exit 1."""


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="target: hub id, checkpoint directory or pack directory "
                                    "(default: the bundled demo pair)")
    draft = ap.add_mutually_exclusive_group()
    draft.add_argument("--draft", help="DSpark/DFlash draft for speculative decoding: hub id, checkpoint or pack")
    draft.add_argument("--no-draft", action="store_true", help="plain decoding (also for the demo pair)")
    ap.add_argument("--draft-quantization", choices=("auto", "none", "nvfp4"), help="with a draft (default auto)")
    ap.add_argument("--draft-block-size", type=int, help="with a draft: 1..the checkpoint's block size "
                                                         "(default min(7, block))")
    ap.add_argument("--spec-sched", choices=("fixed", "threshold", "cost"),
                    help="with a draft: proposals verified per round (default: fixed, with plain steps while "
                         "drafting does not pay; naming a scheduler always drafts)")
    ap.add_argument("--max-context", type=int, default=32768, help="prompt + generated tokens, at most")
    ap.add_argument("--pack", help="the target's pack directory: used as is if it holds a pack, "
                                   "else built there from --model (default: the pack cache)")
    ap.add_argument("--draft-pack", help="the draft's pack directory (as --pack)")
    ap.add_argument("--revision", help="hub revision of --model")
    ap.add_argument("--draft-revision", help="hub revision of --draft")
    ap.add_argument("--local-files-only", action="store_true", help="never download")
    ap.add_argument("--prefill-chunk-size", type=int, default=512)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"),
                    help="compute dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation after loading")


@dataclass(frozen=True)
class ModelPlan:
    """What the flags ask for, checked before anything is loaded."""

    target: str | None  # --model (None: the demo pair or --pack)
    draft: str | None  # --draft, or the demo draft
    draft_explicit: bool
    name: str  # the default served model name


def plan_model(args: argparse.Namespace) -> ModelPlan:
    """Check the model flags (raise SetupError with one line); nothing is loaded."""
    if args.max_context < 2:
        raise SetupError(f"--max-context must be at least 2, got {args.max_context}")
    if args.prefill_chunk_size < 1:
        raise SetupError(f"--prefill-chunk-size must be at least 1, got {args.prefill_chunk_size}")
    if args.draft_block_size is not None and args.draft_block_size < 1:
        raise SetupError(f"--draft-block-size must be at least 1, got {args.draft_block_size}")
    demo = args.model is None and args.pack is None
    explicit = args.draft is not None or args.draft_pack is not None
    if args.no_draft or not (explicit or demo):
        given = [f"--{n.replace('_', '-')}" for n in SPECULATIVE_FLAGS if getattr(args, n) is not None]
        if given:
            raise SetupError(f"{', '.join(given)} only apply{'s' if len(given) == 1 else ''} with a draft (--draft)")
    if explicit and not speculative_available():
        raise SetupError("speculative decoding (--draft) is not available yet: "
                         f"{' and '.join(SPECULATIVE_MODULES)} are not built; run without --draft")
    if args.model is not None:
        name = args.model
    elif args.pack is not None:
        name = Path(args.pack).resolve().name
    else:
        name = DEMO_NAME
    draft = args.draft if not args.no_draft else None
    if draft is None and args.draft_pack is not None:
        draft = args.draft_pack
    return ModelPlan(args.model, draft, explicit, name)


def load_target(source, dtype=None, dense: bool | None = None, **resolve_options):
    """The target model of `source` (hub id, checkpoint or pack directory; packed once
    into the cache)."""
    from .models import load_model
    from .pack import resolve_pack

    return load_model(resolve_pack(source, role="target", **resolve_options), dtype=dtype, dense=dense)


def load_drafter(source, target, dtype=None, quantization: str = "auto", dense: bool | None = None,
                 **resolve_options):
    """The drafter over the DSpark / DFlash draft of `source` (hub id, checkpoint or pack
    directory; packed once into the cache, NVFP4 by default) for `target`; raises
    DraftError (a ValueError) when the draft does not fit the target."""
    from .models import load_draft
    from .pack import resolve_pack
    from .runtime.drafter import DraftModelDrafter

    pack = resolve_pack(source, role="draft", quantization=quantization, **resolve_options)
    return DraftModelDrafter(load_draft(pack, target, dtype=dtype, dense=dense))


def speculative_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in SPECULATIVE_MODULES)


def load_engine(args: argparse.Namespace, plan: ModelPlan, log, max_queue: int = 64, queue_timeout: float = 300.0):
    """Resolve and load the target (and draft), build the Engine, warm it up. `log(text)`
    reports each stage; pack builds and downloads show their own progress bars."""
    from .models import load_model
    from .pack import build_pack, is_pack, resolve_pack
    from .runtime.engine import Engine
    from .tokenizer import load_tokenizer

    started = time.perf_counter()
    target, draft = plan.target, plan.draft
    demo = target is None and args.pack is None
    if demo:
        target, demo_draft = demo_pair(log)
        if draft is None and not args.no_draft:
            draft = str(demo_draft)
    if args.pack is not None and is_pack(Path(args.pack)):
        pack = Path(args.pack)
    elif args.pack is not None:
        if target is None:
            raise SetupError(f"--pack {args.pack} holds no pack; give --model to build it there")
        log(f"building the target pack of {target} into {args.pack}")
        pack = build_pack(target, args.pack, role="target", revision=args.revision,
                          local_files_only=args.local_files_only)
    else:
        log(f"resolving the target {target}")
        pack = resolve_pack(target, role="target", revision=args.revision, local_files_only=args.local_files_only)
    model = load_model(pack, dtype=args.dtype)
    log(f"loaded the target from {pack} ({model.dtype}, {model.dense_summary} weights)")
    tokenizer = load_tokenizer(pack)
    backend, draft_name = None, None
    if draft is not None:
        try:
            backend, draft_name = _speculative_backend(args, model, draft, log)
        except SetupError as e:
            if plan.draft_explicit:
                raise
            log(f"the demo draft is not used, plain decoding: {e}")
    engine = Engine(model, tokenizer, max_context=args.max_context, prefill_chunk_size=args.prefill_chunk_size,
                    max_queue=max_queue, queue_timeout=queue_timeout, backend=backend, draft_name=draft_name)
    if not args.no_warmup:
        log("warming up")
        engine.warmup()
    log(f"ready in {time.perf_counter() - started:.1f} s: {plan.name}"
        + (f" with draft {draft_name}" if draft_name else " (plain decoding)"))
    return engine


def _speculative_backend(args, model, draft, log):
    """The engine backend that runs speculative rounds with the draft, and the draft's
    name; (None, None) when serve's fallback measures that a drafted round costs more
    plain steps than the tokens it can emit (drafting can never pay on this machine:
    e.g. MLX's Linux CPU wheel without an optimized BLAS, where an 8-row verify costs
    ~13 one-row steps)."""
    if not speculative_available():
        raise SetupError("speculative decoding is not available yet: "
                         f"{' and '.join(SPECULATIVE_MODULES)} are not built")
    from .pack import build_pack, is_pack
    from .runtime.backends import SpeculativeBackend
    from .runtime.scheduler import make_scheduler, round_can_pay

    quantization = args.draft_quantization or "auto"
    source = draft
    if args.draft_pack is not None:
        if not is_pack(Path(args.draft_pack)):
            if draft is None:
                raise SetupError(f"--draft-pack {args.draft_pack} holds no pack; give --draft to build it there")
            log(f"building the draft pack of {draft} into {args.draft_pack}")
            build_pack(draft, args.draft_pack, role="draft", quantization=quantization, revision=args.draft_revision,
                       local_files_only=args.local_files_only)
        source = args.draft_pack
    log(f"loading the draft {source} (quantization {quantization})")
    drafter = load_drafter(source, model, dtype=args.dtype, quantization=quantization,
                           revision=args.draft_revision, local_files_only=args.local_files_only)
    try:
        backend = SpeculativeBackend(model, drafter, args.max_context, args.prefill_chunk_size,
                                     args.draft_block_size, make_scheduler(args.spec_sched or "fixed",
                                                                           max_positions=drafter.max_proposals),
                                     fallback=args.spec_sched is None)
    except ValueError as e:  # a block size the draft cannot do
        raise SetupError(f"--draft-block-size: {e}") from None
    if backend.break_even is not None and not round_can_pay(backend.break_even, backend.block_size):
        log(f"a drafted round costs {backend.break_even:.1f} plain steps here, more than the "
            f"{backend.block_size + 1} tokens it can emit: serving with plain decoding (--spec-sched fixed "
            "drafts anyway)")
        return None, None
    if backend.break_even is not None:
        log(f"a drafted round costs {backend.break_even:.1f} plain steps here: a request drafts while its "
            "rounds emit at least that many tokens, and takes plain steps otherwise")
    return backend, str(draft or args.draft_pack)
