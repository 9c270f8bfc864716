"""Pieces of the demo pair's recipe (packs/demo/draft.py, train.py) that the bundle
depends on: quantization-aware training sees exactly what the NVFP4 export decodes to, a
larger --generations extends an earlier run exactly as one run would, and a training run
or the generations killed half way go on from their last save to what one run gives."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from demo_stages import DEMO, import_stage

from monolith.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from monolith.runtime import engine
from monolith.synth import write_target
from monolith.synth.values import as_bf16


@pytest.fixture(scope="module")
def recipe():
    return import_stage("draft")


def test_the_mtp_mirror_computes_what_load_mtp_serves(tmp_path):
    """The bundled head, read back into mtp.py's training mirror, gives the logits of the
    runtime head (models.load_mtp on a BF16 --with-mtp pack), both chained steps."""
    mtp = import_stage("mtp")
    seq = np.random.default_rng(0).integers(0, 2000, 42).astype(np.int32)
    assert mtp.check_runtime(DEMO / "target", tmp_path / "packs", mtp.read_head(DEMO / "target"), seq, n=40) < 1e-4


def test_the_stages_after_the_target_start_from_a_copy_of_its_checkpoint(tmp_path):
    """draft.py and mtp.py read only OUT/target: a copy of the bundled one (without its
    MTP head) does, and the frozen embedding and lm_head they train with are what the
    runtime binds (load_target on that checkpoint)."""
    from monolith.engine_setup import load_target

    files = import_stage("target_files")
    target = files.adopt_target(tmp_path / "out", DEMO / "target")
    assert sorted(f.name for f in target.iterdir()) == sorted(
        f.name for f in (DEMO / "target").iterdir() if f.name not in files.MTP_FILES)
    assert files.adopt_target(tmp_path / "out", None) == target  # an existing one is kept
    with pytest.raises(SystemExit, match="no target checkpoint"):
        files.adopt_target(tmp_path / "empty", None)
    frozen = files.frozen_target(target)
    model = load_target(target, dtype="float32", cache_dir=tmp_path / "packs")
    ids = mx.arange(frozen["embed_tokens"].shape[0])
    np.testing.assert_array_equal(np.array(model.embed_tokens(ids)), np.array(frozen["embed_tokens"]))
    hidden = mx.eye(frozen["lm_head"].shape[1])
    np.testing.assert_array_equal(np.array(model.lm_head(hidden)), np.array(frozen["lm_head"].T))


@pytest.mark.parametrize("magnitude", [0.02, 1.0, 30.0])
def test_fake_nvfp4_is_what_the_export_decodes(recipe, magnitude):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 64)).astype(np.float32) * magnitude
    w[3, :16] = 0.0  # an all-zero block
    w[7, 20:36] *= 1e-3  # blocks far below the tensor's amax (small E4M3 scales)
    w = as_bf16(w)
    q = quantize_nvfp4(w)
    reference = dequantize_nvfp4(q.packed, q.scales, q.tensor_scale)
    got = np.array(recipe.fake_nvfp4(mx.array(w)))
    np.testing.assert_allclose(got, reference, rtol=1e-6, atol=0)
    assert not np.array_equal(got, w)  # it did quantize


def test_fake_nvfp4_of_a_zero_matrix_is_zero_and_passes_gradients_straight_through(recipe):
    zeros = mx.zeros((4, 32))
    assert not mx.any(recipe.fake_nvfp4(zeros)).item()
    w = mx.array(np.random.default_rng(2).standard_normal((8, 32)).astype(np.float32))
    upstream = mx.array(np.random.default_rng(3).standard_normal((8, 32)).astype(np.float32))
    grad = mx.grad(lambda x: (recipe.fake_nvfp4(x) * upstream).sum())(w)
    np.testing.assert_array_equal(np.array(grad), np.array(upstream))


def test_quantized_names_are_the_nvfp4_export_matrices(recipe):
    assert recipe.quantized("layers.0.self_attn.q_proj.weight")
    assert recipe.quantized("layers.1.mlp.down_proj.weight")
    assert recipe.quantized("fc.weight") and recipe.quantized("markov_head.markov_w2.weight")
    for kept in ("markov_head.markov_w1.weight", "confidence_head.proj.weight", "hidden_norm.weight",
                 "layers.0.self_attn.q_norm.weight", "layers.0.input_layernorm.weight"):
        assert not recipe.quantized(kept)


def recipe_outputs(tmp_path, target, *names):
    """Recipe output directories under tmp_path, each with the target as its target."""
    outs = []
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "target").symlink_to(target, target_is_directory=True)
        outs.append(tmp_path / name)
    return outs


def test_more_generations_extend_an_earlier_run_exactly(recipe, tmp_path, monkeypatch):
    target = write_target(tmp_path / "target", preset="tiny", format="bf16", seed=0)
    real = recipe.generate_batch
    stopped = []

    def generate_batch(decoder, prompts, params):  # every third prompt stops early (EOS): skipped, not kept
        outputs = real(decoder, prompts, params)
        stopped.extend(p for p in prompts if sum(p) % 3 == 0)
        return [out[:5] if sum(p) % 3 == 0 else out for p, out in zip(prompts, outputs)]

    monkeypatch.setattr(recipe, "generate_batch", generate_batch)
    monkeypatch.setattr(recipe, "GEN_BATCH", 3)
    stream = np.random.default_rng(4).integers(0, 200, 4096).astype(np.int32)
    one_run, extended = recipe_outputs(tmp_path, target, "one", "extended")
    first = recipe.stage_generate(extended, stream, 2, seed=0, force=False)
    direct = recipe.stage_generate(one_run, stream, 5, seed=0, force=False)
    grown = recipe.stage_generate(extended, stream, 5, seed=0, force=False)
    assert first.shape == (2, recipe.PROMPT_LEN + recipe.GEN_LEN)
    np.testing.assert_array_equal(grown, direct)
    np.testing.assert_array_equal(grown[:2], first)
    np.testing.assert_array_equal(recipe.stage_generate(one_run, stream, 3, seed=0, force=False), direct[:3])
    assert stopped and all(sum(row[:recipe.PROMPT_LEN]) % 3 for row in grown)  # the skips were replayed


def test_a_batch_of_generations_is_each_generation_alone(recipe, tmp_path):
    """generate_batch steps the sequences together; each gives what run_decoder gives it
    alone (greedy and sampled with its seed)."""
    from monolith.engine_setup import load_target
    from monolith.runtime.decoder import Decoder
    from monolith.sampling import SamplingParams

    target = write_target(tmp_path / "target", preset="tiny", format="bf16", seed=0)
    decoder = Decoder(load_target(target, dtype="float32", cache_dir=tmp_path / "packs"), None,
                      recipe.PROMPT_LEN + recipe.GEN_LEN + 16)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 200, recipe.PROMPT_LEN).tolist() for _ in range(3)]
    params = [SamplingParams(temperature=0.0), SamplingParams(1.0, 0.95, 20, 0.0, seed=11),
              SamplingParams(0.7, 1.0, 0, 0.0, seed=12)]
    alone = [list(engine.run_decoder(decoder, p, recipe.GEN_LEN, sp).token_ids) for p, sp in zip(prompts, params)]
    assert recipe.generate_batch(decoder, prompts, params) == alone


def test_a_target_run_killed_half_way_resumes_to_what_one_run_gives(tmp_path, monkeypatch):
    train = import_stage("train")
    tiny = dataclasses.replace(train.PRESET, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2,
                               linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32, vocab_size=64)
    for name, value in (("PRESET", tiny), ("SEQ_LEN", 16), ("CHAT_LEN", 64), ("SAVE_EVERY", 2)):
        monkeypatch.setattr(train, name, value)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, 3000).astype(np.int32)
    z = {"train": tokens, "weights": rng.choice([train.PROMPT_WEIGHT, 1.0], tokens.size).astype(np.float32),
         "chat_starts": np.arange(2000, 2900, 90), "held": tokens[:500], "held_chat": tokens[2000:],
         "held_chat_starts": np.arange(0, 900, 90)}
    one_run, killed = tmp_path / "one", tmp_path / "killed"
    one_run.mkdir(), killed.mkdir()
    whole = train.stage_target(one_run, z, 0, 6, force=False)
    save = train.Progress.save

    def save_then_die(self, P, opt, rng, step, *rest):
        save(self, P, opt, rng, step, *rest)
        if step == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(train.Progress, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train.stage_target(killed, z, 0, 6, force=False)
    monkeypatch.setattr(train.Progress, "save", save)
    resumed = train.stage_target(killed, z, 0, 6, force=False)
    for name, value in whole.items():
        np.testing.assert_array_equal(np.array(resumed[name]), np.array(value), err_msg=name)
    assert not list(killed.glob("*progress*"))  # a finished run leaves no save behind
    log = (killed / "target_log.json").read_text()
    assert '"step": 1,' in log and '"steps": 6' in log  # the curve from before the kill is kept


def test_generations_killed_half_way_go_on_to_what_one_run_gives(recipe, tmp_path, monkeypatch):
    target = write_target(tmp_path / "target", preset="tiny", format="bf16", seed=0)
    stream = np.random.default_rng(5).integers(0, 200, 4096).astype(np.int32)
    monkeypatch.setattr(recipe, "GEN_BATCH", 2)
    one_run, killed = recipe_outputs(tmp_path, target, "one", "killed")
    direct = recipe.stage_generate(one_run, stream, 5, seed=0, force=False)
    real, runs = recipe.generate_batch, []

    def generate_batch(*args):
        if len(runs) == 2:  # killed while generating the third batch
            raise KeyboardInterrupt
        runs.append(1)
        return real(*args)

    monkeypatch.setattr(recipe, "generate_batch", generate_batch)
    with pytest.raises(KeyboardInterrupt):
        recipe.stage_generate(killed, stream, 5, seed=0, force=False)
    monkeypatch.setattr(recipe, "generate_batch", real)
    assert len(np.load(killed / "generations.npz")["seqs"]) == 4  # the save before the kill
    np.testing.assert_array_equal(recipe.stage_generate(killed, stream, 5, seed=0, force=False), direct)
