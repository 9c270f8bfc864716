"""--kv-bits: the target's attention KV cache stored group-wise quantized. References: the
bytes a row takes in the compute dtype; attention over the dequantized stored K/V (plain
matmuls); plain decoding under the same bits; the same sequences run alone; a state saved
under one setting, never resumed under another (in memory and on disk)."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from decoding import plain, speculate
from numeric import rel
from oracles import GREEDY, assert_same_greedy

from monolith.models import Segment
from monolith.models.cache import CacheError, KVCache
from monolith.models.kv_quant import QuantizedKVCache
from monolith.models.layers import Quantized, attention
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.events import GenerationRequest
from monolith.runtime.prefill import prefill
from monolith.runtime.prompt_cache import PromptCache
from monolith.runtime.prompt_store import PromptStore
from monolith.runtime.state_file import identity

PROMPT = [401, 316, 265, 198, 71, 72, 402, 198, 401, 77, 81, 90, 91, 300, 12, 13, 14]


@contextmanager
def kv_bits(model, bits):
    """The model's caches quantized to `bits` (None: as computed) inside the block."""
    saved, model.kv_bits = model.kv_bits, bits
    try:
        yield model
    finally:
        model.kv_bits = saved


def ids(model, n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, model.args.vocab_size, n).astype(np.int32))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("bits", [8, 4])
def test_row_bytes_are_the_bits_plus_scales(bits, dtype):
    """Qwen3.6-35B-A3B's attention rows (2 KV heads x 256): 8 bits about half the bytes of
    BF16 (a quarter of F32), 4 bits about a quarter, plus a scale and a bias per 64 values."""
    plain_cache, quantized = KVCache(2, 256, 1000, dtype), QuantizedKVCache(2, 256, 1000, dtype, bits)
    itemsize = mx.zeros((), dtype).itemsize
    assert quantized.row_nbytes == 2 * 2 * (256 * bits // 8 + 2 * (256 // 64) * itemsize)
    assert quantized.max_nbytes == 1000 * quantized.row_nbytes
    ratio = quantized.row_nbytes / plain_cache.row_nbytes
    assert ratio == bits / 8 / itemsize + 2 / 64  # the values, then a scale and a bias per 64 of them
    quantized.update(mx.ones((1, 2, 300, 256), dtype), mx.ones((1, 2, 300, 256), dtype), 0)
    assert sum(a.nbytes for a in quantized.arrays()) == quantized.allocated * quantized.row_nbytes


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("t", [1, 5])
def test_attention_matches_the_dequantized_rows(bits, t):
    """Quantized matmuls over the stored rows equal plain attention over their dequantized
    values (grouped queries, causal for a block), and stay near attention over the rows as
    computed."""
    rng = np.random.default_rng(bits + t)
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32))
               for shape in ((1, 8, t, 64), (1, 2, 40, 64), (1, 2, 40, 64)))
    cache = QuantizedKVCache(2, 64, 64, mx.float32, bits)
    cache.update(k[:, :, :40 - t], v[:, :, :40 - t], 0)
    keys, values = cache.update(k[:, :, 40 - t:], v[:, :, 40 - t:], 40 - t)
    assert isinstance(keys, Quantized) and keys.shape == (1, 2, 40)
    mask = "causal" if t > 1 else None
    got = np.array(attention(q, keys, values, 0.125, mask))
    reference = np.array(attention(q, *cache.dequantized(40), 0.125, mask))
    assert rel(got, reference) < 1e-5
    assert rel(got, np.array(attention(q, k, v, 0.125, mask))) < (0.01 if bits == 8 else 0.3)


def test_rows_copy_out_and_back_exactly():
    cache = QuantizedKVCache(2, 64, 64, mx.bfloat16, 8)
    k = mx.random.normal((1, 2, 20, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    cache.update(k, -k, 0)
    keys, values = cache.rows(3, 17)
    assert keys.dtype == mx.uint32 and keys.shape == (1, 2, 14, 16 + 2)
    other = QuantizedKVCache(2, 64, 64, mx.bfloat16, 8)
    other.write(3, keys, values)
    for mine, theirs in zip(cache.arrays(), other.arrays()):
        np.testing.assert_array_equal(np.array(mine[:, :, 3:17].astype(mx.float32)),
                                      np.array(theirs[:, :, 3:17].astype(mx.float32)))
    with pytest.raises(CacheError, match="8-bit quantized"):
        other.write(0, k, k)
    with pytest.raises(CacheError):
        KVCache(2, 18, 64, mx.bfloat16).write(0, keys, values)
    with pytest.raises(CacheError):
        QuantizedKVCache(2, 64, 64, mx.bfloat16, 4).write(0, keys, values)


def test_greedy_speculative_equals_plain_under_8_bits(synth_pair_f32):
    model, drafter, _ = synth_pair_f32
    with kv_bits(model, 8):
        assert type(model.make_cache(8).row_layers[0]) is QuantizedKVCache
        want = plain(model, PROMPT, 24, GREEDY, [], max_context=64).token_ids
        got = speculate(model, drafter, PROMPT, 24, GREEDY, [], max_context=64).token_ids
        assert_same_greedy(model, PROMPT, got, want)


def test_a_rejected_verify_block_leaves_the_cache_exact(model):
    """A verify block writes quantized rows past the offset; going back (restore: nothing
    kept, or commit: some kept) leaves the rows before untouched, and the next forward
    gives exactly what it gives on a cache that never ran the block."""
    with kv_bits(model, 8):
        tried, fresh = model.make_cache(64), model.make_cache(64)
        for cache in (tried, fresh):
            prefill(model, ids(model, 20, 1), cache, chunk_size=8)
        before = [np.array(a[:, :, :20]) for a in tried.arrays() if a.ndim == 4 and a.shape[2] >= 20]
        snap = tried.snapshot(record=True)
        model(ids(model, 6, 2), tried)
        tried.commit(snap, 0)
        after = [np.array(a[:, :, :20]) for a in tried.arrays() if a.ndim == 4 and a.shape[2] >= 20]
        assert len(before) == 6 and all(np.array_equal(a, b) for a, b in zip(before, after))
        nxt = ids(model, 3, 3)
        np.testing.assert_array_equal(np.array(model(nxt, tried)[0]), np.array(model(nxt, fresh)[0]))
        snap = tried.snapshot(record=True)
        model(ids(model, 6, 4), tried)
        tried.commit(snap, 2)
        assert tried.offset == 25


def test_a_batch_equals_each_sequence_alone(model):
    with kv_bits(model, 4):
        def segments(rows):
            out = []
            for i, (before, n) in enumerate(rows):
                cache = model.make_cache(64)
                prefill(model, ids(model, before, 10 + i), cache, chunk_size=8)
                out.append(Segment(ids(model, n, 20 + i), cache, (), "all"))
            return out

        plan = [(9, 1), (17, 4), (5, 1)]
        batched = model.forward_batch(segments(plan))
        for (logits, _), segment in zip(batched, segments(plan)):
            alone, _ = model.forward_batch([segment])[0]
            assert rel(np.array(logits), np.array(alone)) < 1e-5


def chat_ids(tok, question) -> list[int]:
    return tok.encode_chat([{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": question}])


def ask(engine, tok, question, max_tokens=6):
    """One request on `engine`, closed after it (which writes what is queued for the disk)."""
    prompt = chat_ids(tok, question)
    try:
        return engine.run_request(GenerationRequest(tuple(prompt), max_tokens,
                                                    boundaries=tuple(tok.message_ends(prompt))))[1]
    finally:
        engine.close()


def test_a_saved_state_resumes_only_under_its_own_bits(model, tok):
    """In memory: a prompt cache filled under 8 bits resumes under 8 bits, with the output
    of a cold run; live caches without quantization (or with 4 bits) never find its states
    and cannot add theirs."""
    cache = PromptCache(1 << 30, 32)
    prompt = chat_ids(tok, "List the files.")
    with kv_bits(model, 8):
        cold = ask(Engine(model, tok, Limits(max_context=512)), tok, "List the files.").token_ids
        first = ask(Engine(model, tok, Limits(max_context=512), prompt_cache=cache), tok, "List the files.")
        assert first.token_ids == cold and first.usage.cached_tokens == 0
        again = ask(Engine(model, tok, Limits(max_context=512), prompt_cache=cache), tok, "List the files.")
        assert again.token_ids == cold and again.usage.cached_tokens > 0
        assert cache.lookup(prompt, len(prompt) - 1, model.make_cache(512), None) is not None
    for bits in (None, 4):
        with kv_bits(model, bits):
            live = model.make_cache(512)
            assert cache.lookup(prompt, len(prompt) - 1, live, None) is None
            prefill(model, mx.array(prompt[:8], dtype=mx.int32), live, chunk_size=8)
            with pytest.raises(ValueError, match="layers differ"):
                cache.insert(prompt[:8], live, live.snapshot(), None)
    with kv_bits(model, None):  # and the other way round
        plain_cache = PromptCache(1 << 30, 32)
        ask(Engine(model, tok, Limits(max_context=512), prompt_cache=plain_cache), tok, "List the files.")
        assert plain_cache.saved_states
    with kv_bits(model, 8):
        assert plain_cache.lookup(prompt, len(prompt) - 1, model.make_cache(512), None) is None


def test_a_state_file_resumes_only_under_its_own_bits(model, tok, tmp_path):
    """On disk: a state saved under 8 bits is written as quantized rows with the bits in
    its identity, resumed after a restart under 8 bits, and never under another setting."""
    def server(bits):
        with kv_bits(model, bits):
            store = PromptStore(tmp_path, 1 << 30, identity(model))
            return Engine(model, tok, Limits(max_context=512), prompt_cache=PromptCache(1 << 30, 32, store))

    def run(bits, question):
        with kv_bits(model, bits):
            return ask(server(bits), tok, question)

    with kv_bits(model, 8):
        assert identity(model)["kv_bits"] == "8"
        cold = ask(Engine(model, tok, Limits(max_context=512)), tok, "Read it.").token_ids
    assert "kv_bits" not in identity(model)
    assert run(8, "List the files.").usage.cached_tokens == 0
    assert list(tmp_path.glob("*.safetensors"))
    for bits in (None, 4):
        assert run(bits, "Read it.").usage.cached_tokens == 0
    resumed = run(8, "Read it.")
    assert resumed.usage.cached_tokens > 0 and resumed.token_ids == cold


def test_serve_kv_bits_stores_a_served_sequence_in_the_counted_bytes(model, tok, pack):
    """serve's --kv-bits reaches the engine's caches: the same request served with and
    without it leaves the same rows, held in bits / 8 / itemsize + 2 / group of the bytes
    (measured from the arrays held; a group of 64 on the 35B, 32 on this tiny target
    whose head_dim is not a multiple of 64: on a Mac's BF16, 8 bits about half)."""
    from histories import serve_engine

    held = {}
    for bits in (None, "8", "4"):
        engine = serve_engine((model, None, tok), "--no-draft", *(("--kv-bits", bits) if bits else ()),
                              target_dir=pack)
        try:
            engine.run_request(GenerationRequest(tuple(PROMPT), 8))
            caches = [s.cache for s in engine._sessions if s.cache is not None and s.cache.offset]
            assert len(caches) == 1
            layers = caches[0].row_layers
            assert all(type(layer) is (KVCache if bits is None else QuantizedKVCache) for layer in layers)
            held[bits] = (layers[0].allocated, sum(a.nbytes for layer in layers for a in layer.arrays()),
                          getattr(layers[0], "group_size", None))
        finally:
            engine.close()
            model.kv_bits = None  # load_engine set it on the shared model
    itemsize = mx.zeros((), model.dtype).itemsize
    assert held["8"][0] == held["4"][0] == held[None][0]  # the same rows
    for bits in (8, 4):
        _, nbytes, group = held[str(bits)]
        assert nbytes / held[None][1] == bits / 8 / itemsize + 2 / group
