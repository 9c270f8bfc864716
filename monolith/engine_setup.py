"""Flags -> packs -> target + drafter -> Engine.

A model plan (model_flags.py: the model flags, checked before anything is loaded)
turned into a running Engine: pack resolution with progress, the target and the draft,
the decoder and its scheduling policy, warm-up. `load_target` and `load_drafter` take anything a user
names (a hub id, a checkpoint directory or a pack directory) and resolve it into a
pack first; the models themselves only read packs.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from .blas import describe as describe_blas
from .drafter_choice import Candidate, Choice, choose_drafter, decision, on_request
from .model_flags import MTP_DRAFT, ModelPlan, SetupError
from .models import load_draft, load_model, load_mtp
from .models.vision import Vision, vision_of
from .pack import (
    PackError,
    build_pack,
    ensure_verified,
    is_pack,
    read_manifest,
    resolve_pack,
)
from .pack.catalog import cached_or_path
from .pack.demo import demo_pair
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
from .runtime.drafter import check_gamma
from .runtime.engine import Drafting, Engine, Limits
from .runtime.mtp_drafter import MTPDrafter
from .runtime.prompt_cache import (
    PromptCache,
    default_budget,
    save_interval,
)
from .runtime.prompt_store import PromptStore
from .runtime.scheduler import make_scheduler
from .runtime.sizing import (
    SizingError,
    batch_memory,
    choose_context,
)
from .runtime.state_file import identity
from .sampling import SamplingParams
from .tokenizer import load_tokenizer


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
    limits = Limits(args.max_context, max_queue, queue_timeout, max_batch)
    engine = Engine(model, tokenizer, limits,
                    decoder=decoder or Decoder(model, None, args.max_context, args.prefill_chunk_size),
                    prompt_cache=prompt_cache(args, model, drafter, log, cache_by_default, reserved),
                    vision=target_vision(args, sources.target_pack, model, log),
                    drafting=Drafting(draft_name, not_drafting, on_request_decoder, on_request_name))
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
