"""The model flags `python -m monolith.serve`, `chat` and `generate` share
(`add_model_arguments`) and their check before anything is loaded (`plan_model`: a
`ModelPlan`, or a SetupError with one line); engine_setup.py turns a plan into a
running Engine.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from .cli import byte_size
from .models.kv_quant import KV_BITS
from .pack import VERIFY_MODES
from .pack.demo import DEMO_NAME
from .runtime.pipeline import PipelineError
from .runtime.prompt_cache import DEFAULT_MEMORY_SHARE
from .runtime.prompt_store import DEFAULT_DIR_BYTES
from .runtime.scheduler import DEFAULT_THRESHOLD, SCHEDULERS
from .runtime.sizing import CONTEXT_MEMORY_SHARE

MTP_DRAFT = "mtp"  # --draft mtp: the target checkpoint's own MTP head (runtime/mtp_drafter.py)
MTP_NOT_APPLICABLE = ("draft_quantization", "draft_revision", "draft_pack")  # the head comes with the target's pack
SPECULATIVE_FLAGS = ("draft_block_size", "draft_quantization", "spec_sched", "spec_threshold", "draft_revision",
                     "draft_pack")


class SetupError(Exception):
    """Bad flags or a model that cannot be served: one line for the user, exit 1."""


# one line, no traceback (cli.print_failure): bad input, missing or corrupt files, a lost rank
NOT_A_BUG = (SetupError, ValueError, OSError, PipelineError)


class _ModelAction(argparse.Action):
    """--model, which serve takes more than once: `models` lists them all, `model` is the first."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.models = [*(namespace.models or ()), value]
        namespace.model = namespace.models[0]


class _DraftAction(argparse.Action):
    """--draft, appended to `draft` as ever; `draft_for` also pairs it with the --model
    given before it (0: the first, also for a --draft before any --model)."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.draft = [*(namespace.draft or ()), value]
        namespace.draft_for = [*(namespace.draft_for or ()), (max(len(namespace.models or ()) - 1, 0), value)]


def add_model_arguments(ap: argparse.ArgumentParser, model_required: bool = False) -> None:
    ap.add_argument("--model", required=model_required, action=_ModelAction,
                    help="target: hub id, checkpoint directory or pack directory"
                         + ("" if model_required else " (default: the bundled demo pair)")
                         + "; serve takes it more than once (docs/serving.md, \"Several models\")")
    ap.set_defaults(models=None, draft_for=None)
    draft = ap.add_mutually_exclusive_group()
    draft.add_argument("--draft", action=_DraftAction,
                       help="DSpark/DFlash draft for speculative decoding: hub id, checkpoint or pack; `mtp`: the "
                            "target checkpoint's own MTP head (its pack is built --with-mtp). One --draft forces "
                            "that drafter; given more than once, serve and chat measure each at start and use the "
                            "one with the best expected tokens per second, or none (docs/drafts.md 7). With "
                            "several --model, a --draft drafts for the --model before it")
    draft.add_argument("--no-draft", action="store_true", help="plain decoding (also for the demo pair)")
    ap.add_argument("--draft-quantization", choices=("auto", "none", "nvfp4"),
                    help="with a draft: how the draft's pack is built (default auto, the same as nvfp4 for a "
                         "draft: its float linears, BF16, F16 or F32, to NVFP4, except the confidence and Markov "
                         "head pieces the DSpark recipe keeps; FP8 and NVFP4 linears stay as they are; none: "
                         "keep every linear in its source precision)")
    ap.add_argument("--draft-block-size", type=int, help="with a draft: proposals per round, 1..the draft's "
                                                         "(default min(7, the draft's))")
    ap.add_argument("--spec-sched", choices=SCHEDULERS,
                    help="with a draft: proposals verified per round: fixed (all), threshold (cut at the first "
                         "estimated survival below --spec-threshold), cost (maximize expected tokens per second "
                         "from timings measured at start); serve and chat default to fixed with plain steps while "
                         "drafting does not pay, naming a scheduler always drafts")
    ap.add_argument("--spec-threshold", type=float,
                    help=f"with --spec-sched threshold: the survival cut-off (default {DEFAULT_THRESHOLD})")
    ap.add_argument("--max-context", type=int,
                    help="prompt + generated tokens, at most (default: the model's own context, its config's "
                         "max_position_embeddings, capped so that the running sequences' caches at it take at most "
                         f"{CONTEXT_MEMORY_SHARE:.0%}% of the memory free after loading)")
    ap.add_argument("--kv-bits", type=int, choices=KV_BITS,
                    help="store the target's attention KV cache quantized to these bits (group-wise, a scale and "
                         "bias per 64 values): about half (8) or a quarter (4) of the bytes a token of context takes, "
                         "so a longer default --max-context; default: as computed (docs/operations.md, Memory)")
    ap.add_argument("--pack", help="the target's pack directory: used as is if it holds a pack, "
                                   "else built there from --model (default: the pack cache)")
    ap.add_argument("--draft-pack", help="the draft's pack directory (as --pack)")
    ap.add_argument("--verify-pack", choices=VERIFY_MODES, default="first",
                    help="check every pack's hashes and files against its manifest before use: first (default: "
                         "once, again when a file changes), always (every start), never (unchecked, logged)")
    ap.add_argument("--revision", help="hub revision of --model")
    ap.add_argument("--draft-revision", help="hub revision of --draft")
    ap.add_argument("--local-files-only", action="store_true", help="never download")
    ap.add_argument("--prefill-chunk-size", type=int, default=512)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"),
                    help="compute dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation after loading")
    ap.add_argument("--no-vision", action="store_true",
                    help="text only: never load the target's vision tower (requests with images are refused)")
    cache = ap.add_argument_group("prompt cache (prefixes of earlier requests, reused exactly)")
    cache.add_argument("--prompt-cache-size", type=byte_size, metavar="BYTES",
                       help="memory for saved states, e.g. 4G; 0 turns the cache off (default "
                            f"{DEFAULT_MEMORY_SHARE:.0%}% of the memory free after loading)")
    cache.add_argument("--prompt-cache-save-every", type=int, metavar="N",
                       help="also save the state every N prompt tokens while prefilling, besides at each message's "
                            "end and the prompt's (default: the fewest tokens, a multiple of --prefill-chunk-size, "
                            "whose KV takes the bytes of one saved state's recurrent states; 0: only those)")
    cache.add_argument("--prompt-cache-checkpoint-every", dest="prompt_cache_save_every", type=int,
                       help=argparse.SUPPRESS)  # the deprecated name of --prompt-cache-save-every
    cache.add_argument("--prompt-cache-dir", metavar="DIR",
                       help="keep saved states in DIR across restarts (default: in memory only)")
    cache.add_argument("--prompt-cache-dir-size", type=byte_size, default=DEFAULT_DIR_BYTES, metavar="BYTES",
                       help=f"most bytes the --prompt-cache-dir files take (default {DEFAULT_DIR_BYTES >> 30}G)")


@dataclass(frozen=True)
class ModelPlan:
    """What the flags ask for, checked before anything is loaded."""

    target: str | None  # --model (None: the demo pair or --pack)
    drafts: tuple[str, ...]  # --draft's values, or --draft-pack's (the demo's are added by resolve_sources)
    draft_explicit: bool
    name: str  # the default served model name

    @property
    def forced(self) -> bool:
        """One drafter named: it is used (no choice by measurement)."""
        return self.draft_explicit and len(self.drafts) == 1


def plan_model(args: argparse.Namespace) -> ModelPlan:
    """Check the model flags (raise SetupError with one line); nothing is loaded. One
    --model only: serve splits several first (serve.model_arguments)."""
    if len(args.models or ()) > 1:
        raise SetupError(f"--model is given {len(args.models)} times: only `python -m monolith.serve` serves "
                         "several models")
    for flag, value, least in (("--max-context", args.max_context, 2),
                               ("--prefill-chunk-size", args.prefill_chunk_size, 1),
                               ("--draft-block-size", args.draft_block_size, 1),
                               ("--prompt-cache-save-every", args.prompt_cache_save_every, 0),
                               ("--prompt-cache-dir-size", args.prompt_cache_dir_size, 1)):
        if value is not None and value < least:
            raise SetupError(f"{flag} must be at least {least}, got {value}")
    demo = args.model is None and args.pack is None
    explicit = args.draft is not None or args.draft_pack is not None
    if args.no_draft or not (explicit or demo):
        given = [f"--{n.replace('_', '-')}" for n in SPECULATIVE_FLAGS if getattr(args, n) is not None]
        if given:
            raise SetupError(f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} with a draft (--draft)")
    named = tuple(args.draft or ())
    if len(set(named)) < len(named):
        raise SetupError(f"--draft names the same drafter twice: {', '.join(named)}")
    if named == (MTP_DRAFT,):
        given = [f"--{n.replace('_', '-')}" for n in MTP_NOT_APPLICABLE if getattr(args, n) is not None]
        if given:
            raise SetupError(f"{', '.join(given)} do{'es' if len(given) == 1 else ''} not apply to --draft mtp "
                             "(the MTP head is packed with the target, as the target's pack says)")
    if args.draft_pack is not None and len([d for d in named if d != MTP_DRAFT]) > 1:
        raise SetupError("--draft-pack is one draft's pack: give it with one DSpark --draft")
    if args.prompt_cache_dir is not None and args.prompt_cache_size == 0:
        raise SetupError("--prompt-cache-dir needs a prompt cache: drop --prompt-cache-size 0")
    if args.prompt_cache_dir is not None and Path(args.prompt_cache_dir).exists() \
            and not Path(args.prompt_cache_dir).is_dir():
        raise SetupError(f"--prompt-cache-dir {args.prompt_cache_dir} is not a directory")
    if args.spec_threshold is not None and args.spec_sched != "threshold":
        raise SetupError("--spec-threshold only applies with --spec-sched threshold")
    if args.spec_threshold is not None and not 0 <= args.spec_threshold <= 1:
        raise SetupError(f"--spec-threshold must be in [0, 1], got {args.spec_threshold}")
    if args.model is not None:
        name = args.model
    elif args.pack is not None:
        name = Path(args.pack).resolve().name
    else:
        name = DEMO_NAME
    drafts = named or ((args.draft_pack,) if args.draft_pack is not None else ())
    return ModelPlan(args.model, drafts, explicit, name)
