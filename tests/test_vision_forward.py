"""Images through the target's forward (docs/target.md, "Images in the forward"): a prompt
with one image, its patches from image_inputs and its features from the vision tower,
placed at the `<|image_pad|>` rows with the multimodal rotary positions, against
transformers' Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration fed
the same input_ids, pixel_values and image_grid_thw; then greedy decoding after it
(positions continuing with the delta) against transformers' generate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest
from numeric import rel
from vision_rig import NEW_TOKENS, image_prompt, reference_run

from monolith.models import load_model
from monolith.models.cache import CacheError
from monolith.models.mrope import rope_positions
from monolith.models.qwen3_5 import Segment
from monolith.models.vision import load_vision_tower
from monolith.pack import build_pack

TOL = 1e-4  # max |ours - reference| / max |reference|, float32
MEASURED: dict[str, str] = {}  # printed after the module (pytest -s)


class Vlm(NamedTuple):
    ckpt: Path
    model: object
    tokens: list[int]
    image: object
    features: mx.array  # the tower's merged features of the image
    positions: np.ndarray  # [3, T] of the prompt
    delta: int
    rows: np.ndarray  # the image-pad rows


@pytest.fixture(scope="module")
def vlms(synth_dir, tmp_path_factory):
    """vlms(dense) -> Vlm: the synthetic VLM, its pack loaded, and a prompt with one image."""
    made = {}

    def make(dense: bool) -> Vlm:
        if dense not in made:
            ckpt = synth_dir("target", "bf16", dense=dense)
            model = load_model(build_pack(ckpt, tmp_path_factory.mktemp("vlm") / "pack"), dtype="float32")
            config = json.loads((ckpt / "config.json").read_text())
            vision, pad = config["vision_config"], config["image_token_id"]
            tokens, image = image_prompt(config, vision["patch_size"])
            features = load_vision_tower(ckpt)(image.patches, [image.grid_thw])
            positions, delta = rope_positions(tokens, [image.grid_thw], pad, vision["spatial_merge_size"])
            rows = np.flatnonzero(np.asarray(tokens) == pad)
            made[dense] = Vlm(ckpt, model, tokens, image, features, positions, delta, rows)
        return made[dense]

    return make


def image_segment(vlm: Vlm, cache, start: int = 0, stop: int | None = None, **kw) -> Segment:
    """The prompt's rows [start, stop) with their image features and positions."""
    stop = len(vlm.tokens) if stop is None else stop
    inside = vlm.rows[(vlm.rows >= start) & (vlm.rows < stop)]
    features = (inside - start, vlm.features[mx.array(inside - vlm.rows[0])])
    return Segment(vlm.tokens[start:stop], cache, features=features, positions=vlm.positions[:, start:stop], **kw)


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "moe"])
def test_image_prompt_matches_transformers(vlms, dense):
    vlm = vlms(dense)
    model, tokens, delta, rows = vlm.model, vlm.tokens, vlm.delta, vlm.rows
    config = json.loads((vlm.ckpt / "config.json").read_text())
    ref_logits, ref_tokens, ref_steps = reference_run(vlm.ckpt, tokens, vlm.image, config["image_token_id"])
    assert delta < 0  # the image's rows take fewer positions than rows

    # the prompt in two chunks, the first ending inside the image
    cache = model.make_cache(64)
    empty = cache.snapshot()
    cut = int(rows[len(rows) // 2])
    chunks = [model.forward_batch([image_segment(vlm, cache, start, stop)])[0][0]
              for start, stop in [(0, cut), (cut, len(tokens))]]
    logits = np.array(mx.concatenate(chunks))
    assert cache.position_delta == delta
    err = rel(logits, ref_logits)
    MEASURED[f"{'dense' if dense else 'moe'} prompt logits"] = f"rel {err:.2e}"
    assert err < TOL, err

    # greedy decoding one token at a time: text rows at index + delta (the fused rotary)
    snap = cache.snapshot()
    ours, steps, last = [], [], logits[-1]
    for _ in range(NEW_TOKENS):
        ours.append(int(np.argmax(last)))
        last = np.array(model.forward([ours[-1]], cache, logits="last")[0])[0]
        steps.append(last)
    assert ours == ref_tokens
    err = rel(np.stack([logits[-1]] + steps[:-1]), ref_steps)
    MEASURED[f"{'dense' if dense else 'moe'} decode logits"] = f"rel {err:.2e}"
    assert err < TOL, err

    # a verify block of the same tokens after restoring the snapshot: the same logits
    cache.rewind(snap.offset)
    cache.restore(snap)
    block = np.array(model.forward(ours, cache)[0])
    assert rel(block[:-1], np.stack(steps[:-1])) < TOL
    # going back inside the image's rows is refused: its positions are not known there
    with pytest.raises(CacheError, match="multimodal positions"):
        cache.rewind(cut)
    # back to before the image: plain positions again, as on a fresh cache
    cache.rewind(0)
    cache.restore(empty)
    assert cache.position_delta == 0
    fresh = model.make_cache(64)
    assert mx.array_equal(model.forward(tokens[:5], cache)[0], model.forward(tokens[:5], fresh)[0])


def test_an_image_prompt_batched_with_text_is_as_alone(vlms):
    """One forward of the image prompt beside two text segments of its length (those two
    stack, the image one runs its rotary alone), then a decode step of all three."""
    vlm = vlms(False)
    model, n = vlm.model, len(vlm.tokens)
    texts = [[int(t) for t in np.random.default_rng(seed).integers(0, 500, n)] for seed in (5, 6)]

    def run(batched: bool):
        caches = [model.make_cache(64) for _ in range(3)]
        first = [image_segment(vlm, caches[0], taps=("embedding",))]
        first += [Segment(t, c) for t, c in zip(texts, caches[1:])]
        second = [Segment([7], c, logits="last") for c in caches]
        if batched:
            return model.forward_batch(first) + model.forward_batch(second)
        return [model.forward_batch([s])[0] for s in first + second]

    alone, together = run(False), run(True)
    for (a, a_taps), (b, b_taps) in zip(alone, together):
        assert rel(np.array(b), np.array(a)) < 1e-5
    # the embedding tap is the features at the image rows, as transformers' hidden_states[0]
    np.testing.assert_array_equal(np.array(together[0][1])[vlm.rows], np.array(vlm.features))


def test_image_segments_are_checked(vlms):
    model = vlms(True).model
    cache, h = model.make_cache(16), model.args.hidden_size
    with pytest.raises(ValueError, match=r"positions must be ints \[3, 3\]"):
        model.forward_batch([Segment([1, 2, 3], cache, positions=np.zeros((3, 2), np.int64))])
    with pytest.raises(ValueError, match="features must be"):
        model.forward_batch([Segment([1, 2, 3], cache, features=(np.array([0]), mx.zeros((1, h + 1))))])
    with pytest.raises(ValueError, match="distinct rows"):
        model.forward_batch([Segment([1, 2, 3], cache, features=(np.array([3]), mx.zeros((1, h))))])
    assert cache.offset == 0


def test_a_saved_state_after_an_image_decodes_as_the_live_cache(vlms, tmp_path):
    """The prompt cache's saved state after an image prompt, restored into a fresh cache
    (in memory, and through a state file), decodes at the image's position delta: the
    same logits as continuing the original cache."""
    from monolith.runtime.prompt_cache import PromptCache, layout_of, row_layers
    from monolith.runtime.state_file import device_rows, device_snapshot, host_arrays, read_state_file, write_state_file

    vlm = vlms(False)
    model, n = vlm.model, len(vlm.tokens)
    live = model.make_cache(64)
    model.forward_batch([image_segment(vlm, live)])
    assert live.position_delta == vlm.delta != 0
    node = PromptCache(1 << 30).insert(vlm.tokens, live, live.snapshot(), None)
    rows = [layer.rows(0, n) for layer in row_layers(live, None)]

    def decode(cache):
        steps = [model.forward_batch([Segment([t], cache, logits="last")])[0][0] for t in (7, 11)]
        return np.array(mx.concatenate(steps))

    memory = model.make_cache(64)
    PromptCache(1 << 30).load(node, memory, None)
    path = tmp_path / "image.safetensors"
    write_state_file(path, {}, vlm.tokens, 0, *host_arrays(rows, node.state.states), positions=node.state.positions)
    stored = read_state_file(path, {}, layout_of(model), vlm.tokens)
    assert json.loads(stored.metadata["positions"]) == list(live.positions)
    text = tmp_path / "text.safetensors"  # a text-only state keeps the metadata it always had
    write_state_file(text, {}, vlm.tokens, 0, *host_arrays(rows, node.state.states))
    assert "positions" not in read_state_file(text, {}, layout_of(model)).metadata
    disk = model.make_cache(64)
    for layer, (keys, values) in zip(row_layers(disk, None), device_rows(stored, layout_of(model))):
        layer.write(0, keys, values)
    disk.adopt(device_snapshot(stored))
    expected = decode(live)
    np.testing.assert_array_equal(decode(memory), expected)
    np.testing.assert_array_equal(decode(disk), expected)
