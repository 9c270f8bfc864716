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
DTYPE_BYTES = {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}


def linear(out: dict, name: str, n: int, k: int, scheme: str) -> None:
    if scheme == "nvfp4":
        out[f"{name}.weight"] = ("U8", (n, k // 2))
        out[f"{name}.weight_scale"] = ("F8_E4M3", (n, k // 16))
        out[f"{name}.weight_scale_2"] = ("F32", ())
    elif scheme == "fp8":
        out[f"{name}.weight"] = ("F8_E4M3", (n, k))
        out[f"{name}.weight_scale"] = ("F32", ())
        out[f"{name}.input_scale"] = ("F32", ())
    else:
        out[f"{name}.weight"] = ("BF16", (n, k))


def decoder_layer(out: dict, s: str, kind: str, quantized: bool, fused_experts: bool) -> None:
    fp8, nvfp4 = ("fp8", "nvfp4") if quantized else ("bf16", "bf16")
    out[f"{s}.input_layernorm.weight"] = ("BF16", (H,))
    out[f"{s}.post_attention_layernorm.weight"] = ("BF16", (H,))
    if kind == "linear_attention":
        key, value = K_HEADS * LINEAR_DIM, V_HEADS * LINEAR_DIM
        linear(out, f"{s}.linear_attn.in_proj_qkv", 2 * key + value, H, fp8)
        linear(out, f"{s}.linear_attn.in_proj_z", value, H, fp8)
        linear(out, f"{s}.linear_attn.in_proj_b", V_HEADS, H, "bf16")
        linear(out, f"{s}.linear_attn.in_proj_a", V_HEADS, H, "bf16")
        linear(out, f"{s}.linear_attn.out_proj", H, value, fp8)
        out[f"{s}.linear_attn.conv1d.weight"] = ("BF16", (2 * key + value, 1, 4))
        out[f"{s}.linear_attn.A_log"] = ("F32", (V_HEADS,))
        out[f"{s}.linear_attn.dt_bias"] = ("BF16", (V_HEADS,))
        out[f"{s}.linear_attn.norm.weight"] = ("F32", (LINEAR_DIM,))
    else:
        linear(out, f"{s}.self_attn.q_proj", 2 * Q_HEADS * HEAD_DIM, H, fp8)
        linear(out, f"{s}.self_attn.k_proj", KV_HEADS * HEAD_DIM, H, fp8)
        linear(out, f"{s}.self_attn.v_proj", KV_HEADS * HEAD_DIM, H, fp8)
        linear(out, f"{s}.self_attn.o_proj", H, Q_HEADS * HEAD_DIM, fp8)
        out[f"{s}.self_attn.q_norm.weight"] = ("BF16", (HEAD_DIM,))
        out[f"{s}.self_attn.k_norm.weight"] = ("BF16", (HEAD_DIM,))
    linear(out, f"{s}.mlp.gate", E, H, "bf16")
    linear(out, f"{s}.mlp.shared_expert_gate", 1, H, "bf16")
    for proj, n, k in (("gate_proj", I_MOE, H), ("up_proj", I_MOE, H), ("down_proj", H, I_MOE)):
        linear(out, f"{s}.mlp.shared_expert.{proj}", n, k, nvfp4)
    if fused_experts:  # the BF16 MTP layer: experts fused
        out[f"{s}.mlp.experts.gate_up_proj"] = ("BF16", (E, 2 * I_MOE, H))
        out[f"{s}.mlp.experts.down_proj"] = ("BF16", (E, H, I_MOE))
        return
    for e in range(E):
        for proj, n, k in (("gate_proj", I_MOE, H), ("up_proj", I_MOE, H), ("down_proj", H, I_MOE)):
            linear(out, f"{s}.mlp.experts.{e}.{proj}", n, k, nvfp4)


def layer_types() -> list[str]:
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(LAYERS)]


def inventory_35b() -> list[dict]:
    """Three shards of the nvidia 35B-A3B MIXED_PRECISION layout at real sizes: text
    layers, embeddings, lm_head (NVFP4 with input_scale), 333 BF16 vision tensors, the
    BF16 MTP layer with fused experts."""
    text: dict = {f"{LM}.embed_tokens.weight": ("BF16", (V, H)), f"{LM}.norm.weight": ("BF16", (H,))}
    for i, kind in enumerate(layer_types()):
        decoder_layer(text, f"{LM}.layers.{i}", kind, quantized=True, fused_experts=False)
    linear(text, "lm_head", V, H, "nvfp4")
    text["lm_head.input_scale"] = ("F32", ())
    other: dict = {}
    d, inter = 1152, 4304
    other["model.visual.patch_embed.proj.weight"] = ("BF16", (d, 3, 2, 16, 16))
    other["model.visual.patch_embed.proj.bias"] = ("BF16", (d,))
    other["model.visual.pos_embed.weight"] = ("BF16", (2304, d))
    for b in range(27):
        for part, n, k in (("norm1", d, 0), ("norm2", d, 0), ("attn.qkv", 3 * d, d), ("attn.proj", d, d),
                           ("mlp.linear_fc1", inter, d), ("mlp.linear_fc2", d, inter)):
            other[f"model.visual.blocks.{b}.{part}.weight"] = ("BF16", (n, k) if k else (n,))
            other[f"model.visual.blocks.{b}.{part}.bias"] = ("BF16", (n,))
    for part, n, k in (("norm", d, 0), ("linear_fc1", 4 * d, 4 * d), ("linear_fc2", H, 4 * d)):
        other[f"model.visual.merger.{part}.weight"] = ("BF16", (n, k) if k else (n,))
        other[f"model.visual.merger.{part}.bias"] = ("BF16", (n,))
    mtp: dict = {"mtp.fc.weight": ("BF16", (H, 2 * H)), "mtp.norm.weight": ("BF16", (H,)),
                 "mtp.pre_fc_norm_embedding.weight": ("BF16", (H,)), "mtp.pre_fc_norm_hidden.weight": ("BF16", (H,))}
    decoder_layer(mtp, "mtp.layers.0", "full_attention", quantized=False, fused_experts=True)
    names = sorted(text)
    half = len(names) // 2
    return [{n: text[n] for n in names[:half]}, {n: text[n] for n in names[half:]}, {**other, **mtp}]


def write_sparse_shard(path: Path, tensors: dict) -> int:
    """A safetensors header for `tensors`, the file truncated to its full size (sparse:
    no data blocks are written). Returns the file's size."""
    header, offset = {}, 0
    for name in sorted(tensors):
        dtype, shape = tensors[name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)
    return 8 + len(text) + offset


def write_35b_skeleton(path: Path) -> int:
    path.mkdir()
    shards = inventory_35b()
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_sparse_shard(path / name, tensors)
        weight_map.update({t: name for t in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    layers: dict = {}
    for i, kind in enumerate(layer_types()):
        s = f"{LM}.layers.{i}"
        fp8 = ([f"{s}.linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "out_proj")] if kind == "linear_attention"
               else [f"{s}.self_attn.{p}_proj" for p in "qkvo"])
        layers.update({m: {"quant_algo": "FP8"} for m in fp8})
        layers[f"{s}.mlp.experts"] = {"quant_algo": "NVFP4", "group_size": 16}
        layers.update({f"{s}.mlp.shared_expert.{p}": {"quant_algo": "NVFP4", "group_size": 16}
                       for p in ("gate_proj", "up_proj", "down_proj")})
    layers["lm_head"] = {"quant_algo": "NVFP4", "group_size": 16}
    exclude = ["*.mlp.gate", "*shared_expert_gate*", "*linear_attn.in_proj_a", "*linear_attn.in_proj_b",
               "model.visual*", "mtp*"]
    quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "exclude_modules": exclude,
             "quantized_layers": layers}
    producer = {"name": "modelopt", "version": "0.44.0"}
    (path / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": quant}))
    text_config = {
        "model_type": "qwen3_5_moe_text", "hidden_size": H, "num_hidden_layers": LAYERS, "layer_types": layer_types(),
        "full_attention_interval": 4, "num_attention_heads": Q_HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "linear_num_key_heads": K_HEADS, "linear_num_value_heads": V_HEADS,
        "linear_key_head_dim": LINEAR_DIM, "linear_value_head_dim": LINEAR_DIM, "linear_conv_kernel_dim": 4,
        "num_experts": E, "num_experts_per_tok": 8, "moe_intermediate_size": I_MOE,
        "shared_expert_intermediate_size": I_MOE, "vocab_size": V, "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                            "mrope_section": [11, 11, 10], "rope_type": "default"},
    }
    mirror = {"config_groups": {}, "ignore": exclude, "quant_algo": "MIXED_PRECISION", "quantized_layers": layers,
              "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}, "producer": producer,
              "quant_method": "modelopt"}
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": text_config, "tie_word_embeddings": False, "quantization_config": mirror}
    (path / "config.json").write_text(json.dumps(config))
    return total


def expected_payload_35b() -> int:
    """The pack's tensor bytes by the layout rules (formats.md 5, target_recipe):
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
    return 2 * V * H + 4 * H + nvfp4(V, H) + sum(per_layer)


def test_dry_run_of_a_full_size_35b_skeleton(tmp_path, headers_only):
    src = tmp_path / "nvidia-35b"
    source_bytes = write_35b_skeleton(src)
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
    assert sum(t.startswith("model.visual.") for t in actions["drop"]) == 333
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in actions["drop"]
    assert f"{LM}.layers.0.mlp.experts.255.down_proj.weight" in actions["re-lay out"]
    assert "lm_head.input_scale" in actions["drop"] and "quantize" not in actions
    assert len(report.rows) == sum(len(s) for s in inventory_35b())
    text = format_dry_run(report)
    assert f"pack size   {report.pack_bytes} bytes" in text


def test_dry_run_cli_on_the_35b_skeleton(tmp_path):
    src = tmp_path / "nvidia-35b"
    write_35b_skeleton(src)
    start = time.perf_counter()
    result = run_cli("build", src, "--dry-run")
    MEASURED["dry run of the 35B-A3B skeleton, CLI incl. start-up (s)"] = round(time.perf_counter() - start, 2)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "problems    0" in result.stdout
    assert not any(p.name.startswith(".") or p.is_dir() for p in tmp_path.iterdir() if p != src)
