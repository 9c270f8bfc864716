"""The vision tower in the target pack (docs/formats.md 5, docs/target.md "Vision tower"):
packed in source precision and never quantized, hashed, left out by --no-vision, shown
by inspect and dry-run, loaded by vision_of only on the first image, given to the
Engine by engine_setup."""

from __future__ import annotations

import io
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from pack_helpers import run_cli
from PIL import Image

from monolith import serve
from monolith.engine_setup import load_engine
from monolith.formats import SafetensorsFile
from monolith.model_flags import plan_model
from monolith.models import load_model
from monolith.models.image_inputs import prepare_image, read_image_settings
from monolith.models.vision import load_vision_tower, vision_of
from monolith.pack import PackError, build_pack, read_manifest, unpack_pack, verify_pack
from monolith.pack.manifest import sha256_file

# (synth format, dense): BF16 as published and nvidia's NVFP4 layout (its tower stays BF16)
SOURCES = [("bf16", False), ("bf16", True), ("modelopt-nvfp4", False), ("modelopt-nvfp4", True)]


@pytest.fixture(scope="module")
def packs(synth_dir, tmp_path_factory):
    """packs(format, dense, no_vision=False) -> (checkpoint, pack), each built once."""
    root, made = tmp_path_factory.mktemp("vision-packs"), {}

    def make(format, dense, no_vision=False):
        key = (format, dense, no_vision)
        if key not in made:
            src = synth_dir("target", format, dense=dense)
            made[key] = src, build_pack(src, root / "-".join(map(str, key)), role="target", with_vision=not no_vision)
        return made[key]

    return make


def screenshot(width=70, height=45) -> bytes:
    rng = np.random.default_rng(3)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(out, format="PNG")
    return out.getvalue()


def tower_tensors(pack) -> dict:
    """The pack's model.visual.* tensors read from the shards themselves (name -> bytes)."""
    manifest = read_manifest(pack)
    return {n: SafetensorsFile(pack / t["shard"]).read(n, copy=True)
            for n, t in manifest["tensors"].items() if n.startswith("model.visual.")}


@pytest.mark.parametrize("format, dense", SOURCES)
def test_the_pack_tower_gives_the_checkpoint_towers_features_bit_for_bit(packs, format, dense):
    src, pack = packs(format, dense)
    vision = vision_of(pack, mx.float32)
    assert vision is not None and not vision.loaded
    image = prepare_image(screenshot(), read_image_settings(pack))  # the processor config came with the pack
    assert read_image_settings(pack) == read_image_settings(src)
    features = vision.features(image)
    # a BF16 source widens exactly to F32 on either path: the same weights, the same arithmetic
    reference = load_vision_tower(src, mx.float32)(image.patches, [image.grid_thw])
    assert features.shape == (image.tokens, reference.shape[1])
    assert np.array_equal(np.array(features), np.array(reference))
    tensors = tower_tensors(pack)
    assert len(tensors) == 21 and {t.dtype for t in tensors.values()} == {np.dtype("uint16")}  # BF16 bits
    assert tensors["model.visual.patch_embed.proj.weight"].ndim == 2  # stored flattened [D, patch_dim]


def test_bf16_compute_matches_too(packs):
    src, pack = packs("bf16", False)
    image = prepare_image(screenshot(40, 90), read_image_settings(pack))
    got = vision_of(pack, mx.bfloat16).features(image)
    want = load_vision_tower(src, mx.bfloat16)(image.patches, [image.grid_thw])
    assert got.dtype == mx.bfloat16 and np.array_equal(np.array(got.astype(mx.float32)),
                                                       np.array(want.astype(mx.float32)))


def test_the_tower_is_read_only_on_the_first_image(packs):
    """Loading the model reads no tower byte (the same memory as the pack without it);
    vision_of reads nothing; tower() reads it once."""
    _, pack = packs("bf16", False)
    _, bare = packs("bf16", False, no_vision=True)
    used = []
    for p in (pack, bare):
        mx.clear_cache()
        before = mx.get_active_memory()
        model = load_model(p, dtype=mx.float32, dense=False)
        used.append(mx.get_active_memory() - before)
        del model
    assert used[0] == used[1]
    before = mx.get_active_memory()
    vision = vision_of(pack, mx.float32)
    assert mx.get_active_memory() == before and not vision.loaded
    tower = vision.tower()
    tower_bytes = sum(t.size for t in tower_tensors(pack).values()) * 4  # held as F32
    assert mx.get_active_memory() - before >= tower_bytes
    assert vision.tower() is tower and vision.loaded


def test_no_vision_leaves_the_tower_out(packs, tmp_path):
    _, pack = packs("modelopt-nvfp4", False)
    _, bare = packs("modelopt-nvfp4", False, no_vision=True)
    manifest, without = read_manifest(pack), read_manifest(bare)
    assert manifest["layout"]["vision"]["packed"] and manifest["layout"]["vision"]["tensors"] == 21
    assert without["layout"]["vision"] == {"packed": False, "reason": "left out (--no-vision)"}
    assert not any(n.startswith("model.visual.") for n in without["tensors"])
    tower_bytes = sum(t.nbytes for t in tower_tensors(pack).values())
    size = {p: sum(s["bytes"] for s in read_manifest(p)["shards"].values()) for p in (pack, bare)}
    assert size[pack] - size[bare] >= tower_bytes
    assert vision_of(bare) is None
    verify_pack(bare)
    # a text-only checkpoint (the --no-vision pack unpacked: a vision_config, no tower) and its pack
    text_only = unpack_pack(bare, tmp_path / "text-only")
    assert vision_of(text_only) is None
    repacked = build_pack(text_only, tmp_path / "text-pack", role="target")
    assert "vision" not in read_manifest(repacked)["layout"] and vision_of(repacked) is None


def test_inspect_and_dry_run_state_the_tower(packs):
    src, pack = packs("bf16", True)
    tower_bytes = sum(t.nbytes for t in tower_tensors(pack).values())
    shown = run_cli("inspect", pack).stdout
    assert f"vision        {tower_bytes / 1e6:.1f} MB in 21 tensors ({tower_bytes} bytes" in shown
    info = json.loads(run_cli("inspect", pack, "--json").stdout)
    assert info["vision"] == {"packed": True, "tensors": 21, "bytes": tower_bytes}
    split = json.loads(run_cli("inspect", pack, "--json", "--ranks", "2").stdout)["ranks"]
    shards = [SafetensorsFile(pack / s) for s in read_manifest(pack)["shards"]]
    tensor_bytes = sum(st.read(n).nbytes for st in shards for n in st.names())
    assert sum(r["bytes"] for r in split) == tensor_bytes - tower_bytes  # no rank holds the tower
    assert "on no rank" in run_cli("inspect", pack, "--ranks", "2").stdout
    dry = run_cli("build", src, "--dry-run", "--quantization", "nvfp4").stdout
    vision_line = next(line for line in dry.splitlines() if line.startswith("vision"))
    assert "21 tensors" in vision_line and "never quantized" in vision_line
    rows = [line.split() for line in dry.splitlines() if line.strip().startswith("model.visual.")]
    assert len(rows) == 21 and all(row[1] == "keep" for row in rows)
    assert "quantize" in {row[1] for row in (line.split() for line in dry.splitlines() if line.startswith("  "))}
    left_out = run_cli("build", src, "--dry-run", "--no-vision").stdout
    assert "vision      tower left out (--no-vision)" in left_out


def test_verify_covers_the_tower(packs, tmp_path):
    _, pack = packs("bf16", True)
    copy = tmp_path / "copy"
    shutil.copytree(pack, copy)
    name = "model.visual.pos_embed.weight"
    shard = copy / read_manifest(copy)["tensors"][name]["shard"]
    data = bytearray(shard.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    start = json.loads(data[8:header])[name]["data_offsets"][0]
    data[header + start] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(PackError, match=f"tensor {name}: SHA-256 mismatch"):
        verify_pack(copy)


def test_the_pack_rebuilds_byte_identically_with_the_tower(packs, tmp_path):
    src, pack = packs("bf16", False)
    again = build_pack(src, tmp_path / "again", role="target")
    assert read_manifest(again)["pack_sha256"] == read_manifest(pack)["pack_sha256"]
    for name in read_manifest(pack)["shards"]:
        assert sha256_file(again / name) == sha256_file(pack / name)


def test_the_engine_gets_the_vision_unless_told_not_to(packs):
    _, pack = packs("bf16", False)
    base = ["--pack", str(pack), "--no-draft", "--no-warmup", "--prompt-cache-size", "0", "--dtype", "float32",
            "--max-context", "256"]
    for flags, wanted in (([], True), (["--no-vision"], False)):
        args = serve.build_parser().parse_args(base + flags)
        engine = load_engine(args, plan_model(args), lambda message: None)
        try:
            assert (engine.vision is not None) == wanted
            assert engine.vision is None or not engine.vision.loaded
        finally:
            engine.close()
