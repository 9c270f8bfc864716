"""Packs from real-world checkpoint layouts: modules the recipe drops (unsloth's MTP
files), fused 3-D quantized experts, unsloth's FP8 per-channel groups.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from pack_helpers import assert_cli_error, copy_checkpoint, pack_tensor, run_cli

from monolith import formats
from monolith.checkpoint import open_checkpoint
from monolith.formats import SafetensorsFile, write_safetensors
from monolith.pack import build_pack, read_manifest, unpack_pack, verify_pack
from monolith.pack.manifest import tensor_inventory


# ------------------------------------------------------------------ modules the recipe drops
def move_tensors(src: Path, prefix: str, file: str, listed: bool) -> list[str]:
    """Move every tensor starting with `prefix` into `file` (as unsloth stores its MTP head
    in model_mtp.safetensors) and write an index that lists it, or leaves it out."""
    weight_map, moved = {}, {}
    for path in sorted(src.glob("*.safetensors")):
        st = SafetensorsFile(path)
        kept = {}
        for n in st.names():
            (moved if n.startswith(prefix) else kept)[n] = (st.dtype(n), np.array(st.read(n)))
        st.close()
        write_safetensors(path, kept)
        weight_map.update({n: path.name for n in kept})
    write_safetensors(src / file, moved)
    if listed:
        weight_map.update({n: file for n in moved})
    index = {"metadata": {"total_size": 0}, "weight_map": dict(sorted(weight_map.items()))}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return sorted(moved)


def unsloth_27b_layout(synth_dir, dest: Path, listed: bool) -> tuple[Path, list[str]]:
    """unsloth Qwen3.6-27B Dynamic NVFP4: no ignore entry covers mtp.*, so its MLP and
    attention rules match the BF16 mtp.layers.0 linears, stored in model_mtp.safetensors."""
    src = copy_checkpoint(synth_dir("target", "compressed-tensors-mixed"), dest)
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg["quantization_config"]
    qc["ignore"] = [e for e in qc["ignore"] if "mtp" not in e]
    (src / "config.json").write_text(json.dumps(cfg))
    return src, move_tensors(src, "mtp.", "model_mtp.safetensors", listed)


@pytest.mark.parametrize("listed", [True, False], ids=["index-lists-mtp", "mtp-file-not-in-index"])
def test_dropped_mtp_modules_are_not_checked_against_the_quantization_rules(synth_dir, tmp_path, listed):
    src, mtp = unsloth_27b_layout(synth_dir, tmp_path / "src", listed)
    assert len(mtp) == 15
    pack = build_pack(src, tmp_path / "p")
    skipped = json.loads((pack / "conversion.json").read_text())["skipped"]
    for name in mtp:
        assert "MTP head" in skipped[name], name
        assert ("model_mtp.safetensors" in skipped[name]) == (not listed), skipped[name]
    # asked for (a --with-mtp pack), an MTP module may be stored BF16 although the rules that
    # match its name quantize it (a module of the model itself is still checked strictly: below)
    assert open_checkpoint(str(src)).module("mtp.layers.0.mlp.gate_proj").precision == "bf16"


def test_a_used_tensor_only_in_a_file_the_index_does_not_list_is_refused(synth_dir, tmp_path):
    src, _ = unsloth_27b_layout(synth_dir, tmp_path / "src", listed=True)
    move_tensors(src, "model.language_model.norm.weight", "extra.safetensors", listed=False)
    assert_cli_error(run_cli("build", src, "--out", tmp_path / "out"), "extra.safetensors",
                     "model.language_model.norm.weight", "index")


def add_quantized_layer(src: Path, module: str, algo: str) -> None:
    for name in ("config.json", "hf_quant_config.json"):
        cfg = json.loads((src / name).read_text())
        block = cfg.get("quantization_config") or cfg["quantization"]
        block["quantized_layers"][module] = {"quant_algo": algo, "group_size": 16}
        (src / name).write_text(json.dumps(cfg))


def test_unsupported_quant_algo_on_a_dropped_module_does_not_refuse_the_checkpoint(synth_dir, tmp_path):
    src = copy_checkpoint(synth_dir("target", "modelopt-mixed"), tmp_path / "src")
    add_quantized_layer(src, "mtp.layers.0.mlp.experts", "NVFP4_AWQ")
    add_quantized_layer(src, "model.visual.blocks.0.mlp.linear_fc1", "SOMETHING_NEW")
    assert verify_pack(build_pack(src, tmp_path / "p", with_vision=False))  # --no-vision drops the tower
    # the same entry on a module the runtime uses is refused, naming entry and algo
    used = copy_checkpoint(synth_dir("target", "modelopt-mixed"), tmp_path / "used")
    add_quantized_layer(used, "model.language_model.layers.0.mlp.gate", "NVFP4_AWQ")
    assert_cli_error(run_cli("build", used, "--out", tmp_path / "o"), "NVFP4_AWQ",
                     "quantized_layers['model.language_model.layers.0.mlp.gate']")


# ------------------------------------------------------------------ fused (3-D) quantized experts
EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(\w+)$")


def fuse_experts(src: Path) -> None:
    """Rewrite the single shard of `src` with every layer's experts fused, named and
    merged as transformers 5 does (MergeModulelist(dim=0) + Concatenate(dim=1)): the
    group name plus the serialized name without `weight` (`gate_up_proj_packed`,
    `_scale`, `_global_scale`, `_scale_2`, `_input_scale`...); scalars become [E, 2] / [E, 1]."""
    path = src / "model.safetensors"
    st = SafetensorsFile(path)
    out, groups = {}, {}
    for n in st.names():
        m = EXPERT.match(n)
        data = np.array(st.read(n))
        if m is None:
            out[n] = (st.dtype(n), data)
            continue
        container, e, proj, role = m.groups()
        if data.ndim == 0:
            data = data.reshape(1)
        groups.setdefault((container, role), {}).setdefault(int(e), {})[proj] = (st.dtype(n), data)
    st.close()
    for (container, role), experts in groups.items():
        suffix = role[len("weight"):] if role.startswith("weight") else "_" + role
        dtype = experts[0]["gate"][0]
        gate_up = [np.concatenate([experts[e]["gate"][1], experts[e]["up"][1]]) for e in sorted(experts)]
        down = [experts[e]["down"][1] for e in sorted(experts)]
        out[f"{container}.gate_up_proj{suffix}"] = (dtype, np.stack(gate_up))
        out[f"{container}.down_proj{suffix}"] = (dtype, np.stack(down))
    write_safetensors(path, out)


def fp8_experts(src: Path, exporter: str) -> None:
    """Turn a BF16 per-expert checkpoint's experts into FP8: compressed-tensors per
    channel with BF16 [N, 1] scales, or ModelOpt MIXED_PRECISION per tensor."""
    path = src / "model.safetensors"
    st = SafetensorsFile(path)
    out, containers = {}, set()
    for n in st.names():
        m = EXPERT.match(n)
        if m is None:
            out[n] = (st.dtype(n), np.array(st.read(n)))
            continue
        containers.add(m.group(1))
        codes, scale = formats.quantize_fp8(formats.bf16_bits_to_f32(st.read(n)), per_channel=exporter == "ct")
        out[n] = ("F8_E4M3", codes)
        scale_name = n.rsplit(".", 1)[0] + ".weight_scale"
        out[scale_name] = ("BF16", formats.f32_to_bf16_bits(scale)) if exporter == "ct" else ("F32", scale)
    st.close()
    write_safetensors(path, out)
    cfg = json.loads((src / "config.json").read_text())
    if exporter == "ct":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": [],
            "config_groups": {"group_0": {"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                                          "weights": weights, "format": "float-quantized"}}}
    else:
        block = {"quant_algo": "MIXED_PRECISION", "quantized_layers": {c: {"quant_algo": "FP8"} for c in sorted(containers)}}
        (src / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": block}))
        cfg["quantization_config"] = {"quant_method": "modelopt", **block}
    (src / "config.json").write_text(json.dumps(cfg))


def expert_sources(synth_dir, tmp_path: Path, fmt: str) -> tuple[Path, Path]:
    """(per-expert, fused) checkpoints holding the same quantized experts."""
    if fmt.endswith("fp8"):
        per = copy_checkpoint(synth_dir("target", "bf16", expert_layout="per-expert", shards=1), tmp_path / "per")
        fp8_experts(per, fmt.split("-")[0])
    else:
        per = copy_checkpoint(synth_dir("target", fmt, shards=1), tmp_path / "per")
    fused = copy_checkpoint(per, tmp_path / "fused")
    fuse_experts(fused)
    return per, fused


FUSED_FORMATS = ["compressed-tensors", "modelopt-nvfp4", "ct-fp8", "modelopt-fp8"]


@pytest.mark.parametrize("fmt", FUSED_FORMATS)
def test_fused_quantized_experts_pack_like_per_expert_ones(synth_dir, tmp_path, monkeypatch, fmt):
    per, fused = expert_sources(synth_dir, tmp_path, fmt)
    a, b = open_checkpoint(str(per)), open_checkpoint(str(fused))
    group = "model.language_model.layers.0.mlp.experts"
    assert not b.has_module(f"{group}.0.gate_proj") and b.has_fused_experts(f"{group}.gate_up_proj")
    for e in (0, 5):  # reading: the same values as the per-expert modules
        want = np.concatenate([a.dequantize(f"{group}.{e}.gate_proj"), a.dequantize(f"{group}.{e}.up_proj")])
        np.testing.assert_array_equal(b.dequantize(f"{group}.gate_up_proj", e), want)
        np.testing.assert_array_equal(b.dequantize(f"{group}.down_proj", e), a.dequantize(f"{group}.{e}.down_proj"))

    def forbidden(*args, **kw):
        raise AssertionError("quantizer called while packing an already-quantized source")

    monkeypatch.setattr(formats, "quantize_nvfp4", forbidden)
    pack_per, pack_fused = build_pack(per, tmp_path / "pp"), build_pack(fused, tmp_path / "pf")
    mp, mf_ = read_manifest(pack_per), read_manifest(pack_fused)
    assert tensor_inventory(mp["tensors"]) == tensor_inventory(mf_["tensors"])  # byte-identical tensors
    precision = "fp8" if fmt.endswith("fp8") else "nvfp4"
    for name in ("model.layers.0.mlp.experts.gate_up", "model.layers.0.mlp.experts.down"):
        assert mf_["entries"][name]["precision"] == precision and mf_["entries"][name]["stacked_source"]
    vp, vf = (json.loads((p / "validation.json").read_text())["round_trip"] for p in (pack_per, pack_fused))
    assert vf == vp and vf["quantized_parts_byte_identical"] > 16
    skipped = json.loads((pack_fused / "conversion.json").read_text())["skipped"]
    assert all("activation" in why for t, why in skipped.items() if t.startswith("model.") and ".experts." in t)
    rebuilt = build_pack(unpack_pack(pack_fused, tmp_path / "u"), tmp_path / "p2")
    assert tensor_inventory(read_manifest(rebuilt)["tensors"]) == tensor_inventory(mp["tensors"])


def test_fused_expert_scale_of_the_wrong_shape_is_named(synth_dir, tmp_path):
    _, fused = expert_sources(synth_dir, tmp_path, "compressed-tensors")
    path = fused / "model.safetensors"
    st = SafetensorsFile(path)
    tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
    st.close()
    victim = "model.language_model.layers.3.mlp.experts.down_proj_scale"
    tensors[victim] = ("F8_E4M3", tensors[victim][1][:, :, :-1].copy())
    write_safetensors(path, tensors)
    assert_cli_error(run_cli("build", fused, "--out", tmp_path / "o"), victim, "expected")


# ------------------------------------------------------------------ unsloth's FP8 per-channel groups
UNSLOTH_FP8 = re.compile(r".*(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|self_attn\.(q|k|v|o)_proj)$|^lm_head$")


def unsloth_fp8_map(synth_dir, dest: Path) -> Path:
    """The unsloth 27B map: FP8 per channel with BF16 [N, 1] weight scales for the GDN
    and attention projections and lm_head, NVFP4 MLPs (with input_global_scale), BF16
    self_attn.k_scale / v_scale, no ignore entry for mtp.*."""
    src = copy_checkpoint(synth_dir("target", "compressed-tensors-mixed", shards=1), dest)
    ckpt = open_checkpoint(str(src))
    st = SafetensorsFile(src / "model.safetensors")
    out = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
    st.close()
    for module in ckpt.module_names():
        if UNSLOTH_FP8.match(module) and not module.startswith("mtp."):
            w = ckpt.dequantize(module)
            for suffix in ("weight", "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
                out.pop(f"{module}.{suffix}", None)
            codes, scale = formats.quantize_fp8(w, per_channel=True)
            out[module + ".weight"] = ("F8_E4M3", codes)
            out[module + ".weight_scale"] = ("BF16", formats.f32_to_bf16_bits(scale))
            if module.endswith(("self_attn.k_proj", "self_attn.v_proj")):
                out[module.rsplit("_", 1)[0] + "_scale"] = ("BF16", formats.f32_to_bf16_bits(np.array(0.05, np.float32)))
        elif ckpt.has(module + ".weight_packed"):  # static NVFP4 activations: a calibrated input scale
            out[module + ".input_global_scale"] = ("F32", np.array([448.0 * 6 / 3.5], np.float32))
    write_safetensors(src / "model.safetensors", out)
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg["quantization_config"]
    nvfp4 = qc["config_groups"]["group_0"]
    nvfp4["targets"] = [r"re:.*mlp\.(gate|up|down)_proj$"]
    nvfp4["input_activations"]["dynamic"] = False
    fp8 = {"format": "float-quantized", "targets": [r"re:.*linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$",
                                                    r"re:.*self_attn\.(q|k|v|o)_proj$", "lm_head"],
           "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
                       "group_size": None, "observer": "minmax", "actorder": None, "block_structure": None,
                       "observer_kwargs": {}},
           "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
    qc["config_groups"] = {"group_0": fp8, "group_1": nvfp4}
    qc["ignore"] = [e for e in qc["ignore"] if "mtp" not in e and e != "lm_head"]
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_unsloth_fp8_channel_map_packs_exactly(synth_dir, tmp_path):
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    src = unsloth_fp8_map(synth_dir, tmp_path / "src")
    ckpt = open_checkpoint(str(src))
    pack = build_pack(src, tmp_path / "p")
    manifest = read_manifest(pack)
    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
    checked = 0
    for name, entry in manifest["entries"].items():
        if entry["precision"] != "fp8":
            continue
        words, ts = pack_tensor(pack, name + ".weight"), pack_tensor(pack, name + ".tensor_scale")
        codes = formats.words_to_bytes(words)
        for part in entry["parts"]:
            a, b = part["rows"]
            spec = ckpt.module(part["source"])
            assert ckpt.dtype(spec.tensors["weight_scale"]) == "BF16" and ckpt.shape(spec.tensors["weight_scale"])[1] == 1
            source_codes = ckpt.read(spec.tensors["weight"])
            assert codes[a:b].tobytes() == source_codes.tobytes(), part["source"]
            reference = dequantize(  # compressed-tensors' own FP8 dequantization, in float32
                x_q=torch.from_numpy(np.array(source_codes)).view(torch.float8_e4m3fn),
                scale=torch.from_numpy(ckpt.read_float(spec.tensors["weight_scale"])), args=args,
                dtype=torch.float32).numpy()
            ours = formats.e4m3_decode(codes[a:b]) * ts[a:b, None]
            np.testing.assert_array_equal(ours, reference, err_msg=part["source"])
            checked += 1
    assert checked >= 10 and "lm_head" in manifest["entries"] and manifest["entries"]["lm_head"]["precision"] == "fp8"
    skipped = json.loads((pack / "conversion.json").read_text())["skipped"]
    kv = [t for t in skipped if t.endswith(("self_attn.k_scale", "self_attn.v_scale"))]
    assert kv and all("KV-cache" in skipped[t] for t in kv)
    assert any(t.endswith("input_global_scale") for t in skipped)
