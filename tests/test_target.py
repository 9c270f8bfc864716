"""The target model on MLX: logits and taps against transformers on the same
(dequantized) weights in every checkpoint format and several shapes, chunked prefill,
verify blocks against decodes, cache rewind/snapshot, BF16 compute and errors (its
primitives: tests/test_target_primitives.py)."""

from __future__ import annotations

import gc
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from numeric import rel

from monolith import formats
from monolith.engine_setup import load_target
from monolith.models import load_model
from monolith.models.cache import CacheError, Snapshot
from monolith.pack import PackError, build_pack
from monolith.runtime.prefill import prefill
from monolith.synth import Preset, write_target

TOL = 1e-4  # max |ours - reference| / max |reference|, F32 compute
PROMPT_LEN = 20

# name -> (preset, dense); head ratios q/kv and linear k/v heads vary, Dk != Dv in some
CONFIGS = {
    # q/kv 4/2, linear k/v 2/4, one full layer (the last) in 4
    "moe-q4kv2-lin2x4-int4": (Preset(), False),
    # q/kv 4/1, linear k/v 2/2, Dk 32 != Dv 16, head_dim 64; the last layer is linear;
    # top-4 routing, so a 20-row forward takes the expert-sorted path
    "moe-q4kv1-lin2x2-int2": (Preset(num_hidden_layers=3, full_attention_interval=2, num_key_value_heads=1,
                                     head_dim=64, linear_num_value_heads=2, linear_key_head_dim=32,
                                     linear_value_head_dim=16, num_experts_per_tok=4), False),
    # dense; q/kv 2/2, linear k/v 1/4, Dv 32 != Dk 16
    "dense-q2kv2-lin1x4-int2": (Preset(num_hidden_layers=4, full_attention_interval=2, num_attention_heads=2,
                                       num_key_value_heads=2, linear_num_key_heads=1, linear_value_head_dim=32),
                                True),
    # attention only (no GDN layer)
    "dense-all-attention": (Preset(num_hidden_layers=2, full_attention_interval=1), True),
}
MEASURED: dict[str, object] = {}  # printed after the module's tests with pytest -s


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """packs(config, format="bf16", layout=None) -> (checkpoint dir, pack dir), built once."""
    root = tmp_path_factory.mktemp("target")
    made = {}

    def make(config="moe-q4kv2-lin2x4-int4", format="bf16", layout=None):
        key = (config, format, layout)
        if key not in made:
            preset, dense = CONFIGS[config]
            name = f"{config}-{format}-{layout}"
            ckpt = write_target(root / name, preset=preset, format=format, dense=dense, expert_layout=layout)
            made[key] = (ckpt, build_pack(ckpt, root / (name + ".pack")))
        return made[key]

    return make


@pytest.fixture(scope="module")
def reference():
    """reference(checkpoint dir, ids) -> (logits [T, V], hidden_states), cached."""
    from hf_reference import build_reference, reference_outputs

    cache = {}

    def run(ckpt, ids):
        key = (str(ckpt), tuple(ids))
        if key not in cache:
            cache[key] = reference_outputs(build_reference(ckpt), ids)
        return cache[key]

    return run


def prompt(vocab: int, n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def run_all_taps(model, ids):
    cache = model.make_cache(64)
    logits, hidden = model(mx.array(ids, dtype=mx.int32), cache, taps=list(range(model.args.num_hidden_layers)))
    return np.array(logits), np.array(hidden.astype(mx.float32))


def check_against_reference(pack, ckpt, reference, label):
    model = load_model(pack, dtype="float32")
    ids = prompt(model.args.vocab_size)
    ref_logits, ref_hidden = reference(ckpt, ids)
    logits, hidden = run_all_taps(model, ids)
    assert logits.shape == ref_logits.shape and logits.dtype == np.float32
    err = MEASURED[label] = rel(logits, ref_logits)
    assert err < TOL, f"{label}: logits differ by {err:.2e} (relative)"
    h = model.args.hidden_size
    tap_errs = [rel(hidden[:, i * h:(i + 1) * h], ref_hidden[i + 1]) for i in range(model.args.num_hidden_layers)]
    MEASURED[label + " (max tap)"] = max(tap_errs)
    assert max(tap_errs) < TOL, f"{label}: taps differ from hidden_states[i + 1] by {tap_errs}"


# ------------------------------------------------------------------ vs transformers


@pytest.mark.parametrize("config, layout", [
    ("moe-q4kv2-lin2x4-int4", "fused"),
    ("moe-q4kv2-lin2x4-int4", "per-expert"),
    ("moe-q4kv1-lin2x2-int2", "fused"),
    ("dense-q2kv2-lin1x4-int2", None),
    ("dense-all-attention", None),
])
def test_bf16_pack_matches_transformers(packs, reference, config, layout):
    ckpt, pack = packs(config, "bf16", layout)
    check_against_reference(pack, ckpt, reference, f"bf16 {config} {layout or 'dense'}")


QUANTIZED_FORMATS = ["modelopt-nvfp4", "modelopt-mixed", "compressed-tensors", "compressed-tensors-mixed"]


@pytest.mark.parametrize("config, format", [("moe-q4kv2-lin2x4-int4", f) for f in QUANTIZED_FORMATS] + [
    ("dense-q2kv2-lin1x4-int2", "compressed-tensors-mixed"),  # the 27B "Dynamic NVFP4" shape
    ("dense-q2kv2-lin1x4-int2", "modelopt-nvfp4"),
])
def test_quantized_pack_matches_transformers_on_dequantized_weights(packs, reference, config, format):
    ckpt, pack = packs(config, format)
    manifest = json.loads((pack / "manifest.json").read_text())
    if format == "modelopt-mixed":  # the split group (FP8 qkv|z, BF16 b|a) is what this covers
        split = {f"model.layers.0.linear_attn.in_proj.{i}" for i in (0, 1)}
        assert split <= set(manifest["entries"])
    check_against_reference(pack, ckpt, reference, f"{format} {config}")


def test_load_model_packs_a_checkpoint_directory(packs, tmp_path):
    ckpt, pack = packs("dense-q2kv2-lin1x4-int2", "compressed-tensors-mixed")
    ids = mx.array(prompt(512, 6), dtype=mx.int32)
    from_ckpt = load_target(ckpt, dtype="float32", cache_dir=tmp_path)
    from_pack = load_model(pack, dtype="float32")
    eos = json.loads((pack / "generation_config.json").read_text())["eos_token_id"]
    assert from_ckpt.args == from_pack.args and list(from_pack.args.eos_token_ids) == eos
    np.testing.assert_array_equal(np.array(from_ckpt(ids, from_ckpt.make_cache(8))[0]),
                                  np.array(from_pack(ids, from_pack.make_cache(8))[0]))


def test_tied_embeddings_without_lm_head(packs, reference, tmp_path):
    src, _ = packs("dense-q2kv2-lin1x4-int2", "bf16")
    ckpt = tmp_path / "tied"
    shutil.copytree(src, ckpt)
    for shard in ckpt.glob("*.safetensors"):
        st = formats.SafetensorsFile(shard)
        if "lm_head.weight" in st:
            kept = {n: (st.dtype(n), st.read(n, copy=True)) for n in st.names() if n != "lm_head.weight"}
            st.close()
            formats.write_safetensors(shard, kept)
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].pop("lm_head.weight", None)
        index.write_text(json.dumps(data))
    config = json.loads((ckpt / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
    (ckpt / "config.json").write_text(json.dumps(config))
    pack = build_pack(ckpt, tmp_path / "tied.pack")
    assert "lm_head" not in json.loads((pack / "manifest.json").read_text())["entries"]
    check_against_reference(pack, ckpt, reference, "tied embeddings")


# ------------------------------------------------------------------ cache behaviour


@pytest.fixture(scope="module")
def moe_f32(packs):
    return load_model(packs("moe-q4kv1-lin2x2-int2", "bf16", "fused")[1], dtype="float32")


def test_prefill_chunking_is_invisible(moe_f32):
    model = moe_f32
    ids = prompt(model.args.vocab_size, 21, seed=4)
    follow = mx.array(prompt(model.args.vocab_size, 5, seed=5), dtype=mx.int32)
    results = []
    for chunk in (512, 6, 1):
        cache = model.make_cache(64)
        last = prefill(model, mx.array(ids, dtype=mx.int32), cache, chunk_size=chunk)
        assert cache.offset == len(ids) and last.shape == (model.args.vocab_size,)
        rows, _ = model(follow, cache)
        results.append((np.array(last), np.array(rows)))
    (last0, rows0), *others = results
    for last, rows in others:
        assert rel(last, last0) < 2e-5 and rel(rows, rows0) < 2e-5
    # taps of a chunked forward are those of one forward over all rows
    taps = [0, 2]
    whole = model(mx.array(ids, dtype=mx.int32), model.make_cache(64), taps=taps)[1]
    cache = model.make_cache(64)
    parts = [model(mx.array(ids[i:i + 8], dtype=mx.int32), cache, taps=taps)[1] for i in range(0, len(ids), 8)]
    assert whole.shape == (len(ids), 2 * model.args.hidden_size)
    assert rel(np.array(mx.concatenate(parts)), np.array(whole)) < 2e-5


@pytest.mark.parametrize("config", ["moe-q4kv2-lin2x4-int4", "moe-q4kv1-lin2x2-int2"])  # last layer: attention, GDN
def test_a_chunk_whose_output_nobody_reads_leaves_the_cache_a_read_chunk_leaves(packs, config):
    """A prefill chunk without logits leaves its last layer's output unevaluated (only the
    cache writes run); the caches and what follows are those of a chunk whose logits
    were read, bit for bit."""
    model = load_model(packs(config, "bf16")[1], dtype="float32")
    ids = mx.array(prompt(model.args.vocab_size, 21, seed=8), dtype=mx.int32)
    follow = mx.array(prompt(model.args.vocab_size, 3, seed=9), dtype=mx.int32)
    caches, after = [], []
    for logits in ("none", "all"):
        cache = model.make_cache(64)
        model.forward(ids, cache, logits=logits)
        mx.eval(cache.arrays())
        caches.append([np.array(a) for a in cache.arrays()])
        after.append(np.array(model(follow, cache)[0]))
    assert all(np.array_equal(a, b) for a, b in zip(*caches)) and np.array_equal(*after)


def test_a_snapshot_after_a_prefill_chunk_holds_only_the_states(moe_f32):
    """A restore point or saved state keeps the GDN states after a prefill chunk; a conv
    state that were a view of the chunk's pre-conv window would keep all of it alive
    (for Qwen3.6-35B-A3B: 30 x 515 x 8192 x 4 bytes = 506 MB per 512-row chunk)."""
    model = moe_f32
    ids = mx.array(prompt(model.args.vocab_size, 300, seed=6), dtype=mx.int32)
    gc.collect()
    base = mx.get_active_memory()
    cache = model.make_cache(512)
    prefill(model, ids, cache, chunk_size=300)
    snap = cache.snapshot()
    mx.eval([a for pair in snap.states for a in pair])
    del cache
    gc.collect()
    states = sum(a.nbytes for pair in snap.states for a in pair)
    window = sum(300 * conv.shape[2] * 4 for conv, _ in snap.states)
    assert mx.get_active_memory() - base < states + window // 2


def test_verify_block_equals_one_row_decodes_and_snapshot_restore(moe_f32):
    model = moe_f32
    ids = mx.array(prompt(model.args.vocab_size, 12, seed=6), dtype=mx.int32)
    block = mx.array(prompt(model.args.vocab_size, 8, seed=7), dtype=mx.int32)
    cache = model.make_cache(32)
    prefill(model, ids, cache)
    snap = cache.snapshot()
    assert snap.offset == 12
    verify, _ = model(block, cache)
    assert cache.offset == 20
    verify = np.array(verify)

    cache.restore(snap)
    assert cache.offset == 12
    decodes = np.concatenate([np.array(model(block[i:i + 1], cache)[0]) for i in range(8)])
    assert rel(decodes, verify) < 1e-5

    # rewind moves only the KV: the GDN states must come back through restore
    cache.rewind(12)
    with pytest.raises(CacheError, match="restore"):
        model(block, cache)
    cache.restore(snap)
    again, _ = model(block, cache)
    np.testing.assert_array_equal(np.array(again), verify)

    # keep 3 of the 8 rows: restore a snapshot taken after exactly those rows ...
    cache.restore(snap)
    model(block[:3], cache)
    kept = cache.snapshot()
    model(block[3:], cache)
    cache.rewind(15)
    cache.restore(Snapshot(kept.offset, kept.states))
    tail, _ = model(block[3:], cache)
    assert rel(np.array(tail), verify[3:]) < 1e-5  # the chunked GDN rounds by its chunking

    # ... or replay the recorded tape of the 8-row forward over the first 3 rows
    cache.restore(snap)
    cache.snapshot(record=True)
    model(block, cache)
    with pytest.raises(CacheError, match="recorded"):
        cache.commit(kept, 2)
    cache.commit(snap, 3)
    assert cache.offset == 15
    for (conv, rec), (want_conv, want_rec) in zip(cache.snapshot().states, kept.states):
        np.testing.assert_array_equal(np.array(conv), np.array(want_conv))
        assert rel(np.array(rec), np.array(want_rec)) < 1e-6
    tail, _ = model(block[3:], cache)
    assert rel(np.array(tail), verify[3:]) < 1e-5


def test_rewind_alone_suffices_without_gdn_layers(packs):
    model = load_model(packs("dense-all-attention", "bf16")[1], dtype="float32")
    ids = mx.array(prompt(model.args.vocab_size, 10, seed=8), dtype=mx.int32)
    cache = model.make_cache(32)
    first, _ = model(ids, cache)
    cache.rewind(4)
    second, _ = model(ids[4:], cache)
    np.testing.assert_array_equal(np.array(second), np.array(first)[4:])
    # the speculative commit works the same without GDN layers
    snap = cache.snapshot(record=True)
    model(ids[:5], cache)
    cache.commit(snap, 2)
    assert cache.offset == 12


def bf16_vs_f32_cosines(pack, ids, monkeypatch=None) -> np.ndarray:
    """Per-row cosine of BF16-compute against F32-compute logits. With monkeypatch, the
    BF16 run replays the F32 run's expert choices (its router weights are its own)."""
    from monolith.models.mlp import SparseMoeBlock

    route, chosen, out = SparseMoeBlock.route, [], {}

    def record(self, x):
        indices, weights = route(self, x)
        chosen.append(indices)
        return indices, weights

    def replay(self, x):
        indices = chosen.pop(0)
        logits = self.router(x.astype(mx.float32))
        return indices, mx.softmax(mx.take_along_axis(logits, indices, axis=-1), axis=-1, precise=True)

    for dtype, hook in (("float32", record), ("bfloat16", replay)):
        if monkeypatch:
            monkeypatch.setattr(SparseMoeBlock, "route", hook)
        model = load_model(pack, dtype=dtype)
        logits, hidden = model(mx.array(ids, dtype=mx.int32), model.make_cache(64), taps=[1])
        assert logits.dtype == mx.float32
        assert hidden.dtype == (mx.bfloat16 if dtype == "bfloat16" else mx.float32)
        out[dtype] = np.array(logits, np.float64)
    a, b = out["float32"], out["bfloat16"]
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("format", ["bf16", "compressed-tensors-mixed"])
def test_bfloat16_compute_tracks_float32_dense(packs, format):
    """Every row within cosine 0.999 (compressed-tensors-mixed: NVFP4 + FP8 + BF16)."""
    pack = packs("dense-q2kv2-lin1x4-int2", format)[1]
    cosine = bf16_vs_f32_cosines(pack, prompt(512, PROMPT_LEN, seed=9))
    MEASURED[f"bf16-vs-f32 min cosine, dense {format}"] = float(cosine.min())
    assert cosine.min() > 0.999, cosine


@pytest.mark.parametrize("format", ["bf16", "modelopt-mixed"])
def test_bfloat16_compute_tracks_float32_moe(packs, monkeypatch, format):
    """The synthetic routers (8 random experts) have near-ties that BF16 rounding of the
    residual stream flips (transformers' own BF16 run flips the same rows of the bf16
    pack, down to cosine 0.94), so the BF16 run replays the F32 expert choices. A row
    or two of the quantized pack stay just under 0.999: their GDN outputs are ~1e-4
    (cancellation) and the gated RMSNorm scales that rounding noise up."""
    pack = packs("moe-q4kv2-lin2x4-int4", format)[1]
    ids = prompt(512, PROMPT_LEN, seed=9)
    MEASURED[f"bf16-vs-f32 min cosine, moe {format}, own routing"] = float(bf16_vs_f32_cosines(pack, ids).min())
    cosine = bf16_vs_f32_cosines(pack, ids, monkeypatch)
    MEASURED[f"bf16-vs-f32 min cosine, moe {format}, F32 routing"] = float(cosine.min())
    assert cosine.min() > 0.998 and (cosine > 0.999).mean() >= 0.9, cosine


# ------------------------------------------------------------------ errors


def test_too_long_raises_before_any_work(moe_f32):
    model = moe_f32
    cache = model.make_cache(16)
    before = [id(a) for a in cache.arrays()]
    with pytest.raises(CacheError, match=r"17 rows.*max_context=16"):
        prefill(model, mx.array(prompt(512, 17), dtype=mx.int32), cache)
    # a forward may use the spare verify rows, not more
    with pytest.raises(CacheError, match=r"25 rows.*max_context=16 \(\+8 spare rows\)"):
        model(mx.array(prompt(512, 25), dtype=mx.int32), cache)
    assert cache.offset == 0 and [id(a) for a in cache.arrays()] == before
    prefill(model, mx.array(prompt(512, 16), dtype=mx.int32), cache)
    model(mx.array(prompt(512, 8), dtype=mx.int32), cache)
    assert cache.offset == 24
    with pytest.raises(CacheError, match="1 rows at offset 24"):
        model(mx.array([1], dtype=mx.int32), cache)


def test_bad_arguments(moe_f32):
    cache = moe_f32.make_cache(16)
    with pytest.raises(ValueError, match="taps"):
        moe_f32(mx.array([1, 2], dtype=mx.int32), cache, taps=[3])
    with pytest.raises(ValueError, match="1-D"):
        moe_f32(mx.array([[1, 2]], dtype=mx.int32), cache)
    with pytest.raises(ValueError, match="token ids"):
        moe_f32([1, 512], cache)
    with pytest.raises(CacheError, match="rewind"):
        cache.rewind(1)
    with pytest.raises(ValueError, match="dtype"):
        load_model("/nonexistent", dtype="int8")


def test_unsupported_architecture_is_named(synth_dir, tmp_path):
    draft_pack = build_pack(synth_dir("draft", "deepspec"), tmp_path / "draft.pack")
    with pytest.raises(PackError, match=r"not a supported target \(supported: qwen3_5, qwen3_5_moe\)"):
        load_model(draft_pack)


def test_pack_that_does_not_fit_the_config_is_refused(packs, tmp_path):
    pack = tmp_path / "bad.pack"
    shutil.copytree(packs()[1], pack)
    config = json.loads((pack / "config.json").read_text())
    config["text_config"]["linear_num_value_heads"] = 2
    (pack / "config.json").write_text(json.dumps(config))
    with pytest.raises(PackError, match="config.json: SHA-256 mismatch"):  # verified first
        load_model(pack)
    with pytest.raises(PackError, match=r"linear_attn\.in_proj.* shape \[200, 64\], the config implies \[132, 64\]"):
        load_model(pack, verify="never")  # and the shapes are still checked against the config
