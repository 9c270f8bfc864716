"""monolith.synth quantized targets: ModelOpt and compressed-tensors tensors, configs and
scales, checked against the BF16 target and the compressed-tensors package."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import numpy as np
import pytest
from synth_helpers import assert_modelopt_mirror, bf16, read_all, rel_err

from monolith.formats import dequantize_fp8, dequantize_nvfp4, e4m3_decode, from_compressed_nvfp4
from monolith.synth import write_target

QUANTIZED_FORMATS = ["modelopt-nvfp4", "modelopt-mixed", "compressed-tensors", "compressed-tensors-mixed"]


# ------------------------------------------------------------- quantized targets


def _modelopt_algo(module: str, q: dict) -> str | None:
    if q["quant_algo"] == "MIXED_PRECISION":
        for key, entry in q["quantized_layers"].items():
            if module == key or module.startswith(key + "."):
                return entry["quant_algo"]
        return None
    return None if any(fnmatch.fnmatchcase(module, g) for g in q["exclude_modules"]) else q["quant_algo"]



def _ct_group(module: str, qc: dict, linear: bool):
    from compressed_tensors.utils.match import match_name

    def hit(target):
        return linear if target == "Linear" else match_name(module, target)

    if any(hit(t) for t in qc["ignore"]):
        return None
    return next((g for _, g in sorted(qc["config_groups"].items()) if any(hit(t) for t in g["targets"])), None)


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
@pytest.mark.parametrize("dense", [False, True])
def test_quantized_target_tensors(ckpts, fmt, dense):
    d = ckpts(fmt, dense)
    cfg = json.loads((d / "config.json").read_text())
    ref = read_all(ckpts("bf16", dense, None if dense else "per-expert"))
    got = read_all(d)
    qc, hf = _checked_quantization_config(d, fmt, cfg["quantization_config"])
    counts: dict[str, int] = {}
    expected_names = set()
    for name, (_, shape, _) in ref.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        is_linear = module is not None and len(shape) == 2 and "embed" not in name and "pos_embed" not in name
        w = bf16(ref[name])
        algo, group = _expected_algo(fmt, module, qc, is_linear)
        if algo is None:
            expected_names.add(name)
            assert got[name][0] == "BF16" and np.array_equal(got[name][2], ref[name][2]), name
            continue
        counts[str(algo)] = counts.get(str(algo), 0) + 1
        suffixes, deq, limit = _checked_quantized_tensors(got, module, algo, group, shape)
        expected_names.update(f"{module}.{s}" for s in suffixes)
        assert rel_err(deq, w) < limit, (module, rel_err(deq, w))
    if fmt == "modelopt-mixed":
        expected_names.update(k for k in got if k.endswith((".k_scale", ".v_scale")))
        assert any(k.endswith("self_attn.k_proj.k_scale") for k in got)
    assert set(got) == expected_names
    _assert_what_each_format_quantizes(fmt, counts, got, hf, dense)
    for k in ("model.language_model.embed_tokens.weight", "model.language_model.layers.0.linear_attn.conv1d.weight"):
        assert got[k][0] == "BF16"
    assert got["model.language_model.layers.0.linear_attn.A_log"][0] == "BF16"


def _checked_quantization_config(d: Path, fmt: str, qc: dict) -> tuple[dict, dict | None]:
    """The rules a target in `fmt` is quantized by (ModelOpt: hf_quant_config.json's, after
    checking config.json mirrors them), and hf_quant_config.json (None for compressed-tensors)."""
    if fmt.startswith("modelopt"):
        hf = json.loads((d / "hf_quant_config.json").read_text())
        assert hf["producer"] == {"name": "modelopt", "version": "0.47.0"}
        assert_modelopt_mirror(qc, hf)
        return hf["quantization"], hf
    assert not (d / "hf_quant_config.json").exists() and qc["quant_method"] == "compressed-tensors"
    return qc, None


def _expected_algo(fmt: str, module: str | None, qc: dict, is_linear: bool):
    """(the algorithm `module` is quantized with or None, its compressed-tensors group)."""
    if fmt.startswith("modelopt"):
        return (_modelopt_algo(module, qc) if is_linear else None), None
    group = _ct_group(module, qc, True) if is_linear else None
    return (None if group is None else (group["format"], group["weights"]["strategy"])), group


def _checked_quantized_tensors(got: dict, module: str, algo, group, shape) -> tuple[list[str], np.ndarray, float]:
    """Check the dtypes and shapes of one quantized module's tensors; returns their
    suffixes, the dequantized weight and its error bound."""
    n, k = shape
    if algo in ("NVFP4", "W4A16_NVFP4"):
        suffixes = ["weight", "weight_scale", "weight_scale_2"] + (["input_scale"] if algo == "NVFP4" else [])
        assert got[f"{module}.weight"][:2] == ("U8", (n, k // 2))
        assert got[f"{module}.weight_scale"][:2] == ("F8_E4M3", (n, k // 16))
        assert got[f"{module}.weight_scale_2"][:2] == ("F32", ())
        if algo == "NVFP4":
            assert got[f"{module}.input_scale"][:2] == ("F32", ())
        deq = dequantize_nvfp4(
            got[f"{module}.weight"][2], got[f"{module}.weight_scale"][2], got[f"{module}.weight_scale_2"][2]
        )
        return suffixes, deq, 0.2
    if algo == "FP8":
        suffixes = ["weight", "weight_scale", "input_scale"]
        assert got[f"{module}.weight"][:2] == ("F8_E4M3", (n, k))
        assert got[f"{module}.weight_scale"][:2] == ("F32", ())
        return suffixes, dequantize_fp8(got[f"{module}.weight"][2], got[f"{module}.weight_scale"][2]), 0.05
    if algo[0] == "nvfp4-pack-quantized":
        suffixes = ["weight_packed", "weight_scale", "weight_global_scale"]
        static_input = group["input_activations"]["dynamic"] is False
        suffixes += ["input_global_scale"] if static_input else []
        assert got[f"{module}.weight_packed"][:2] == ("U8", (n, k // 2))
        assert got[f"{module}.weight_scale"][:2] == ("F8_E4M3", (n, k // 16))
        assert got[f"{module}.weight_global_scale"][:2] == ("F32", (1,))
        q = from_compressed_nvfp4(*(got[f"{module}.{s}"][2] for s in suffixes[:3]))
        return suffixes, dequantize_nvfp4(q.packed, q.scales, q.tensor_scale), 0.2
    # float-quantized FP8, per channel or per tensor
    suffixes = ["weight", "weight_scale"]
    scale_shape = (n, 1) if algo[1] == "channel" else (1,)
    assert got[f"{module}.weight"][:2] == ("F8_E4M3", (n, k))
    assert got[f"{module}.weight_scale"][:2] == ("F32", scale_shape)
    return suffixes, dequantize_fp8(got[f"{module}.weight"][2], got[f"{module}.weight_scale"][2]), 0.05


def _assert_what_each_format_quantizes(fmt: str, counts: dict, got: dict, hf: dict | None, dense: bool) -> None:
    if fmt == "modelopt-nvfp4":
        assert set(counts) == {"NVFP4"}
        assert got["model.language_model.layers.0.linear_attn.in_proj_a.weight"][0] == "U8"
        assert got["lm_head.weight"][0] == "BF16"
    elif fmt == "modelopt-mixed":
        assert set(counts) == {"FP8", "W4A16_NVFP4"} and got["lm_head.weight"][0] == "U8"
        assert got["model.language_model.layers.0.linear_attn.in_proj_b.weight"][0] == "BF16"
        assert got["model.language_model.layers.3.self_attn.q_proj.weight"][0] == "F8_E4M3"
        if not dense:
            layers = hf["quantization"]["quantized_layers"]
            assert "model.language_model.layers.0.mlp.experts" in layers  # by container
            assert "model.language_model.layers.1.mlp.experts.3.down_proj" in layers  # one by one
    elif fmt == "compressed-tensors-mixed":
        assert set(counts) == {
            str(("nvfp4-pack-quantized", "tensor_group")),
            str(("float-quantized", "channel")),
            str(("float-quantized", "tensor")),
        }


def test_modelopt_shares_scales_between_linears_that_read_one_input(ckpts):
    t = read_all(ckpts("modelopt-nvfp4"))

    def s2(m):
        return float(t[f"model.language_model.layers.{m}.weight_scale_2"][2])

    assert s2("3.self_attn.q_proj") == s2("3.self_attn.k_proj") == s2("3.self_attn.v_proj")
    assert s2("0.linear_attn.in_proj_qkv") == s2("0.linear_attn.in_proj_a")
    assert s2("0.mlp.experts.5.gate_proj") == s2("0.mlp.experts.5.up_proj") != s2("0.mlp.experts.5.down_proj")
    ct = read_all(ckpts("compressed-tensors"))

    def g(m):
        return float(ct[f"model.language_model.layers.3.self_attn.{m}.weight_global_scale"][2][0])

    assert g("q_proj") != g("k_proj")  # compressed-tensors targets: one scale per matrix


def test_expert_layout_rules(tmp_path):
    with pytest.raises(ValueError, match="fused layout exists only in BF16"):
        write_target(tmp_path / "x", format="modelopt-nvfp4", expert_layout="fused")
    with pytest.raises(ValueError, match="MoE targets only"):
        write_target(tmp_path / "y", dense=True, expert_layout="fused")
    with pytest.raises(ValueError, match="unknown target format"):
        write_target(tmp_path / "z", format="gguf")


@pytest.mark.parametrize("fmt", ["compressed-tensors", "compressed-tensors-mixed"])
def test_compressed_tensors_package_agrees(ckpts, fmt):
    import torch
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    d = ckpts(fmt, fmt.endswith("mixed"))
    qc = QuantizationConfig.model_validate(json.loads((d / "config.json").read_text())["quantization_config"])
    assert qc.format == ("mixed-precision" if fmt.endswith("mixed") else "nvfp4-pack-quantized")
    t = read_all(d)
    checked = {"nvfp4": 0, "fp8": 0}
    for name in t:
        module = name.rsplit(".", 1)[0]
        group = _ct_group(module, json.loads((d / "config.json").read_text())["quantization_config"], True)
        if name.endswith(".weight_packed"):
            scheme = next(s for s in qc.config_groups.values() if s.format == "nvfp4-pack-quantized")
            packed, scales, gscale = (
                t[f"{module}.{s}"][2] for s in ("weight_packed", "weight_scale", "weight_global_scale")
            )
            n, k2 = packed.shape
            values = unpack_fp4_from_uint8(torch.from_numpy(packed), n, 2 * k2, dtype=torch.float32)
            theirs = dequantize(
                values,
                scale=torch.from_numpy(e4m3_decode(scales)),
                args=scheme.weights,
                dtype=torch.float32,
                global_scale=torch.from_numpy(gscale),
            ).numpy()
            q = from_compressed_nvfp4(packed, scales, gscale)
            ours = dequantize_nvfp4(q.packed, q.scales, q.tensor_scale)
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)
            checked["nvfp4"] += 1
        elif name.endswith(".weight") and t[name][0] == "F8_E4M3":
            assert group is not None and group["format"] == "float-quantized"
            scheme = next(
                s
                for s in qc.config_groups.values()
                if s.weights.strategy == group["weights"]["strategy"] and s.weights.num_bits == 8
            )
            fp8 = torch.from_numpy(t[name][2]).view(torch.float8_e4m3fn).float()
            theirs = dequantize(
                fp8, scale=torch.from_numpy(t[f"{module}.weight_scale"][2]), args=scheme.weights, dtype=torch.float32
            ).numpy()
            np.testing.assert_allclose(dequantize_fp8(t[name][2], t[f"{module}.weight_scale"][2]), theirs, rtol=1e-6)
            checked["fp8"] += 1
    assert checked["nvfp4"] > 0 and (checked["fp8"] > 0) == fmt.endswith("mixed")
