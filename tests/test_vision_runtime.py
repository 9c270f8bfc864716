"""Images through the runtime (runtime/images.py): a tiny synthetic VLM served by an
`Engine`, its prompt prefilled in chunks that cut through the image.

Independent references: transformers' greedy generation on the same prompt and image;
a cold engine (the prompt cache with images: the same screenshot in a later turn is a
hit, another image with the same text a miss, and either way warm == cold); plain
decoding (speculative == plain with images, with a DSpark draft and with the MTP head);
each request alone (batching)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from vision_rig import image_prompt, reference_run

from monolith.models import load_draft, load_model, load_mtp
from monolith.models.vision import vision_of
from monolith.pack import build_pack
from monolith.runtime.decoder import Decoder
from monolith.runtime.draft_model import DraftModelDrafter
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.events import Finished, GenerationRequest, RequestError
from monolith.runtime.images import PromptImages, row_key
from monolith.runtime.mtp_drafter import MTPDrafter
from monolith.runtime.prompt_cache import PromptCache
from monolith.tokenizer import load_tokenizer

CHUNK = 8  # prefill chunk rows: the prompts' images span several chunks
CONTEXT = 160


@pytest.fixture(scope="module")
def vlm(synth_dir, tmp_path_factory):
    """The synthetic MoE VLM packed with its MTP head, its Vision, tokenizer, a DSpark
    draft for it, and two prompts with one image each (the same text, other pixels)."""
    ckpt = synth_dir("target", "bf16")
    root = tmp_path_factory.mktemp("vision-runtime")
    pack = build_pack(ckpt, root / "pack", role="target", with_mtp=True)
    model = load_model(pack, dtype="float32")
    draft = load_draft(build_pack(synth_dir("draft", "deepspec"), root / "draft", role="draft"), model, "float32")
    config = json.loads((ckpt / "config.json").read_text())
    patch = config["vision_config"]["patch_size"]
    tokens, image = image_prompt(config, patch)
    other_tokens, other = image_prompt(config, patch, seed=5)
    assert other_tokens == tokens and other.digest != image.digest
    return dict(ckpt=ckpt, model=model, head=load_mtp(pack, model), draft=draft, vision=vision_of(pack),
                tokenizer=load_tokenizer(pack), config=config, tokens=tokens, image=image, other=other)


def engine(vlm, decoder=None, max_batch=1, **kw) -> Engine:
    decoder = decoder or Decoder(vlm["model"], None, CONTEXT, CHUNK)
    return Engine(vlm["model"], vlm["tokenizer"], Limits(max_context=CONTEXT, max_batch=max_batch), decoder=decoder,
                  vision=vlm["vision"], **kw)


def run(eng: Engine, tokens, images, max_tokens: int = 12) -> Finished:
    _, finished = eng.run_request(GenerationRequest(tuple(tokens), max_tokens, images=tuple(images)))
    return finished


def test_an_image_prompt_through_the_engine_matches_transformers(vlm):
    eng = engine(vlm)
    try:
        finished = run(eng, vlm["tokens"], [vlm["image"]], max_tokens=4)
    finally:
        eng.close()
    _, expected, _ = reference_run(vlm["ckpt"], vlm["tokens"], vlm["image"], vlm["config"]["image_token_id"])
    assert list(finished.token_ids) == expected[:len(finished.token_ids)] and finished.token_ids


def test_the_prompt_cache_keys_images_by_content(vlm):
    """Turn 2 resends turn 1 with its reply and more text: the image's rows are a hit.
    Turn 3 is turn 2's text with another image: a miss from the image on. Each reply
    equals a cold engine's."""
    tokens, image, other = vlm["tokens"], vlm["image"], vlm["other"]
    start = tokens.index(vlm["config"]["image_token_id"])
    end = start + image.tokens
    warm = engine(vlm, prompt_cache=PromptCache(64 << 20, save_every=4))
    try:
        first = run(warm, tokens, [image])
        turn2 = tokens + list(first.token_ids) + [7, 8, 9]
        second = run(warm, turn2, [image])
        third = run(warm, turn2, [other])
    finally:
        warm.close()
    assert second.usage.cached_tokens >= end  # the same screenshot: its rows come from the cache
    assert third.usage.cached_tokens <= start  # another image: nothing from the image on
    cold = engine(vlm)
    try:
        for prompt, img, got in ((tokens, image, first), (turn2, image, second), (turn2, other, third)):
            assert run(cold, prompt, [img]).token_ids == got.token_ids
            cold.session.reset()
    finally:
        cold.close()


@pytest.mark.parametrize("kind", ["dspark", "mtp"])
def test_speculative_decoding_with_an_image_equals_plain(vlm, kind):
    model = vlm["model"]
    drafter = DraftModelDrafter(vlm["draft"]) if kind == "dspark" else MTPDrafter(vlm["head"])
    results = []
    for decoder in (Decoder(model, None, CONTEXT, CHUNK), Decoder(model, drafter, CONTEXT, CHUNK)):
        eng = engine(vlm, decoder)
        try:
            results.append(run(eng, vlm["tokens"], [vlm["image"]], max_tokens=24))
        finally:
            eng.close()
    plain, spec = results
    assert spec.token_ids == plain.token_ids and spec.spec.drafts > 0


def test_images_batch_with_each_other_and_with_text(vlm):
    tokens, image, other = vlm["tokens"], vlm["image"], vlm["other"]
    text = [t for t in tokens if t < vlm["config"]["vision_start_token_id"]] * 2
    requests = [(tokens, [image]), (tokens, [other]), (text, [])]
    alone = engine(vlm)
    try:
        expected = []
        for prompt, images in requests:
            expected.append(run(alone, prompt, images).token_ids)
            alone.session.reset()
    finally:
        alone.close()
    batched = engine(vlm, max_batch=3)
    events = [[] for _ in requests]
    try:
        jobs = [batched.submit(GenerationRequest(tuple(prompt), 12, images=tuple(images)), sink.append)
                for (prompt, images), sink in zip(requests, events)]  # queued together: one batch
        for job in jobs:
            job.done.wait()
    finally:
        batched.close()
    results = [next(e.token_ids for e in sink if isinstance(e, Finished)) for sink in events]
    assert results == expected


def test_image_requests_are_checked_at_the_boundary(vlm):
    tokens, image = vlm["tokens"], vlm["image"]
    text_only = Engine(vlm["model"], vlm["tokenizer"], Limits(max_context=CONTEXT))
    try:
        with pytest.raises(RequestError, match="takes no images") as e:
            text_only.submit(GenerationRequest(tuple(tokens), 4, images=(image,)), lambda event: None)
        assert e.value.field == "images"
    finally:
        text_only.close()
    eng = engine(vlm)
    pad = vlm["config"]["image_token_id"]
    try:
        short = f"needs {image.tokens} image tokens, its run has {image.tokens - 1}"
        for bad, match in ((tokens[:6] + tokens[7:], short),
                           (tokens + [pad], "2 runs of the image token"),
                           ([t for t in tokens if t != pad], "0 runs")):
            with pytest.raises(RequestError, match=match):
                eng.submit(GenerationRequest(tuple(bad), 4, images=(image,)), lambda event: None)
    finally:
        eng.close()


def test_keys_differ_by_image_and_row_and_stay_int32(vlm):
    image, other = vlm["image"], replace(vlm["image"], digest=vlm["other"].digest)
    a = PromptImages(vlm["tokens"], [image], vlm["vision"], None).key
    b = PromptImages(vlm["tokens"], [other], vlm["vision"], None).key
    rows = [i for i, t in enumerate(vlm["tokens"]) if t == vlm["config"]["image_token_id"]]
    assert all(a[i] == vlm["tokens"][i] for i in range(len(a)) if i not in rows)
    assert all(a[r] != b[r] for r in rows) and len({a[r] for r in rows}) == len(rows)
    assert all(-2 ** 31 <= a[r] < 0 for r in rows) and a[rows[0]] == row_key(image.digest, 0)
    assert np.asarray(a, dtype=np.int32).tolist() == a
