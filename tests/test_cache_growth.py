"""KV caches take the memory of the rows they hold, not of the context they may reach: a
sequence at the model's whole context (262,144 for Qwen3.6) that has seen a few tokens
holds a few hundred rows (MLX's allocator says so), and a cache that grows as a prompt is
prefilled in chunks computes what one forward over the whole prompt computes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from monolith.models.cache import CacheError, KVCache

WHOLE = 262_144


@pytest.fixture(scope="module")
def demo(demo_f32):
    return demo_f32


def kv_bytes_per_row(layers) -> int:
    return sum(2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.itemsize for layer in layers)


def test_a_short_sequence_at_the_whole_context_allocates_its_rows_only(demo):
    model, _, _ = demo
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    cache = model.make_cache(WHOLE)
    logits, _ = model(mx.array([1, 2, 3, 4]), cache)
    mx.eval(logits, cache.arrays())
    grown = mx.get_active_memory() - before
    whole = kv_bytes_per_row(cache.row_layers) * WHOLE
    assert grown < whole / 64, (grown, whole)
    assert all(layer.keys.shape[2] < 1024 for layer in cache.row_layers)


def test_the_draft_context_grows_with_its_rows(demo):
    model, drafter, _ = demo
    draft = drafter.draft
    context = draft.make_context(WHOLE)
    draft.append_context(context, mx.zeros((3, draft.fc.shape[1]), model.dtype))
    mx.eval(context.arrays())
    assert context.offset == 3
    assert all(0 < layer.keys.shape[2] < 1024 for layer in context.row_layers)


def test_a_prompt_prefilled_in_chunks_through_growing_caches_computes_one_forwards_logits(demo):
    """Chunks of 300 rows cross the growth steps (256, 512, ...); one forward of the same
    600 tokens into a cache of exactly their size grows once."""
    model, _, _ = demo
    tokens = mx.array(np.random.default_rng(0).integers(0, 2000, size=600), mx.int32)
    whole = model.make_cache(600)
    reference, _ = model(tokens, whole)
    chunked = model.make_cache(WHOLE)
    first, _ = model(tokens[:300], chunked)
    second, _ = model(tokens[300:], chunked)
    np.testing.assert_allclose(np.array(mx.concatenate([first, second])), np.array(reference), atol=2e-4)


def test_rows_written_back_past_the_grown_rows_fit_and_past_the_capacity_fail():
    cache = KVCache(2, 4, 1000, mx.float32)
    keys = mx.arange(2 * 10 * 4, dtype=mx.float32).reshape(1, 2, 10, 4)
    cache.write(700, keys, keys + 1)
    got_keys, got_values = cache.rows(700, 710)
    np.testing.assert_array_equal(np.array(got_keys), np.array(keys))
    np.testing.assert_array_equal(np.array(got_values), np.array(keys + 1))
    assert 710 <= cache.keys.shape[2] <= 1000
    with pytest.raises(CacheError, match="1000"):
        cache.write(995, keys, keys)
