"""Flags -> packs -> target + drafter -> Engine.

The model flags `python -m monolith.serve`, `chat` and `generate` share, checked once
here (`plan_model`) before anything is loaded, and turning them into a running Engine:
pack resolution with progress, the target and the draft, the decoder and its
scheduling policy, warm-up. `load_target` and `load_drafter` take anything a user
names (a hub id, a checkpoint directory or a pack directory) and resolve it into a
pack first; the models themselves only read packs.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from .blas import describe as describe_blas
from .cli import byte_size
from .drafter_choice import Candidate, Choice, choose_drafter, decision, on_request
from .models import load_draft, load_model, load_mtp
from .models.kv_quant import KV_BITS
from .models.vision import Vision, vision_of
from .pack import VERIFY_MODES, PackError, build_pack, ensure_verified, is_pack, read_manifest, resolve_pack
from .pack.catalog import cached_or_path
from .pack.demo import DEMO_NAME, demo_pair
from .runtime.calibrate import (
    BreakEven,
    measure_break_even,
    measure_cost_curve,
    measure_step_costs,
    round_can_pay,
    round_pay_limit,
)
from .runtime.decoder import Decoder
from .runtime.draft_model import DraftModelDrafter
from .runtime.engine import Engine
from .runtime.mtp_drafter import MTPDrafter
from .runtime.pipeline import PipelineError
from .runtime.prompt_cache import DEFAULT_MEMORY_SHARE, PromptCache, default_budget, save_interval
from .runtime.prompt_store import DEFAULT_DIR_BYTES, PromptStore
from .runtime.rounds import check_gamma
from .runtime.scheduler import DEFAULT_THRESHOLD, SCHEDULERS, make_scheduler
from .runtime.sizing import CONTEXT_MEMORY_SHARE, SizingError, batch_memory, choose_context
from .runtime.state_file import identity
from .sampling import SamplingParams
from .tokenizer import load_tokenizer

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


def load_target(source, dtype=None, dense: bool | None = None, verify: str = "first", **resolve_options):
    """The target model of `source` (hub id, checkpoint or pack directory; packed once
    into the cache), its pack verified as `verify` (--verify-pack) says."""
    pack = resolve_pack(source, role="target", verify=verify, **resolve_options)
    return load_model(pack, dtype=dtype, dense=dense, verify=verify)


def load_drafter(source, target, dtype=None, quantization: str = "auto", dense: bool | None = None,
                 verify: str = "first", **resolve_options) -> DraftModelDrafter:
    """The drafter over the DSpark / DFlash draft of `source` (hub id, checkpoint or pack
    directory; packed once into the cache, NVFP4 by default) for `target`, its pack
    verified as `verify` says; raises DraftError (a ValueError) when the draft does not
    fit the target."""
    pack = resolve_pack(source, role="draft", quantization=quantization, verify=verify, **resolve_options)
    return DraftModelDrafter(load_draft(pack, target, dtype=dtype, dense=dense, verify=verify))


@dataclass(frozen=True)
class Sources:
    target_pack: Path
    drafts: tuple[str, ...] = ()  # the drafters to load: pack directories or any source, MTP_DRAFT the target's head


def resolve_sources(args: argparse.Namespace, plan: ModelPlan, log) -> Sources:
    """The target's pack (the demo pair's, --pack's, or --model's resolved) and the
    drafters' sources, building packs where the flags ask for them; every pack named
    here is verified (--verify-pack) before anything reads it. Without --draft the
    target's MTP head is a drafter where its pack carries one (the demo's does), beside
    the demo's DSpark draft."""
    target, drafts = plan.target, plan.drafts
    args = argparse.Namespace(**vars(args) | {"pack": cached_or_path(args.pack),
                                              "draft_pack": cached_or_path(args.draft_pack)})
    auto = not args.no_draft and not plan.draft_explicit
    with_mtp = MTP_DRAFT in drafts
    if target is None and args.pack is None:
        with_mtp = with_mtp or auto
        target, demo_draft = demo_pair(log, verify=args.verify_pack, with_mtp=with_mtp)
        if auto:
            drafts = (str(demo_draft),)
    if args.pack is not None and is_pack(Path(args.pack)):
        pack = Path(args.pack)
    elif args.pack is not None:
        if target is None:
            raise SetupError(f"--pack {args.pack} holds no pack; give --model to build it there")
        log(f"building the target pack of {target} into {args.pack}")
        pack = build_pack(target, args.pack, role="target", revision=args.revision,
                          local_files_only=args.local_files_only, with_mtp=with_mtp)
    else:
        log(f"resolving the target {target}")
        pack = resolve_pack(target, role="target", revision=args.revision, local_files_only=args.local_files_only,
                            verify=args.verify_pack, with_mtp=with_mtp)
    ensure_verified(pack, args.verify_pack)
    if auto and (read_manifest(pack).get("layout") or {}).get("mtp"):
        drafts += (MTP_DRAFT,)
    if args.draft_pack is not None:
        drafts = tuple(d for d in drafts if d == MTP_DRAFT) + (_draft_pack(args, log),)
    return Sources(pack, drafts)


def _draft_pack(args, log) -> str:
    """--draft-pack, built from the DSpark --draft first when it holds no pack, verified."""
    named = [d for d in args.draft or () if d != MTP_DRAFT]
    if not is_pack(Path(args.draft_pack)):
        if not named:
            raise SetupError(f"--draft-pack {args.draft_pack} holds no pack; give --draft to build it there")
        log(f"building the draft pack of {named[0]} into {args.draft_pack}")
        build_pack(named[0], args.draft_pack, role="draft", quantization=args.draft_quantization or "auto",
                   revision=args.draft_revision, local_files_only=args.local_files_only)
    ensure_verified(args.draft_pack, args.verify_pack)
    return args.draft_pack


def load_engine(args: argparse.Namespace, plan: ModelPlan, log, max_queue: int = 64, queue_timeout: float = 300.0,
                sources: Sources | None = None, fallback: bool = True, profile: bool = False,
                load=load_target, load_draft=load_drafter, cache_by_default: bool = True,
                max_batch: int = 1) -> Engine:
    """Resolve and load the target (and draft), build the Engine, warm it up. `log(text)`
    reports each stage; pack builds and downloads show their own progress bars. With
    `fallback` and no --spec-sched, rounds take plain steps while drafting does not pay
    (serve, chat); generate always drafts. `load` / `load_draft` make the models. Without
    `cache_by_default` (generate: one request per process) the prompt cache is on only
    when a --prompt-cache flag asks for it. `max_batch` sequences run at once (serve's
    --max-batch): their caches must fit the memory free after loading. Without
    --max-context the context is the model's own, capped by memory (`choose_context`)."""
    started = time.perf_counter()
    if (blas := describe_blas()) is not None:
        log(blas)
    sources = sources or resolve_sources(args, plan, log)
    model = load(sources.target_pack, dtype=args.dtype, verify=args.verify_pack)
    model.kv_bits = args.kv_bits
    log(f"loaded the target from {sources.target_pack} ({model.dtype}, {model.dense_summary} weights"
        + (f", {model.kv_bits}-bit KV cache)" if model.kv_bits else ")"))
    tokenizer = load_tokenizer(sources.target_pack)
    candidates = [Candidate(name, mtp_drafter(sources.target_pack, model, args.verify_pack, log) if name == MTP_DRAFT
                            else speculative_drafter(args, model, name, log, load_draft)) for name in sources.drafts]
    choice = choose_drafter(args, plan, model, tokenizer, candidates, log, fallback)
    drafter = choice.candidate.drafter if choice.candidate is not None else None
    try:
        context = choose_context(args.max_context, model, drafter, max_batch, log)
    except SizingError as e:
        raise SetupError(str(e)) from None
    args = argparse.Namespace(**vars(args) | {"max_context": context})  # the flags, with the context chosen
    decoder, draft_name, not_drafting = None, None, choice.not_drafting
    if drafter is not None:
        decoder, draft_name, not_drafting = _drafting(args, plan, choice, model, log, fallback, profile, max_batch)
    drafter = None if decoder is None else decoder.drafter
    on_request_decoder, on_request_name = on_request(choice, decoder, args, model)
    reserved = None
    if on_request_decoder is not None:  # the caches of requests that ask to draft count too, where they fit
        try:
            reserved = batch_memory(model, on_request_decoder.drafter, args.max_context, max_batch, log)
        except SizingError:
            on_request_decoder = on_request_name = None
    try:
        reserved = reserved if reserved is not None else batch_memory(model, drafter, args.max_context, max_batch, log)
    except SizingError as e:
        raise SetupError(str(e)) from None
    log(decision(draft_name, not_drafting, args)
        + (f"; a request may ask to draft with {on_request_name} (monolith.draft)"
           if on_request_decoder and not draft_name else ""))
    engine = Engine(model, tokenizer, max_context=args.max_context, prefill_chunk_size=args.prefill_chunk_size,
                    max_queue=max_queue, queue_timeout=queue_timeout, decoder=decoder, draft_name=draft_name,
                    not_drafting=not_drafting, draft_decoder=on_request_decoder, draft_decoder_name=on_request_name,
                    prompt_cache=prompt_cache(args, model, drafter, log, cache_by_default, reserved),
                    max_batch=max_batch, vision=target_vision(args, sources.target_pack, model, log))
    if not args.no_warmup:
        log("warming up")
        engine.warmup()
    log(f"ready in {time.perf_counter() - started:.1f} s: {plan.name}"
        + (f" with draft {draft_name}" if draft_name else " (plain decoding)"))
    return engine


def target_vision(args, target_pack: Path, model, log) -> Vision | None:
    """The target's Vision (its tower loads on the first image) where its pack carries
    one; None with --no-vision, for a pipeline (--distributed: no rank holds the tower)
    and for a pack without a tower (built --no-vision, or a text-only checkpoint)."""
    if args.no_vision or args.distributed:
        return None
    vision = vision_of(target_pack, model.dtype)
    if vision is not None:
        log("the target takes images: its vision tower loads on the first image")
    return vision


def _drafting(args, plan: ModelPlan, choice: Choice, model, log, fallback: bool, profile: bool,
              max_batch: int) -> tuple[Decoder | None, str | None, str | None]:
    """(the decoder that drafts or None, the draft's name when it drafts, why the loaded
    draft does not draft otherwise): the break-even says drafting cannot pay here, or
    the demo draft does not suit the flags."""
    name, drafter = choice.candidate.name, choice.candidate.drafter
    try:
        decoder, measured = drafting_decoder(args, model, drafter, log, fallback, profile, max_batch, choice.gamma,
                                             choice.cost)
    except SetupError as e:
        if plan.draft_explicit:
            raise
        log(f"the demo draft is not used, plain decoding: {e}")
        return None, None, f"draft {name} loaded, not drafting: {e}"
    if decoder is None:
        return None, None, (f"draft {name} loaded, not drafting: a drafted round costs {measured.describe()} here, "
                            "too many to pay (--spec-sched fixed drafts anyway)")
    return decoder, name, None


def prompt_cache(args, model, drafter, log, by_default: bool = True, reserved: int = 0) -> PromptCache | None:
    """The prompt cache the flags ask for (None: --prompt-cache-size 0, or no flag and not
    `by_default`), with its store when --prompt-cache-dir is given. Its default budget is a
    share of the memory free after `reserved` bytes (the running sequences' caches)."""
    if not by_default and args.prompt_cache_size is None and args.prompt_cache_dir is None:
        return None
    budget = args.prompt_cache_size if args.prompt_cache_size is not None else default_budget(reserved)
    if not budget:
        log("prompt cache off")
        return None
    store = None
    if args.prompt_cache_dir is not None:
        try:
            store = PromptStore(args.prompt_cache_dir, args.prompt_cache_dir_size, identity(model, drafter))
        except OSError as e:
            raise SetupError(f"--prompt-cache-dir {args.prompt_cache_dir}: {e}") from None
    every = args.prompt_cache_save_every
    if every is None:
        every = save_interval(model, drafter, args.prefill_chunk_size)
    log(f"prompt cache: {budget / 2**30:.2f} GiB, states saved at message ends"
        + (f" and every {every} tokens" if every else "")
        + (f", kept in {store.directory} ({store.files} files, {store.nbytes / 2**30:.2f} of "
           f"{store.max_bytes / 2**30:.2f} GiB)" if store is not None else ""))
    return PromptCache(budget, every, store)


def speculative_drafter(args, model, draft: str, log, load_draft=load_drafter) -> DraftModelDrafter:
    """The drafter over the draft of `draft` for `model`, loaded as the draft flags say
    (`drafting_decoder` makes the decoder that runs it)."""
    quantization = args.draft_quantization or "auto"
    log(f"loading the draft {draft} (quantization {quantization})")
    return load_draft(draft, model, dtype=args.dtype, quantization=quantization, revision=args.draft_revision,
                      local_files_only=args.local_files_only, verify=args.verify_pack)


def mtp_drafter(target_pack, model, verify: str, log) -> MTPDrafter:
    """The drafter over the MTP head of the target's own pack (--draft mtp)."""
    try:
        head = load_mtp(target_pack, model, verify=verify)
    except PackError as e:
        raise SetupError(f"--draft mtp: {e}") from None
    drafter = MTPDrafter(head)
    log(f"loaded the target's MTP head: up to {drafter.max_proposals} proposals a round, one head step each")
    return drafter


def drafting_decoder(args, model, drafter, log, fallback: bool = True, profile: bool = False,
                     max_batch: int = 1, gamma: int | None = None,
                     measured: BreakEven | None = None) -> tuple[Decoder | None, BreakEven | None]:
    """(the speculative decoder the flags ask for, the break-even measured for its
    fallback or None). The decoder is None when that break-even says a drafted round
    costs about as many plain steps as the tokens it can emit or more (drafting can never
    pay on this machine: e.g. MLX's Linux CPU wheel, where an 8-row verify costs ~10
    one-row steps). `gamma` and `measured`: the proposals a round and the break-even
    choose_drafter measured (it found that drafting pays). Where drafting pays, the
    break-even is measured at longer contexts too (calibrate.measure_cost_curve) and, with
    `max_batch` > 1, the batch's forward costs: the fallback follows both (fallback.py)."""
    if args.draft_block_size is not None and args.draft_block_size > drafter.max_proposals:
        raise SetupError(f"--draft-block-size must be at most {drafter.max_proposals} "
                         f"(the draft's proposals per block), got {args.draft_block_size}")
    gamma = gamma or check_gamma(args.draft_block_size, drafter.max_proposals)
    scheduler = make_scheduler(args.spec_sched or "fixed", drafter.max_proposals, args.spec_threshold)
    if measured is None and fallback and args.spec_sched is None:
        measured = measure_break_even(model, drafter, gamma, SamplingParams())
        cut = f"drafting pays below {round_pay_limit(gamma):.1f} (a round emits at most {gamma + 1} tokens)"
        if not round_can_pay(measured.steps, gamma):
            log(f"a drafted round costs {measured.describe()} here; {cut}: it cannot pay")
            return None, measured
        log(f"a drafted round costs {measured.describe()} here; {cut}: a request drafts while its rounds emit "
            "at least that many tokens, and takes plain steps otherwise")
    curve = None
    if measured is not None:  # drafting pays at a short context: priced at the longer ones too
        curve = measure_cost_curve(model, drafter, gamma, SamplingParams(), args.max_context, measured)
        log(f"a drafted round costs, in plain steps: {curve.describe()} (a request is priced at its context)")
    costs = None
    if max_batch > 1 and measured is not None:
        costs = measure_step_costs(model, max_batch, gamma + 1)
        log(f"a batch's forward costs {costs.one_row * 1e3:.2f} ms for one row, +{costs.per_row * 1e3:.2f} ms a row "
            f"and +{costs.per_sequence * 1e3:.2f} ms a sequence: a request drafts while that pays for the batch")
    decoder = Decoder(model, drafter, args.max_context, args.prefill_chunk_size, gamma, scheduler, curve)
    decoder.step_costs, decoder.profile = costs, profile
    return decoder, measured
