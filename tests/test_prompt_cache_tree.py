"""The prompt cache's radix tree without a model: tiny hybrid caches (one attention
layer, one gated DeltaNet layer) filled with known values stand for a model's cache
after `tokens`, and the tree is checked against what they held: lookup, branch points,
splits, the byte count, LRU eviction and where prefill saves states."""

from __future__ import annotations

import tracemalloc

import mlx.core as mx
import numpy as np
import pytest
from cache_rig import held_bytes, nodes

from monolith.models.cache import GDNState, HybridCache, KVCache
from monolith.runtime.prompt_cache import HANDLE_BYTES, NODE_BYTES, PromptCache

MAX_CONTEXT = 64
HEADS, DIM = 1, 4  # KV rows: 2 x 16 bytes a token
BIG = 2**30


def fake_cache(tokens, seed=0):
    """A HybridCache at len(tokens) rows whose KV row i and GDN states are a function of
    the tokens (row i of tokens[:i + 1]), as a model's would be."""
    kv = KVCache(HEADS, DIM, MAX_CONTEXT + 8, mx.float32)
    gdn = GDNState(conv_dim=4, kernel=2, value_heads=1, value_dim=2, key_dim=2)
    cache = HybridCache([gdn, kv], MAX_CONTEXT)
    n = len(tokens)
    if n:
        rows = np.stack([row_value(tokens[:i + 1]) for i in range(n)])[None, None]  # [1, 1, n, DIM]
        kv.update(mx.array(rows), mx.array(-rows), 0)
        cache.advance(n)
    rng = np.random.default_rng([seed, *tokens])
    gdn.conv = mx.array(rng.standard_normal(gdn.conv.shape).astype(np.float32))
    gdn.recurrent = mx.array(rng.standard_normal(gdn.recurrent.shape).astype(np.float32))
    mx.eval(cache.arrays())
    return cache


def row_value(prefix) -> np.ndarray:
    return np.random.default_rng(list(prefix)).standard_normal(DIM).astype(np.float32)


def insert(pc: PromptCache, tokens):
    cache = fake_cache(tokens)
    return pc.insert(list(tokens), cache, cache.snapshot(), None)


def assert_exact(pc: PromptCache, node, tokens):
    """Loaded into a fresh cache, `node` gives the KV rows and states of fake_cache(tokens)."""
    assert node.prefix() == list(tokens) and node.state is not None
    want, got = fake_cache(tokens), fake_cache([])
    pc.load(node, got, None)
    n = len(tokens)
    assert got.offset == n
    for g, w in zip(got.row_layers, want.row_layers):
        assert np.array_equal(np.array(g.keys[:, :, :n]), np.array(w.keys[:, :, :n]))
        assert np.array_equal(np.array(g.values[:, :, :n]), np.array(w.values[:, :, :n]))
    for g, w in zip(got.snapshot().states, want.snapshot().states):
        assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(g, w))


def lookup(pc: PromptCache, tokens, limit=None):
    node = pc.lookup(list(tokens), len(tokens) if limit is None else limit, fake_cache([]), None)
    return None if node is None else node.end


A = list(range(100, 120))  # 20 tokens


def test_lookup_returns_the_deepest_saved_state_at_or_before_the_limit():
    pc = PromptCache(BIG)
    for n in (4, 8, 16):
        insert(pc, A[:n])
    assert lookup(pc, A) == 16
    assert lookup(pc, A, limit=16) == 16
    assert lookup(pc, A, limit=15) == 8
    assert lookup(pc, A, limit=7) == 4
    assert lookup(pc, A, limit=3) is None
    assert lookup(pc, A[:10] + [1, 2, 3, 4, 5, 6]) == 8  # diverges inside (8, 16)
    assert lookup(pc, [1] + A) is None
    for n in (4, 8, 16):
        assert_exact(pc, pc.lookup(A, n, fake_cache([]), None), A[:n])


def test_a_branch_point_holds_no_state_and_is_never_returned():
    pc = PromptCache(BIG)
    b = A[:10] + [7, 7, 7, 7]
    insert(pc, A[:16])
    insert(pc, b)  # splits A's edge after 10 tokens
    (top,) = pc.root.children.values()
    assert top.end == 10 and top.state is None and sorted(c.end for c in top.children.values()) == [14, 16]
    assert pc.saved_states == 2
    for prompt in (A[:10] + [9] * 6, A[:12], b[:13], A[:10]):
        assert lookup(pc, prompt) is None
    assert lookup(pc, b) == 14 and lookup(pc, A) == 16
    assert_exact(pc, pc.lookup(b, 14, fake_cache([]), None), b)
    assert_exact(pc, pc.lookup(A, 16, fake_cache([]), None), A[:16])
    insert(pc, A[:10])  # the branch point becomes a saved state
    assert lookup(pc, A[:10] + [9] * 6) == 10 and pc.saved_states == 3
    assert_exact(pc, top, A[:10])


def test_a_prefix_of_an_edge_splits_it_and_both_parts_keep_their_rows():
    pc = PromptCache(BIG)
    whole = insert(pc, A[:16])
    keys = np.array(whole.rows[0][0])
    head = insert(pc, A[:6])
    assert head is not whole and head.end == 6 and whole.start == 6 and whole.parent is head
    assert np.array_equal(np.array(head.rows[0][0]), keys[:, :, :6])
    assert np.array_equal(np.array(whole.rows[0][0]), keys[:, :, 6:])
    assert np.array_equal(np.array(head.rows[0][1]), -keys[:, :, :6])
    assert_exact(pc, head, A[:6])
    assert_exact(pc, whole, A[:16])
    assert pc.nbytes == held_bytes(pc)


def test_nbytes_is_the_sum_of_the_arrays_and_the_host_memory_held():
    pc = PromptCache(BIG)
    assert pc.nbytes == 0
    for tokens in (A[:16], A[:6], A[:10] + [1, 2], [5, 6, 7], A[:10]):
        insert(pc, tokens)
        assert pc.nbytes == held_bytes(pc)
    row = 2 * HEADS * DIM * 4  # keys and values, float32
    state = sum(a.nbytes for pair in fake_cache([]).snapshot().states for a in pair)
    tokens_held = 16 + 2 + 3  # every token's row once, however many saved states lie past it
    assert len(nodes(pc)) == pc.saved_states == 5
    handles = 2 + 2  # a saved state's arrays: keys and values of one row layer, conv and recurrent
    assert pc.nbytes == tokens_held * (row + 4) + pc.saved_states * (state + NODE_BYTES + handles * HANDLE_BYTES)


def test_the_host_memory_of_a_node_is_within_what_the_budget_counts():
    """The RSS growth bench/fuzz.py saw beside the prompt cache's arrays (a tuple of
    Python ints per edge, about 36 bytes a token, not counted): what the tree allocates
    on the host, traced by Python's allocator, stays within what nbytes counts beyond
    the arrays' data. Each prompt is built while traced and dropped after its insert,
    as a request's is."""
    pc = PromptCache(BIG)
    starts = [1000 + 100 * i for i in range(40)]
    caches = [fake_cache(range(s, s + MAX_CONTEXT)) for s in starts]
    snapshots = [c.snapshot() for c in caches]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for s, cache, snapshot in zip(starts, caches, snapshots):
            pc.insert(list(range(s, s + MAX_CONTEXT)), cache, snapshot, None)
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    data = sum(a.nbytes for n in nodes(pc) for pair in n.rows + list(n.state.states) for a in pair)
    host = pc.nbytes - data
    assert host == len(starts) * (4 * MAX_CONTEXT + NODE_BYTES + 4 * HANDLE_BYTES)
    assert 0 < traced <= host, (traced, host)


def sizes(length: int) -> int:
    pc = PromptCache(BIG)
    insert(pc, list(range(1, length + 1)))
    return pc.nbytes


def test_lru_evicts_the_least_recently_used_leaf_first():
    one = sizes(4)
    pc = PromptCache(3 * one)
    x, y, z, w = ([t] * 4 for t in (1, 2, 3, 4))
    for tokens in (x, y, z):
        insert(pc, tokens)
    assert lookup(pc, x + [0]) == 4  # x is used again: y is now the least recently used
    insert(pc, w)
    assert pc.stats.evictions == 1 and pc.nbytes <= pc.budget
    assert lookup(pc, y + [0]) is None
    assert [lookup(pc, t + [0]) for t in (x, z, w)] == [4, 4, 4]
    assert pc.nbytes == held_bytes(pc) == 3 * one


def test_evicting_the_last_child_of_a_branch_point_removes_it():
    x, y = [1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]
    z, w = [9] * 4, [8] * 4
    probe = PromptCache(BIG)
    for tokens in (x, y, z):
        insert(probe, tokens)
    pc = PromptCache(probe.nbytes)  # x, y (under their branch point) and z fit; one more does not
    for tokens in (x, y, z):
        insert(pc, tokens)
    assert pc.stats.evictions == 0 and [n.state is None for n in pc.root.children.values()].count(True) == 1
    lookup(pc, z + [0])
    insert(pc, w)  # x goes first, then y, and with it the branch point [1, 2, 3]
    assert pc.stats.evictions == 2 and pc.saved_states == 2
    assert sorted(pc.root.children) == [8, 9] and all(n.state is not None for n in nodes(pc))
    assert pc.nbytes == held_bytes(pc) == 2 * sizes(4)


def test_an_evicting_insert_that_cannot_fit_returns_none():
    pc = PromptCache(sizes(4))
    assert insert(pc, [1] * 4) is not None
    assert insert(pc, [2] * 8) is None  # larger than the whole budget
    assert pc.nbytes <= pc.budget and pc.nbytes == held_bytes(pc)
    assert PromptCache(0).insert([1], fake_cache([1]), fake_cache([1]).snapshot(), None) is None


@pytest.mark.parametrize("every, start, end, boundaries", [
    (16, 0, 70, [3, 20, 32, 70, 90]),
    (16, 5, 70, [3, 20, 32]),
    (16, 16, 17, []),
    (16, 16, 16, [16]),
    (16, 20, 40, [20, 30, 40]),  # a boundary at the start is already held
    (0, 0, 40, [10, 25, 40]),
    (0, 12, 40, [10, 25]),
    (1, 3, 7, []),
])
def test_stops_are_the_multiples_the_boundaries_and_the_end(every, start, end, boundaries):
    want = [p for p in range(start + 1, end + 1)
            if (every and p % every == 0) or p in boundaries or p in (end - 1, end)]
    assert PromptCache(BIG, save_every=every).stops(start, end, boundaries) == want


def test_bad_settings_and_mismatched_states_are_errors():
    with pytest.raises(ValueError, match="budget and save_every must be >= 0"):
        PromptCache(-1)
    with pytest.raises(ValueError, match="saved state of 3 tokens with states after 4 rows"):
        PromptCache(BIG).insert([1, 2, 3], fake_cache([1, 2, 3, 4]), fake_cache([1, 2, 3, 4]).snapshot(), None)
