"""`python -m monolith.pack build SRC --dry-run`: configs and headers only, the pack's
exact size, every problem, and seconds on a full-size (sparse, header-only) checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from monolith.checkpoint import Checkpoint
from monolith.formats import SafetensorsFile, write_safetensors
from monolith.pack import build_pack, inspect_pack
from monolith.pack.dry_run import dry_run, format_dry_run
from monolith.synth import DRAFT_LAYOUTS, TARGET_LAYOUTS, write_published_draft, write_published_target

MEASURED: dict = {}


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "monolith.pack", *map(str, args)], capture_output=True, text=True)


@pytest.fixture
def headers_only(monkeypatch):
    """Fail on any tensor read or file hash: a dry run may look at headers only."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a dry run read tensor data or hashed a file")

    monkeypatch.setattr(SafetensorsFile, "read", forbidden)
    monkeypatch.setattr(Checkpoint, "_sha256", forbidden)


@pytest.fixture(scope="module")
def skeleton(tmp_path_factory):
    """skeleton(layout) -> a full-size sparse skeleton of a published target layout, written
    once per module (about 3 s each): dry runs only read it."""
    root = tmp_path_factory.mktemp("skeletons")
    made = {}

    def get(layout: str) -> Path:
        if layout not in made:
            made[layout] = write_published_target(root / layout, layout, preset="full", skeleton=True)
        return made[layout]

    return get


def snapshot(path: Path) -> dict:
    return {p.relative_to(path).as_posix(): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


# ------------------------------------------------------------------ tiny checkpoints: exact size
CASES = [("target", "modelopt-mixed", "auto"), ("target", "compressed-tensors", "auto"),
         ("target", "bf16", "nvfp4"), ("draft", "deepspec", "auto")]


@pytest.mark.parametrize("kind, fmt, quantization", CASES)
def test_dry_run_predicts_the_built_pack(synth_dir, tmp_path, monkeypatch, kind, fmt, quantization):
    src = synth_dir(kind, fmt)
    before = snapshot(src)
    with monkeypatch.context() as patch:
        patch.setattr(SafetensorsFile, "read", lambda *a, **k: pytest.fail("tensor data read"))
        patch.setattr(Checkpoint, "_sha256", lambda *a, **k: pytest.fail("file hashed"))
        report = dry_run(src, tmp_path / "p", quantization=quantization, shard_bytes=64 << 10)
    assert report.problems == [] and snapshot(src) == before and not (tmp_path / "p").exists()
    pack = build_pack(src, tmp_path / "p", quantization=quantization, shard_bytes=64 << 10)
    info = inspect_pack(pack)
    assert (report.pack_bytes, report.shards) == (info["bytes"], info["shards"])
    # every source tensor once, with the action the build took
    ckpt = Checkpoint(src)
    assert sorted(r.tensor for r in report.rows) == ckpt.tensor_names()
    conversion = json.loads((pack / "conversion.json").read_text())
    manifest = json.loads((pack / "manifest.json").read_text())
    for row in report.rows:
        if row.action == "drop":
            assert conversion["skipped"][row.tensor] == row.reason
            continue
        entry = manifest["entries"][row.entry]
        assert entry["reason"] == row.reason
        if row.action == "quantize":
            assert entry["precision"] == "nvfp4" and entry["source_precision"] != "nvfp4"
        elif row.action == "re-lay out":
            assert entry["precision"] == entry["source_precision"]
    if quantization == "nvfp4" or kind == "draft":
        assert any(r.action == "quantize" for r in report.rows)
    if kind == "target":
        assert any(r.tensor.startswith("mtp.") and r.action == "drop" for r in report.rows)


def test_dry_run_cli_exit_codes_and_out_is_optional_only_with_dry_run(synth_dir, tmp_path):
    src = synth_dir("target", "modelopt-nvfp4")
    result = run_cli("build", src, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "pack size" in result.stdout and "problems    0" in result.stdout and "re-lay out" in result.stdout
    result = run_cli("build", src)
    assert result.returncode != 0 and "--out" in result.stderr and "Traceback" not in result.stderr


def test_dry_run_lists_every_problem(synth_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(synth_dir("target", "modelopt-nvfp4", shards=1), src)
    path = src / "model.safetensors"
    st = SafetensorsFile(path)
    tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
    st.close()
    p = "model.language_model.layers"
    missing = f"{p}.0.linear_attn.out_proj.weight_scale"
    wrong = f"{p}.3.self_attn.o_proj.weight_scale"
    expert_missing = f"{p}.0.mlp.experts.1.gate_proj.weight_scale_2"
    expert_wrong = f"{p}.0.mlp.experts.2.down_proj.weight_scale"
    del tensors[missing], tensors[expert_missing]
    tensors[wrong] = ("U8", tensors[wrong][1])
    tensors[expert_wrong] = ("U8", tensors[expert_wrong][1])
    tensors[f"{p}.1.mlp.mystery_bias"] = ("F32", np.zeros(4, np.float32))
    write_safetensors(path, tensors)
    (tmp_path / "p").mkdir()
    result = run_cli("build", src, "--out", tmp_path / "p", "--dry-run")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    problems = [line for line in result.stdout.splitlines() if line.startswith("  problem: ")]
    for needle in (missing, wrong, expert_missing, expert_wrong, "mystery_bias", "already exists"):
        assert sum(needle in line for line in problems) == 1, (needle, problems)
    assert len(problems) == 6


def test_dry_run_lists_every_problem_of_a_draft(synth_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(synth_dir("draft", "deepspec-nvfp4"), src)
    path = src / "model.safetensors"
    st = SafetensorsFile(path)
    tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
    st.close()
    missing, wrong = "layers.0.mlp.down_proj.weight_scale", "layers.1.self_attn.o_proj.weight_scale"
    del tensors[missing]
    tensors[wrong] = ("U8", tensors[wrong][1])
    write_safetensors(path, tensors)
    result = run_cli("build", src, "--dry-run")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    problems = [line for line in result.stdout.splitlines() if line.startswith("  problem: ")]
    assert len(problems) == 2 and any(missing in p for p in problems) and any(wrong in p for p in problems), problems


# ------------------------------------------------------------------ full size, header only
H, V, E, I_MOE, LAYERS = 2048, 248_320, 256, 512, 40  # nvidia/Qwen3.6-35B-A3B-NVFP4 (issue 13)
Q_HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256
K_HEADS, V_HEADS, LINEAR_DIM = 16, 32, 128
LM = "model.language_model"
VISION_D, VISION_I, VISION_DEPTH, VISION_POSITIONS, PATCH = 1152, 4304, 27, 2304, 16  # its BF16 vision tower


def layer_types() -> list[str]:
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(LAYERS)]


def expected_payload_35b() -> int:
    """The pack's tensor bytes by the layout rules (docs/formats.md 5, target_recipe):
    NVFP4 [.., N, K] = N*K/2 words + N*K/16 scales + 4N tensor scales, FP8 = N*K words
    + N*K/32 unit scales + 4N, BF16 = 2NK, norms and GDN parameters F32."""
    def nvfp4(n, k, lead=1):
        return lead * (n * k // 2 + n * k // 16 + 4 * n)

    def fp8(n, k):
        return n * k + n * k // 32 + 4 * n

    key, value = K_HEADS * LINEAR_DIM, V_HEADS * LINEAR_DIM
    gdn = (fp8(2 * key + value + value, H) + 2 * 2 * V_HEADS * H + fp8(H, value)
           + 2 * (2 * key + value) * 4 + 4 * V_HEADS * 2 + 4 * LINEAR_DIM)
    attention = fp8(2 * Q_HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, H) + fp8(H, Q_HEADS * HEAD_DIM) + 2 * 4 * HEAD_DIM
    moe = (2 * E * H + 2 * H + nvfp4(2 * I_MOE, H) + nvfp4(H, I_MOE)
           + nvfp4(2 * I_MOE, H, E) + nvfp4(H, I_MOE, E))
    per_layer = [2 * 4 * H + moe + (gdn if kind == "linear_attention" else attention) for kind in layer_types()]
    return 2 * V * H + 4 * H + nvfp4(V, H) + sum(per_layer) + vision_payload_35b()


def vision_payload_35b() -> int:
    """The vision tower as published, BF16 (never quantized): patch embedding, position
    table, the blocks (two LayerNorms, qkv, proj, a two-layer MLP, all with biases) and
    the merger (LayerNorm, two linears over 2 x 2 merged patches)."""
    d, i, merged = VISION_D, VISION_I, 4 * VISION_D
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (i * d + i) + (d * i + d)
    top = (d * 3 * 2 * PATCH * PATCH + d) + VISION_POSITIONS * d + 2 * d + (merged * merged + merged) + (H * merged + H)
    return 2 * (VISION_DEPTH * block + top)


def test_dry_run_of_a_full_size_35b_skeleton(skeleton, headers_only):
    src = skeleton("nvidia-35b")
    source_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert source_bytes > 22e9  # "23.4 GB of safetensors"
    start = time.perf_counter()
    report = dry_run(src)
    MEASURED["dry run of the 35B-A3B skeleton, in process (s)"] = round(time.perf_counter() - start, 2)
    MEASURED["35B-A3B skeleton: source bytes / pack bytes"] = (source_bytes, report.pack_bytes)
    assert report.problems == [], report.problems[:3]
    assert report.payload_bytes == expected_payload_35b()
    assert report.shards == -(-report.payload_bytes // (1 << 30)) or report.shards > 1
    actions = {}
    for row in report.rows:
        actions.setdefault(row.action, []).append(row.tensor)
    assert sum(t.startswith("model.visual.") for t in actions["keep"]) == 333
    assert not any(t.startswith("model.visual.") for t in actions["drop"])
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in actions["drop"]
    assert f"{LM}.layers.0.mlp.experts.255.down_proj.weight" in actions["re-lay out"]
    assert "lm_head.input_scale" in actions["drop"] and "quantize" not in actions
    assert len(report.rows) == sum(len(SafetensorsFile(f).names()) for f in src.glob("*.safetensors"))
    text = format_dry_run(report)
    assert f"pack size   {report.pack_bytes} bytes" in text


def test_dry_run_cli_on_the_35b_skeleton(skeleton):
    src = skeleton("nvidia-35b")
    before = snapshot(src.parent)
    start = time.perf_counter()
    result = run_cli("build", src, "--dry-run")
    MEASURED["dry run of the 35B-A3B skeleton, CLI incl. start-up (s)"] = round(time.perf_counter() - start, 2)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "problems    0" in result.stdout
    assert snapshot(src.parent) == before  # nothing written beside or inside the source


@pytest.mark.parametrize("layout", [*TARGET_LAYOUTS, *DRAFT_LAYOUTS])
def test_dry_run_of_every_published_layout_at_full_size(tmp_path, skeleton, headers_only, layout):
    """Every published layout (monolith.synth.published, full-size sparse skeletons)
    plans with no problem, from headers only, and every source tensor gets an action."""
    if layout in TARGET_LAYOUTS:
        src = skeleton(layout)
    else:
        src = write_published_draft(tmp_path / layout, layout, skeleton(DRAFT_LAYOUTS[layout].target), skeleton=True)
    start = time.perf_counter()
    report = dry_run(src)
    MEASURED[f"dry run of the full-size {layout} skeleton (s)"] = round(time.perf_counter() - start, 2)
    assert report.problems == [], report.problems[:3]
    names = [n for f in sorted(src.glob("*.safetensors")) for n in SafetensorsFile(f).names()]
    assert sorted(r.tensor for r in report.rows) == sorted(names)
    assert report.pack_bytes > report.payload_bytes > 0
    if layout in TARGET_LAYOUTS:
        dropped = {r.tensor for r in report.rows if r.action == "drop"}
        kept = {r.tensor for r in report.rows if r.action == "keep"}
        assert sum(n.startswith("model.visual.") for n in kept) == 333  # the BF16 tower, as it is
        assert any(n.startswith("mtp.") for n in dropped)
