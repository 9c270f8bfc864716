"""`--distributed`: serve, chat and generate with the target's layers split across the
ranks that `mlx.launch` started (pipeline parallel over mx.distributed; the transport
is MLX's: the ring backend over TCP or Thunderbolt).

    mlx.launch --hosts A,B --backend ring -- python -m monolith.serve --distributed --model M ...

Every rank runs the same command. At start the ranks:

1. resolve their target pack (each machine its own copy) and compare the packs'
   pack_sha256; a rank with another pack is refused by name on every rank;
2. split the layers by modelled cost (pack/split.py: the bytes a decode step reads;
   rank 0 also carries the head and the draft), load their own layers' tensors only,
   time their stage on an 8-row forward, and split again by those times (reloading
   only where the split moved);
3. rank 0 goes on as the command would without --distributed, with the pipeline as its
   target (runtime/pipeline.py); the others serve their stage until rank 0 stops.

Only rank 0 writes to stdout (one JSON object with generate --json); the other ranks
log one line each to stderr. The prompt cache (which copies KV rows out of the caches)
is off: the rows live on several machines.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .engine_setup import Sources, resolve_sources
from .model_flags import MTP_DRAFT, SetupError
from .models import load_model
from .pack import read_manifest, resolve_pack
from .pack.split import split_layers, target_costs
from .runtime.pipeline import Link, Pipeline, serve_stage

MEASURE_ROWS = 8  # a verify round's rows: what the split is balanced for
MEASURE_REPEATS = 5


def add_distributed_arguments(ap: argparse.ArgumentParser) -> None:
    options = ap.add_argument_group("pipeline parallel (start every rank with mlx.launch)")
    options.add_argument("--distributed", action="store_true",
                       help="split the target's layers across the ranks mlx.launch started; rank 0 holds the "
                            "embedding, the lm_head and the draft, and serves")
    options.add_argument("--distributed-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="how long rank 0 waits for a forward's answer before it calls the pipeline down "
                            "(default 600)")


@dataclass
class Rank:
    """This process's place in the pipeline."""

    link: Link
    split: list[range]
    model: object  # this rank's stage (rank 0: with the head)
    sources: Sources
    timeout: float

    pipeline: Pipeline | None = None

    @property
    def leader(self) -> bool:
        return self.link.rank == 0

    def target(self, *_, **__) -> Pipeline:
        """Rank 0's target for engine_setup.load_engine(load=...)."""
        self.pipeline = Pipeline(self.model, self.link, self.split, self.timeout)
        return self.pipeline

    def close(self) -> None:
        """Rank 0, on its way out (whatever happened): stop the other ranks."""
        if self.pipeline is None:
            self.pipeline = Pipeline(self.model, self.link, self.split, self.timeout)
        self.pipeline.close()

    def serve(self) -> int:
        """A rank > 0: serve the stage until rank 0 stops; the exit status."""
        try:
            serve_stage(self.model, self.link)
        except Exception as e:  # noqa: BLE001 - rank 0 is gone or the ring broke: say so and exit
            to_stderr(f"rank {self.link.rank}: the pipeline stopped: {type(e).__name__}: {e}")
            return 1
        return 0


def rank_of(args: argparse.Namespace) -> int:
    """This process's rank (0 without --distributed): the others serve a stage only."""
    if not args.distributed:
        return 0
    try:
        return group().rank()
    except Exception:  # noqa: BLE001 - join() says why
        return 0


_GROUP = []


def group():
    """The mx.distributed group (made once). The ring backend's socket threads spin while
    a receive is pending (an idle rank waits in one): on Linux they run at the lowest
    priority, so they take only a core nothing else wants (where two ranks share a
    machine's cores, as on loopback, the computing rank keeps its cores)."""
    if not _GROUP:
        mx.eval(mx.zeros((1,)) + 1)  # MLX's own threads exist before the ring's start
        before = _threads()
        _GROUP.append(mx.distributed.init(strict=True))
        for tid in _threads() - before:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, 19)
            except OSError:
                pass  # not allowed here: they spin at the usual priority
    return _GROUP[0]


def _threads() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux
        return set()


def join(args: argparse.Namespace, plan, log) -> Rank:
    """Join the ranks (every rank calls this with the same flags): check the packs, split
    the layers, load this rank's. SetupError, on every rank, when that fails."""
    if args.prompt_cache_size or args.prompt_cache_dir is not None:
        raise SetupError("--distributed keeps no prompt cache (the KV rows live on several ranks): "
                         "drop --prompt-cache-size / --prompt-cache-dir")
    args.prompt_cache_size = 0
    if args.kv_bits:
        raise SetupError("--kv-bits is not available with --distributed (the other ranks' caches are made "
                         "as computed): drop --kv-bits")
    if args.distributed_timeout <= 0:
        raise SetupError(f"--distributed-timeout must be positive, got {args.distributed_timeout}")
    try:
        ring = group()
    except Exception as e:  # noqa: BLE001 - no backend: not started by mlx.launch
        raise SetupError(f"--distributed: no mx.distributed group ({e}); start every rank with mlx.launch, "
                         "e.g. mlx.launch --hosts A,B --backend ring -- python -m monolith.serve --distributed") \
            from None
    link = Link(ring)
    if link.size < 2:
        raise SetupError("--distributed needs at least two ranks (mlx.launch -n 2 or --hosts A,B)")
    leader = link.rank == 0
    sources = resolve_sources(args, plan, log if leader else lambda message: None)
    manifest = read_manifest(Path(sources.target_pack))
    check_packs(ring, manifest.get("pack_sha256") or "", sources.target_pack)
    costs = target_costs(sources.target_pack, manifest)
    layers = len(costs.layer_reads)
    if layers < link.size:
        raise SetupError(f"--distributed: {link.size} ranks need at least {link.size} decoder layers; "
                         f"the model has {layers}")
    first = costs.head_reads + (draft_reads(args, sources) if leader else 0.0)
    split = broadcast_split(ring, split_layers(list(costs.layer_reads), link.size, first) if leader else None,
                            link.size)
    model = load_model(sources.target_pack, args.dtype, layers=split[link.rank], head=leader,
                       verify=args.verify_pack)
    took, head = measure_stage(model, leader)
    times = mx.distributed.all_gather(mx.array([took], dtype=mx.float32), group=ring).tolist()
    reads = [sum(costs.layer_reads[i] for i in part) for part in split]
    speeds = [t / max(r, 1.0) for t, r in zip(times, reads)]  # seconds per modelled byte, per rank
    balanced = split_layers(list(costs.layer_reads), link.size, head + speeds[0] * (first - costs.head_reads),
                            speeds) if leader else None
    balanced = broadcast_split(ring, balanced if leader else None, link.size)
    if balanced[link.rank] != split[link.rank]:
        del model
        gc.collect()
        mx.clear_cache()
        model = load_model(sources.target_pack, args.dtype, layers=balanced[link.rank], head=leader,
                           verify=args.verify_pack)
    log(f"rank {link.rank} of {link.size} (pid {os.getpid()}): layers {_layers(balanced[link.rank])}"
        + (" with the head" if leader else "") + f" (split by measured cost: {describe(balanced)})")
    return Rank(link, balanced, model, sources, args.distributed_timeout)


def check_packs(group, sha: str, where) -> None:
    """Every rank's target pack_sha256 must be rank 0's: SetupError naming the others."""
    mine = np.frombuffer(sha.encode().ljust(64, b"\0")[:64], dtype=np.uint8)
    every = np.array(mx.distributed.all_gather(mx.array(mine), group=group)).reshape(group.size(), 64)
    hashes = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every]
    wrong = [r for r, h in enumerate(hashes) if h != hashes[0] or not h]
    if wrong:
        names = ", ".join(f"rank {r} has {hashes[r][:12] or 'none'}" for r in wrong)
        raise SetupError(f"--distributed: the ranks' target packs differ (rank 0 has pack_sha256 "
                         f"{hashes[0][:12] or 'none'}; {names}); every rank needs the same pack "
                         f"(this rank's: {where})")


def broadcast_split(group, split: list[range] | None, ranks: int) -> list[range]:
    """Rank 0's split, on every rank."""
    stops = np.zeros(ranks, dtype=np.int32) if split is None else np.array([r.stop for r in split], dtype=np.int32)
    stops = [int(v) for v in mx.distributed.all_sum(mx.array(stops), group=group).tolist()]
    return [range(a, b) for a, b in zip([0] + stops[:-1], stops)]


def measure_stage(model, head: bool) -> tuple[float, float]:
    """Seconds (medians) of this stage's layers on an 8-row forward, and on rank 0 of the
    head's share (the embedding and the lm_head over those rows; else 0)."""
    h = model.args.hidden_size
    x = mx.ones((1, MEASURE_ROWS, h), model.dtype) * 0.01
    ids = mx.arange(MEASURE_ROWS, dtype=mx.int32)

    def layers():
        cache = model.make_cache(MEASURE_ROWS + 1)
        mx.eval(cache.arrays())
        return lambda: mx.eval(model.forward_stage(x, [cache], [MEASURE_ROWS])[0])

    def outside():
        return lambda: mx.eval(model.lm_head(model.embed_tokens(ids)))

    return _median(layers), (_median(outside) if head else 0.0)


def _median(setup) -> float:
    samples = []
    for i in range(MEASURE_REPEATS + 1):
        run = setup()
        start = time.perf_counter()
        run()
        if i:  # the first warms up
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def draft_reads(args, sources: Sources) -> float:
    """The bytes of rank 0's drafts (they run there; a start loads every candidate): their
    packs' tensors (an MTP head's are the target pack's `mtp.*`, which target_costs counts
    with rank 0's head already)."""
    total = 0.0
    for draft in sources.drafts:
        if draft == MTP_DRAFT:
            continue
        pack = resolve_pack(draft, role="draft", quantization=args.draft_quantization or "auto",
                            revision=args.draft_revision, local_files_only=args.local_files_only,
                            verify=args.verify_pack)
        total += sum(s["bytes"] for s in read_manifest(Path(pack))["shards"].values())
    return float(total)


def describe(split: list[range]) -> str:
    return ", ".join(f"rank {r}: {_layers(part)}" for r, part in enumerate(split))


def _layers(part: range) -> str:
    return f"{part.start}" if len(part) == 1 else f"{part.start}-{part.stop - 1}"


def to_stderr(message: str) -> None:
    """The log of commands run under --distributed: stderr (stdout is rank 0's answer)."""
    print(message, file=sys.stderr, flush=True)
