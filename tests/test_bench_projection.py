"""bench/projection.py's MTP step bytes (docs/performance.md: what one MTP proposal reads
on a Mac) against the pack's own shard files: the byte ranges their safetensors headers
give, read here with no help from the pack's manifest. The dense 27B layout: every
matrix of the step is read whole, only the embedding is a row gather."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from bench.projection import mtp_step_bytes
from monolith.pack import build_pack, read_manifest
from monolith.synth.published import write_published_target


def shard_tensor_bytes(pack: Path) -> dict[str, int]:
    """Each tensor's byte count in the pack's .safetensors files, from their headers."""
    sizes = {}
    for shard in sorted(pack.glob("*.safetensors")):
        with shard.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                sizes[name] = end - start
    return sizes


def test_an_mtp_step_reads_the_head_the_lm_head_and_one_embedding_row(tmp_path):
    src = write_published_target(tmp_path / "src", "unsloth-27b")
    pack = build_pack(src, tmp_path / "pack", with_mtp=True)
    config = json.loads((pack / "config.json").read_text())
    tc = config["text_config"]
    sizes = shard_tensor_bytes(pack)

    def part(prefix):
        return sum(size for name, size in sizes.items() if name == prefix or name.startswith(prefix + "."))

    context = 100
    got = mtp_step_bytes(read_manifest(pack), config, 1, context)
    kv = tc["num_key_value_heads"] * tc["head_dim"] * 2 * 2 * (context + 1)  # K and V, 2 bytes, one layer
    assert got["head"] == part("mtp") > 0
    assert got["lm_head"] == part("lm_head") > 0
    embedding_row = part("model.embed_tokens") // tc["vocab_size"]
    assert got["embedding_and_norm"] == embedding_row + part("model.norm")
    assert got["total"] == part("mtp") + part("lm_head") + embedding_row + part("model.norm") + kv
