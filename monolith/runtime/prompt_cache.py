"""The prompt cache: saved states of earlier sequences in a radix tree keyed by tokens, so a
request resumes from the deepest saved state its prompt shares, from any conversation.

A saved state at position p is exact: the attention KV rows [0, p), the gated DeltaNet
states after p rows (conv and recurrent; they cannot be rebuilt from the KV) and the
draft context's rows [0, p) when the engine drafts. Each tree node owns the KV rows of
its edge only ([parent's end, end), one copy per token however many saved states lie
past it) and, when it is a saved state, the GDN states at its end (small fixed-size
copies: a conv state is a view of its forward's whole pre-conv window, which a
reference would keep alive). A node without states is a branch point: a resume point needs
states, so `lookup` returns the deepest node with states whose tokens the prompt starts
with, at or before `limit`.

Loading a saved state writes its rows into the session's live cache, skipping the rows
the live cache already holds for the same tokens. Rows are copied out of the live
cache when a state is saved (`KVCache.rows`), never referenced: a view would pin
the live buffer and make every later update copy all of it.

Memory: `budget` bytes (every row and state array counted, and the host memory of each
node: its edge's tokens, 4 bytes each, and the objects that hold it and its arrays; 0
disables the cache), LRU
by leaf: using a node touches its ancestors, so the least recently used leaf goes
first, and a branch point left without children goes with it. An optional `store`
(prompt_store.PromptStore) persists saved states and answers lookups the tree misses.
One engine thread uses a PromptCache; the counters may be read from any thread.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..kernels import gpu_backend
from ..models.cache import DraftContext, GDNState, HybridCache, KVCache, Snapshot

DEFAULT_MEMORY_SHARE = 0.25  # default budget: this share of the memory free after loading
NODE_BYTES = 512  # host bytes of a node's own objects (the node, its lists and tuples), and
HANDLE_BYTES = 256  # of each array's handles (Python's and MLX's), counted besides the arrays'
# data and the edge's tokens (test_prompt_cache_tree measures the Python part of both)


@dataclass(eq=False)
class Node:
    start: int  # the parent's end
    tokens: array  # the edge: tokens [start, end), int32 (a tuple of ints takes 9 times the bytes)
    parent: Node | None
    rows: list[tuple[mx.array, mx.array]]  # per row layer (target's, then the draft's): rows [start, end)
    state: Snapshot | None  # GDN states after `end` rows; None: a branch point
    children: dict[int, Node] = field(default_factory=dict)
    used: int = 0
    nbytes: int = 0
    evicted: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def path(self) -> list[Node]:
        """The nodes from the root's first child down to this one."""
        chain, node = [], self
        while node.parent is not None:
            chain.append(node)
            node = node.parent
        return chain[::-1]

    def prefix(self) -> list[int]:
        return [t for node in self.path() for t in node.tokens]

    def measure(self) -> int:
        arrays = [a for pair in self.rows for a in pair]
        if self.state is not None:
            arrays += [a for pair in self.state.states for a in pair]
        self.nbytes = (sum(a.nbytes for a in arrays) + len(self.tokens) * self.tokens.itemsize
                       + NODE_BYTES + HANDLE_BYTES * len(arrays))
        return self.nbytes


@dataclass
class CacheStats:
    hits: int = 0  # requests that resumed from a cached prefix (the tree, the store or the live session)
    misses: int = 0  # requests that prefilled from the first token
    evictions: int = 0  # saved states dropped for the budget
    disk_hits: int = 0  # saved states loaded from the store


class PromptCache:
    def __init__(self, budget: int, save_every: int = 0, store=None):
        if budget < 0 or save_every < 0:
            raise ValueError(f"budget and save_every must be >= 0, got {budget} and {save_every}")
        self.budget = budget
        self.save_every = save_every
        self.store = store
        self.root = Node(0, array("i"), None, [], None)
        self.nbytes = 0
        self.stats = CacheStats()
        self._ticks = itertools.count(1)
        self._leaves: set[Node] = set()
        self._layout: Layout | None = None  # what the first saved state held
        self._saved_states = 0

    def __repr__(self) -> str:
        return (f"PromptCache({self.saved_states} saved states, {self.nbytes} of {self.budget} bytes, "
                f"every {self.save_every} tokens)")

    @property
    def saved_states(self) -> int:
        return self._saved_states

    # ---------------------------------------------------------------- where to save

    def stops(self, start: int, end: int, boundaries: Sequence[int] = ()) -> list[int]:
        """Positions in (start, end] to save the state at while prefilling rows [start, end): the
        multiples of save_every, the given message boundaries, one token before the
        end (the same prompt again resumes there: a resume leaves a token to prefill, whose
        logits start the reply) and end."""
        every = self.save_every
        wanted = {b for b in boundaries if start < b < end}
        if start < end - 1:
            wanted.add(end - 1)
        if every:
            wanted.update(range((start // every + 1) * every, end, every))
        return sorted(wanted) + [end] if end > start else []

    # ---------------------------------------------------------------- lookup and load

    def lookup(self, tokens: Sequence[int], limit: int, cache: HybridCache, draft: DraftContext | None) -> Node | None:
        """The deepest saved state (a node with states, end <= limit) whose tokens `tokens`
        starts with, from the tree or, when it has one deeper, the store; touched. `cache`
        and `draft` are the live caches it will load into (a saved state must fit them: one
        saved for other caches, another --kv-bits say, is never resumed)."""
        layout = self.layout(cache, draft)
        if self._layout is not None and layout != self._layout:
            return None
        node, pos, best = self.root, 0, None
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or child.end > limit or array("i", tokens[pos:child.end]) != child.tokens:
                break
            node, pos = child, child.end
            if node.state is not None:
                best = node
        if self.store is not None and self.budget:
            found = self.store.find(tokens, limit, 0 if best is None else best.end, layout)
            loaded = None if found is None else self._add(found.tokens, found.state, found.rows)
            if loaded is not None:
                best = loaded
                self.stats.disk_hits += 1
        if best is not None:
            self._touch(best)
        return best

    def load(self, node: Node, cache: HybridCache, draft: DraftContext | None, held: int = 0,
             draft_held: int = 0) -> None:
        """Put saved state `node` into the live caches: write its rows past the first `held`
        (the target's; `draft_held` the draft's), which the live caches already hold for the
        same tokens, then take its states there."""
        put_rows(cache, draft, [(item.start, item.rows) for item in node.path()], held, draft_held)
        cache.adopt(node.state)
        if draft is not None:
            draft.adopt(node.end)

    # ---------------------------------------------------------------- insert

    def insert(self, tokens: Sequence[int], cache: HybridCache, state: Snapshot,
               draft: DraftContext | None) -> Node | None:
        """Save the state after `tokens`: the live caches hold their rows and `state` is the GDN
        states after them. Returns the node, or None when the budget cannot hold it."""
        if not self.budget or not tokens:
            return None
        if state.offset != len(tokens):
            raise ValueError(f"a saved state of {len(tokens)} tokens with states after {state.offset} rows")
        layers = row_layers(cache, draft)
        layout = self.layout(cache, draft)
        if self._layout is None:
            self._layout = layout
        elif layout != self._layout:
            raise ValueError("a saved state's layers differ from the earlier saved states' (one prompt cache serves "
                             "one target and draft)")
        # copies: a conv state is a view of its forward's whole pre-conv window (K-1+T rows)
        state = Snapshot(state.offset, tuple((mx.array(conv), mx.array(recurrent)) for conv, recurrent in state.states),
                         state.positions)
        mx.eval([a for pair in state.states for a in pair])
        node = self._add(tokens, state, lambda start, end: [layer.rows(start, end) for layer in layers])
        if node is not None and self.store is not None:
            self.store.save(node)
        return node

    def _add(self, tokens: Sequence[int], state: Snapshot, rows) -> Node:
        """The node of `tokens` with `state`, made from `rows(start, end)` (rows per layer
        for [start, end), lazy) where the tree holds none; then the budget is enforced."""
        node, pos = self._descend(tokens)
        end = len(tokens)
        if pos == end:
            if node.state is None:  # a branch point becomes a saved state
                node.state = state
                before = node.nbytes
                self.nbytes += node.measure() - before
                self._saved_states += 1
        else:
            copies = rows(pos, end)
            mx.eval([a for pair in copies for a in pair])
            node = Node(pos, array("i", tokens[pos:end]), node, copies, state)
            node.parent.children[node.tokens[0]] = node
            self._leaves.discard(node.parent)
            self._leaves.add(node)
            self.nbytes += node.measure()
            self._saved_states += 1
        self._touch(node)
        self._evict()
        return None if node.evicted else node

    def _descend(self, tokens: Sequence[int]) -> tuple[Node, int]:
        """The node where `tokens` leaves the tree (splitting an edge it leaves in the
        middle of) and its end."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = common_prefix(child.tokens, tokens[pos:child.end])
            if common < len(child.tokens):
                return self._split(child, common), pos + common
            node, pos = child, child.end
        return node, pos

    def _split(self, child: Node, k: int) -> Node:
        """Cut child's edge after k tokens: a branch point owning the first k rows."""
        parent = child.parent
        head = Node(child.start, child.tokens[:k], parent,
                    [(mx.array(keys[:, :, :k]), mx.array(values[:, :, :k])) for keys, values in child.rows], None,
                    used=child.used)
        child.rows = [(mx.array(keys[:, :, k:]), mx.array(values[:, :, k:])) for keys, values in child.rows]
        mx.eval([a for node in (head, child) for pair in node.rows for a in pair])
        child.start, child.tokens, child.parent = child.start + k, child.tokens[k:], head
        head.children[child.tokens[0]] = child
        parent.children[head.tokens[0]] = head
        before = child.nbytes
        self.nbytes += head.measure() + child.measure() - before
        return head

    # ---------------------------------------------------------------- memory

    def _touch(self, node: Node) -> None:
        tick = next(self._ticks)
        while node is not None:
            node.used = tick
            node = node.parent

    def _evict(self) -> None:
        while self.nbytes > self.budget and self._leaves:
            self._remove(min(self._leaves, key=lambda n: n.used))
            self.stats.evictions += 1

    def _remove(self, leaf: Node) -> None:
        while True:
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            self._leaves.discard(leaf)
            self.nbytes -= leaf.nbytes
            self._saved_states -= leaf.state is not None
            leaf.evicted = True
            if parent.parent is None:
                return
            if parent.children:
                return
            if parent.state is not None:
                self._leaves.add(parent)
                return
            leaf = parent  # a branch point with nothing past it

    # ---------------------------------------------------------------- layout

    @staticmethod
    def layout(cache: HybridCache, draft: DraftContext | None) -> Layout:
        """What a saved state for these caches holds: per row layer (kv heads, width,
        dtype) of its rows (KVCache.layout); per GDN layer the (conv, recurrent) shapes;
        the bits of the target's quantized KV rows (--kv-bits; 0: as computed)."""
        rows = tuple(layer.layout for layer in row_layers(cache, draft))
        states = tuple((tuple(layer.conv.shape), tuple(layer.recurrent.shape)) for layer in cache.layers
                       if isinstance(layer, GDNState))
        return Layout(rows, states, max((layer.bits or 0 for layer in cache.row_layers), default=0))


@dataclass(frozen=True)
class Layout:
    rows: tuple  # per row layer (target's, then the draft's): (kv heads, width, dtype), KVCache.layout
    states: tuple  # per GDN layer: (conv shape, recurrent shape)
    kv_bits: int = 0  # the target's KV rows quantized to these bits (--kv-bits); 0: as computed


def save_interval(model, drafter=None, chunk_size: int = 512) -> int:
    """The default interval between saved states while prefilling: the fewest tokens, a
    multiple of the prefill chunk, whose KV rows take at least the bytes of one saved
    state's GDN states, so interval saves at most double the memory of the rows they
    cover (on a multiple of the chunk a save adds no chunk boundary, so prefill time
    does not change: bench/prompt_cache.py). Qwen3.6-35B-A3B in BF16: 62.8 MiB of states, 20 KiB
    of KV per token -> 3584; the demo pair (F32) -> 512."""
    layout = layout_of(model, drafter)
    per_token = sum(2 * heads * dim * mx.zeros((), dtype).itemsize for heads, dim, dtype in layout.rows)
    states = sum(4 * (math.prod(conv) + math.prod(recurrent)) for conv, recurrent in layout.states)
    return max(1, math.ceil(states / max(per_token, 1) / chunk_size)) * chunk_size


def layout_of(model, drafter=None) -> Layout:
    """The Layout of a saved state for `model` (and the drafter's context)."""
    draft = None
    if drafter is not None:
        drafter.start(1)
        draft = drafter.snapshot()
    return PromptCache.layout(model.make_cache(1), draft)


def row_layers(cache: HybridCache, draft: DraftContext | None) -> list[KVCache]:
    """The KV caches a saved state copies rows of: the target's attention layers, then the draft's."""
    return cache.row_layers + ([] if draft is None else draft.row_layers)


def put_rows(cache: HybridCache, draft: DraftContext | None, pieces, held: int = 0, draft_held: int = 0) -> None:
    """Write `pieces` = [(start, rows per row layer: the target's, then the draft's)] into
    the caches' rows, skipping the first `held` rows of the target's (`draft_held` of the
    draft's), which they hold already."""
    layers = row_layers(cache, draft)
    targets = len(cache.row_layers)
    for start, rows in pieces:
        if len(rows) != len(layers):
            raise ValueError(f"a saved state holds rows of {len(rows)} layers, the caches have {len(layers)}")
        for i, (layer, (keys, values)) in enumerate(zip(layers, rows)):
            skip = max(0, (held if i < targets else draft_held) - start)
            if skip < keys.shape[2]:
                layer.write(start + skip, keys[:, :, skip:], values[:, :, skip:])


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """Length of the common prefix of a and b (at most `limit`)."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def default_budget(reserved: int = 0) -> int:
    """DEFAULT_MEMORY_SHARE of the memory free now (after the model loaded), less
    `reserved` bytes (the running sequences' caches, not allocated yet)."""
    return int(DEFAULT_MEMORY_SHARE * max(available_memory() - reserved, 0))


def available_memory() -> int:
    """Bytes free for states and caches: the host's (host_memory); on a GPU with memory of
    its own (MLX's CUDA backend), no more than MLX's limit there less what MLX holds now.
    Metal shares the host's memory."""
    host = host_memory()
    if gpu_backend() != "cuda":
        return host
    return min(host, max(mx.get_memory_limit() - mx.get_active_memory(), 0))


def host_memory() -> int:
    """Bytes the system can give without swapping: Linux's MemAvailable; on macOS the
    free, inactive, speculative and purgeable pages (vm_stat); else half the physical
    memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5, check=True).stdout
        page = int(out.split("page size of")[1].split()[0])
        counts = {line.split(":")[0].strip(): int(line.split(":")[1].strip().rstrip("."))
                  for line in out.splitlines()[1:] if ":" in line and line.split(":")[1].strip().rstrip(".").isdigit()}
        pages = sum(counts.get(f"Pages {kind}", 0) for kind in ("free", "inactive", "speculative", "purgeable"))
        if pages:
            return pages * page
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
