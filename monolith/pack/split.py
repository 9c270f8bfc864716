"""How a target's decoder layers split across the ranks of a pipeline (`--distributed`).

Each rank runs a contiguous run of layers; rank 0 also holds the embedding, the final
norm, the lm_head (and the draft), so its share of layers is smaller. The split
minimizes the largest stage's cost: with every stage equally loaded, a pipelined step
waits least for its slowest machine.

The cost of a layer is what it costs to run: at start every rank times its own layers'
forwards (`--distributed` measures, see runtime/pipeline.py) and the split is redone from
those times. Before anything is measured (and for `pack inspect --ranks N`) the cost is
modelled from the pack: the bytes a decode step reads, since decoding on a GPU is bound
by weight bandwidth. A MoE layer reads its router, its shared expert and top-k of its
experts per token, not all of them; its memory is all of them.

The vision tower is on no rank: a pipeline target serves text only (engine_setup gives
it no Vision), so the tower's bytes are not counted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..formats.stfile import ITEMSIZE
from .target_recipe import VISION_PREFIX

LAYER = re.compile(r"^model\.layers\.(\d+)\.")  # a decoder layer's tensor name


@dataclass(frozen=True)
class PackCosts:
    """Per decoder layer: the bytes it holds and the bytes a decode step reads; and the
    bytes rank 0 holds and reads besides (embedding, final norm, lm_head)."""

    layer_bytes: tuple[int, ...]
    layer_reads: tuple[float, ...]
    head_bytes: int
    head_reads: float


def pack_costs(manifest: dict, layers: int, experts_read: float = 1.0) -> PackCosts:
    """From a pack's manifest (its tensors' shapes and dtypes). `experts_read`: the share
    of an experts tensor a decode step reads (top_k / num_experts)."""
    held, reads = [0] * layers, [0.0] * layers
    head_held, head_reads = 0, 0.0
    for name, t in manifest["tensors"].items():
        if name.startswith(VISION_PREFIX):
            continue
        size = tensor_bytes(t)
        # a step reads one row of the embedding: nothing worth counting
        read = size * experts_read if ".experts." in name or name.endswith(".experts") else size
        if name.startswith("model.embed_tokens"):
            read = 0.0
        m = LAYER.match(name)
        if m is None:
            head_held += size
            head_reads += read
            continue
        i = int(m.group(1))
        if i >= layers:
            continue  # e.g. an mtp layer past the decoder: not run
        held[i] += size
        reads[i] += read
    return PackCosts(tuple(held), tuple(reads), head_held, head_reads)


def target_costs(pack_dir: Path, manifest: dict) -> PackCosts:
    """`pack_costs` of a target pack, its layer count and experts share from its config.json."""
    config = json.loads((Path(pack_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    experts = config["num_experts_per_tok"] / config["num_experts"] if config.get("num_experts") else 1.0
    return pack_costs(manifest, config["num_hidden_layers"], experts)


def tensor_bytes(tensor: dict) -> int:
    n = ITEMSIZE.get(tensor["dtype"], 1)
    for d in tensor["shape"]:
        n *= d
    return n


def split_layers(costs: list[float], ranks: int, first: float = 0.0, speeds: list[float] | None = None) -> list[range]:
    """Contiguous ranges of layer ids, one per rank, every rank at least one layer, that
    minimize the largest stage cost: a stage of rank r costs speeds[r] (default 1) times
    its layers' costs, and rank 0's `first` more. Ties keep the earlier split points
    (fewer layers on rank 0)."""
    n = len(costs)
    if ranks < 1:
        raise ValueError(f"a pipeline needs at least one rank, got {ranks}")
    if ranks > n:
        raise ValueError(f"{ranks} ranks need at least {ranks} decoder layers; the model has {n}")
    speeds = [1.0] * ranks if speeds is None else [float(v) for v in speeds]
    if len(speeds) != ranks:
        raise ValueError(f"{len(speeds)} speeds for {ranks} ranks")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def stage(r: int, lo: int, hi: int) -> float:
        return speeds[r] * (prefix[hi] - prefix[lo]) + (first if r == 0 else 0.0)

    # best[r][i]: the least largest stage over layers [0, i) on ranks [0, r]
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(ranks)]
    cut = [[0] * (n + 1) for _ in range(ranks)]
    for i in range(1, n + 1):
        best[0][i] = stage(0, 0, i)
    for r in range(1, ranks):
        for i in range(r + 1, n + 1):
            for j in range(r, i):
                value = max(best[r - 1][j], stage(r, j, i))
                if value < best[r][i] - 1e-12:
                    best[r][i], cut[r][i] = value, j
    ends, i = [n], n
    for r in range(ranks - 1, 0, -1):
        i = cut[r][i]
        ends.append(i)
    ends.reverse()
    starts = [0] + ends[:-1]
    return [range(a, b) for a, b in zip(starts, ends)]
