"""monolith.synth: deterministic synthetic checkpoints with real names, shapes and configs."""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from monolith.formats import (
    SafetensorsFile,
    bf16_bits_to_f32,
    dequantize_fp8,
    dequantize_nvfp4,
    e4m3_decode,
    from_compressed_nvfp4,
)
from monolith.synth import PRESETS, Preset, draft_sizes, write_draft, write_pair, write_target, write_tokenizer
from monolith.synth import tokenizer as synth_tok
from monolith.synth.target import plan_units, target_params
from monolith.synth.values import as_bf16
from monolith.synth.writers import stored_bytes

QUANTIZED_FORMATS = ["modelopt-nvfp4", "modelopt-mixed", "compressed-tensors", "compressed-tensors-mixed"]


def read_all(d: Path) -> dict[str, tuple[str, tuple, np.ndarray]]:
    """name -> (dtype, shape, stored bits) over every safetensors file of a checkpoint."""
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        st = SafetensorsFile(f)
        for n in st.names():
            assert n not in out, f"{n} in two files"
            out[n] = (st.dtype(n), st.shape(n), np.array(st.read(n)))
    return out


def bf16(t) -> np.ndarray:
    assert t[0] == "BF16", t[0]
    return bf16_bits_to_f32(t[2])


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def files_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny targets, written once per module: {(format, dense, layout): dir}."""
    root = tmp_path_factory.mktemp("synth")
    cache = {}

    def get(fmt="bf16", dense=False, layout=None, seed=0):
        key = (fmt, dense, layout, seed)
        if key not in cache:
            name = f"{fmt}-{'dense' if dense else 'moe'}-{layout}-{seed}"
            cache[key] = write_target(root / name, format=fmt, dense=dense, expert_layout=layout, seed=seed)
        return cache[key]

    return get


# ------------------------------------------------------------------ determinism


def test_same_arguments_give_identical_bytes(tmp_path):
    a = write_target(tmp_path / "a", format="modelopt-mixed", seed=3)
    b = write_target(tmp_path / "b", format="modelopt-mixed", seed=3)
    assert files_bytes(a) == files_bytes(b)
    da = write_draft(tmp_path / "da", a, format="speculators", seed=3)
    db = write_draft(tmp_path / "db", b, format="speculators", seed=3)
    assert files_bytes(da) == files_bytes(db)
    c = write_target(tmp_path / "c", format="modelopt-mixed", seed=4)
    assert files_bytes(a)["model-00001-of-00002.safetensors"] != files_bytes(c)["model-00001-of-00002.safetensors"]


def test_tokenizer_training_is_deterministic_across_processes():
    code = "from monolith.synth.tokenizer import tokenizer_json; import sys; sys.stdout.write(tokenizer_json())"
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    ]
    assert runs[0] == runs[1] == synth_tok.tokenizer_json()


# ------------------------------------------------------------------ target config


@pytest.mark.parametrize("dense", [False, True])
def test_text_config_is_accepted_by_transformers(ckpts, dense):
    import transformers

    cfg = json.loads((ckpts("bf16", dense) / "config.json").read_text())
    tc = cfg["text_config"]
    assert cfg["architectures"] == [
        "Qwen3_5ForConditionalGeneration" if dense else "Qwen3_5MoeForConditionalGeneration"
    ]
    assert cfg["model_type"] == ("qwen3_5" if dense else "qwen3_5_moe")
    assert tc["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert tc["attn_output_gate"] is True and tc["tie_word_embeddings"] is False and cfg["tie_word_embeddings"] is False
    assert tc["rope_parameters"]["partial_rotary_factor"] == 0.25 and tc["rope_parameters"]["mrope_interleaved"]
    assert sum(tc["rope_parameters"]["mrope_section"]) == tc["head_dim"] // 8
    klass = transformers.Qwen3_5TextConfig if dense else transformers.Qwen3_5MoeTextConfig
    parsed = klass(**tc)
    assert parsed.layer_types == tc["layer_types"] and parsed.head_dim == 32
    full = (transformers.Qwen3_5Config if dense else transformers.Qwen3_5MoeConfig)(**cfg)
    assert full.text_config.hidden_size == 64 and full.vision_config.out_hidden_size == 64
    if dense:
        assert "num_experts" not in tc and tc["intermediate_size"] == 128
    else:
        assert (tc["num_experts"], tc["num_experts_per_tok"], tc["moe_intermediate_size"]) == (8, 2, 32)


def _hf_keys(model) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dense", [False, True])
def test_bf16_target_loads_into_transformers_without_missing_keys(ckpts, dense):
    import torch
    import transformers

    d = ckpts("bf16", dense)
    cfg = json.loads((d / "config.json").read_text())
    causal = transformers.Qwen3_5ForCausalLM if dense else transformers.Qwen3_5MoeForCausalLM
    text_cls = transformers.Qwen3_5TextConfig if dense else transformers.Qwen3_5MoeTextConfig
    with torch.device("meta"):
        model = causal(text_cls(**cfg["text_config"]))
    expected = _hf_keys(model)
    ours = {
        k.replace("model.language_model.", "model."): v[1]
        for k, v in read_all(d).items()
        if not k.startswith(("model.visual.", "mtp."))
    }
    assert sorted(set(expected) - set(ours)) == [] and sorted(set(ours) - set(expected)) == []
    assert {k: v for k, v in expected.items() if ours[k] != v} == {}
    if not dense:  # the installed transformers keeps experts fused, as the official release
        assert "model.layers.0.mlp.experts.gate_up_proj" in expected
    # The whole multimodal checkpoint (vision included) loads with nothing missing.
    full_cls = (
        transformers.Qwen3_5ForConditionalGeneration if dense else transformers.Qwen3_5MoeForConditionalGeneration
    )
    full, info = full_cls.from_pretrained(d, output_loading_info=True, dtype=torch.float32, local_files_only=True)
    assert info["missing_keys"] == set() or info["missing_keys"] == []
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        logits = full(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert torch.isfinite(logits).all() and float(top[0] - top[1]) > 0  # peaked, well-defined argmax


def test_per_expert_layout_stacks_into_the_fused_layout(ckpts):
    fused = read_all(ckpts("bf16", False, "fused"))
    per = read_all(ckpts("bf16", False, "per-expert"))
    e = PRESETS["tiny"].num_experts
    for prefix in ("model.language_model.layers.2.mlp.experts", "mtp.layers.0.mlp.experts"):
        gate = np.stack([per[f"{prefix}.{i}.gate_proj.weight"][2] for i in range(e)])
        up = np.stack([per[f"{prefix}.{i}.up_proj.weight"][2] for i in range(e)])
        down = np.stack([per[f"{prefix}.{i}.down_proj.weight"][2] for i in range(e)])
        assert fused[f"{prefix}.gate_up_proj"][1] == (8, 64, 64) and fused[f"{prefix}.down_proj"][1] == (8, 64, 32)
        assert np.array_equal(fused[f"{prefix}.gate_up_proj"][2], np.concatenate([gate, up], axis=1))
        assert np.array_equal(fused[f"{prefix}.down_proj"][2], down)
    rest = {k for k in per if ".experts." not in k}
    assert rest == {k for k in fused if ".experts." not in k}
    assert all(np.array_equal(per[k][2], fused[k][2]) for k in rest)


def test_target_values_follow_the_real_conventions(ckpts):
    t = read_all(ckpts("bf16"))
    la = "model.language_model.layers.0.linear_attn"
    a_log = bf16(t[f"{la}.A_log"])
    assert np.all((a_log >= 0) & (a_log <= np.log(16) + 0.01))
    assert abs(float(bf16(t[f"{la}.norm.weight"]).mean()) - 1) < 0.1  # plain gated-norm weight
    assert abs(float(bf16(t["model.language_model.norm.weight"]).mean())) < 0.1  # zero-centred
    assert t[f"{la}.conv1d.weight"][1] == (64 + 64, 1, 4) and t[f"{la}.dt_bias"][1] == (4,)
    assert abs(float(bf16(t["model.language_model.embed_tokens.weight"]).std()) - 1) < 0.05
    assert t["model.language_model.layers.3.self_attn.q_proj.weight"][1] == (2 * 4 * 32, 64)
    assert t["mtp.fc.weight"][1] == (64, 128) and "mtp.pre_fc_norm_embedding.weight" in t
    assert any(k.startswith("model.visual.blocks.0.") for k in t)
    index = json.loads((ckpts("bf16") / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(t)
    assert index["metadata"]["total_size"] == sum(v[2].nbytes for v in t.values())


# ------------------------------------------------------------- quantized targets


def _modelopt_algo(module: str, q: dict) -> str | None:
    if q["quant_algo"] == "MIXED_PRECISION":
        for key, entry in q["quantized_layers"].items():
            if module == key or module.startswith(key + "."):
                return entry["quant_algo"]
        return None
    return None if any(fnmatch.fnmatchcase(module, g) for g in q["exclude_modules"]) else q["quant_algo"]


def assert_modelopt_mirror(mirror: dict, hf: dict) -> None:
    """config.json's quantization_config as ModelOpt's exporter derives it from
    hf_quant_config.json (modelopt.torch.export.convert_hf_config): compressed-tensors
    shaped groups, `ignore` = exclude_modules, the KV setting as `kv_cache_scheme`."""
    q = hf["quantization"]
    mixed = q["quant_algo"] == "MIXED_PRECISION"
    keys = {"config_groups", "ignore", "quant_algo", "producer", "quant_method"}
    keys |= {"quantized_layers"} if mixed else set()
    keys |= {"kv_cache_scheme"} if q.get("kv_cache_quant_algo") else set()
    assert set(mirror) == keys, sorted(mirror)
    assert mirror["quant_method"] == "modelopt" and mirror["producer"] == hf["producer"]
    assert mirror["quant_algo"] == q["quant_algo"] and mirror["ignore"] == (q.get("exclude_modules") or [])
    if q.get("kv_cache_quant_algo") == "FP8":
        assert mirror["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    groups = mirror["config_groups"]
    assert list(groups) == [f"group_{i}" for i in range(len(groups))]
    if not mixed:
        assert [g["targets"] for g in groups.values()] == [["Linear"]]
        return
    assert mirror["quantized_layers"] == q["quantized_layers"]
    bits = {"FP8": (8, 8), "NVFP4": (4, 4), "W4A16_NVFP4": (4, None)}
    listed = []
    for g in groups.values():
        assert g["targets"] == sorted(g["targets"])
        algos = {q["quantized_layers"][t]["quant_algo"] for t in g["targets"]}
        assert len(algos) == 1
        weights, inputs = bits[algos.pop()]
        assert g["weights"]["num_bits"] == weights and g["weights"]["type"] == "float"
        assert (g.get("input_activations") or {}).get("num_bits") == inputs
        listed += g["targets"]
    assert sorted(listed) == sorted(q["quantized_layers"])


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


# ------------------------------------------------------------------------ drafts


@pytest.fixture(scope="module")
def drafts(ckpts, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    target = ckpts("bf16")
    return target, {
        f: write_draft(root / f, target, format=f, seed=7)
        for f in ("deepspec", "deepspec-nvfp4", "speculators", "dflash")
    }


def test_deepspec_draft(drafts):
    import transformers

    target, d = drafts
    tc = json.loads((target / "config.json").read_text())["text_config"]
    cfg = json.loads((d["deepspec"] / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["hidden_size"] == tc["hidden_size"] and cfg["vocab_size"] == tc["vocab_size"]
    assert cfg["num_attention_heads"] * cfg["head_dim"] != cfg["hidden_size"]
    assert cfg["target_layer_ids"] == [0, 2] and cfg["num_target_layers"] == 4 and cfg["block_size"] == 8
    assert cfg["markov_rank"] == 16 and cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"]
    assert cfg["mask_token_id"] == synth_tok.special_token_ids()["<|mask|>"]
    assert cfg["partial_rotary_factor"] == 0.25 and cfg["attn_output_gate"] is True  # inherited junk
    assert transformers.Qwen3Config(**cfg).head_dim == 32  # a Qwen3-style config
    t = read_all(d["deepspec"])
    assert t["fc.weight"][1] == (64, 2 * 64) and t["confidence_head.proj.weight"][1] == (1, 64 + 16)
    assert t["markov_head.markov_w1.weight"][1] == (512, 16) and t["markov_head.markov_w2.weight"][1] == (512, 16)
    assert t["layers.1.self_attn.q_proj.weight"][1] == (4 * 32, 64) and t["layers.1.self_attn.q_norm.weight"][1] == (
        32,
    )
    assert all(v[0] == "BF16" for v in t.values())
    # frozen copies of the target's embedding and lm_head
    tt = read_all(target)
    assert np.array_equal(t["embed_tokens.weight"][2], tt["model.language_model.embed_tokens.weight"][2])
    assert np.array_equal(t["lm_head.weight"][2], tt["lm_head.weight"][2])
    assert (d["deepspec"] / "tokenizer.json").exists()


def test_deepspec_nvfp4_export(drafts):
    _, d = drafts
    ref, got = read_all(d["deepspec"]), read_all(d["deepspec-nvfp4"])
    cfg = json.loads((d["deepspec-nvfp4"] / "config.json").read_text())
    assert cfg["lithos_quantization"]["format"] == "nvfp4" and cfg["lithos_quantization"]["keep"] == ["markov_w1"]
    hf = json.loads((d["deepspec-nvfp4"] / "hf_quant_config.json").read_text())
    assert_modelopt_mirror(cfg["quantization_config"], hf)
    layers = hf["quantization"]["quantized_layers"]
    matrices = [n for n, v in ref.items() if len(v[1]) == 2 and v[1][0] > 1 and "markov_w1" not in n]
    assert sorted(layers) == sorted(n[: -len(".weight")] for n in matrices)
    for n in matrices:
        m = n[: -len(".weight")]
        assert got[n][0] == "U8" and got[f"{m}.weight_scale"][0] == "F8_E4M3" and f"{m}.input_scale" not in got
        deq = dequantize_nvfp4(got[n][2], got[f"{m}.weight_scale"][2], got[f"{m}.weight_scale_2"][2])
        assert rel_err(deq, bf16(ref[n])) < 0.2
    for n in (
        "markov_head.markov_w1.weight",
        "norm.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    ):
        assert got[n][0] == "BF16" and np.array_equal(got[n][2], ref[n][2])
    assert "embed_tokens" in layers and "markov_head.markov_w2" in layers


def test_speculators_draft_is_the_deepspec_twin(drafts):
    import transformers

    _, d = drafts
    ds, sp = read_all(d["deepspec"]), read_all(d["speculators"])
    ds_cfg = json.loads((d["deepspec"] / "config.json").read_text())
    cfg = json.loads((d["speculators"] / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["speculators_config"]["algorithm"] == "dspark"
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in ds_cfg["target_layer_ids"]]
    assert cfg["sample_from_anchor"] is True and cfg["draft_vocab_size"] == 256
    layer = cfg["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention"] * 2 and layer["use_sliding_window"]
    qwen3 = transformers.Qwen3Config(**layer)
    assert qwen3.sliding_window == layer["sliding_window"] and qwen3.head_dim == ds_cfg["head_dim"]
    d2t, t2d = sp["d2t"], sp["t2d"]
    assert d2t[:2] == ("I64", (256,)) and t2d[:2] == ("BOOL", (512,))
    rows = np.arange(256) + d2t[2]
    assert np.all(np.diff(rows) > 0) and int(t2d[2].sum()) == 256 and np.all(t2d[2][rows])
    assert set(synth_tok.special_token_ids().values()) <= set(rows.tolist())
    assert "embed_tokens.weight" not in sp
    for name, v in sp.items():
        if name in ("d2t", "t2d"):
            continue
        if name in ("lm_head.weight", "markov_head.markov_w2.weight"):
            assert np.array_equal(v[2], ds[name][2][rows]), name
        else:
            assert np.array_equal(v[2], ds[name][2]), name
    assert set(sp) - {"d2t", "t2d"} == set(ds) - {"embed_tokens.weight"}


def test_dflash_draft(drafts):
    import transformers

    _, d = drafts
    cfg = json.loads((d["dflash"] / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"]["block_size"] == 16 and cfg["dflash_config"]["target_layer_ids"] == [0, 2]
    assert cfg["rope_parameters"]["rope_type"] == "yarn"
    assert transformers.Qwen3Config(**cfg).rope_parameters["factor"] == 2.0
    t = read_all(d["dflash"])
    assert not any(n.startswith(("embed_tokens", "lm_head", "markov", "confidence")) for n in t)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= set(t)
    assert np.array_equal(
        t["layers.0.mlp.up_proj.weight"][2], read_all(d["deepspec"])["layers.0.mlp.up_proj.weight"][2]
    )
    assert not (d["dflash"] / "tokenizer.json").exists()


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_markov_head_variants(ckpts, tmp_path, head):
    d = write_draft(tmp_path / head, ckpts("bf16"), format="deepspec", markov_head_type=head)
    t = read_all(d)
    r, h = 16, 64
    if head == "gated":
        assert t["markov_head.gate_proj.weight"][1] == (r, h + r) and t["markov_head.gate_proj.bias"][1] == (r,)
    else:
        assert t["markov_head.joint_proj.weight"][1] == (3 * r, 2 * r + h) and t["markov_head.joint_proj.bias"][1] == (
            3 * r,
        )
    assert json.loads((d / "config.json").read_text())["markov_head_type"] == head


def test_draft_copies_quantized_target_embeddings(ckpts, tmp_path):
    target = ckpts("modelopt-mixed")  # lm_head is W4A16 NVFP4 there
    t = read_all(write_draft(tmp_path / "d", target))
    tt = read_all(target)
    lm = dequantize_nvfp4(tt["lm_head.weight"][2], tt["lm_head.weight_scale"][2], tt["lm_head.weight_scale_2"][2])
    assert np.array_equal(bf16(t["lm_head.weight"]), as_bf16(lm))  # the dequantized values, in BF16


# --------------------------------------------------------------------- tokenizer


def test_tokenizer_loads_and_round_trips(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    write_tokenizer(tmp_path)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = synth_tok.special_token_ids()
    assert len(ids) == 10 and max(ids.values()) + 1 == len(fast) < PRESETS["tiny"].vocab_size
    text = 'def f(x):\n    return {"a": x * 2}  # café, naïve — 你好\n'
    for tk in (fast, auto):
        assert tk.decode(tk(text)["input_ids"]) == text
    assert auto.eos_token == "<|im_end|>" and auto.eos_token_id == ids["<|im_end|>"]
    assert auto.pad_token == "<|endoftext|>" and auto.bos_token is None
    marked = "<|im_start|>user\nhi<|im_end|>"
    assert auto(marked)["input_ids"][0] == ids["<|im_start|>"] and ids["<|im_end|>"] in auto(marked)["input_ids"]
    assert len(auto("the weather in Paris")["input_ids"]) <= 0.6 * len("the weather in Paris")  # merges learned


def test_chat_template_renders_tools_and_tool_calls(tmp_path):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    template = json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"]
    assert (tmp_path / "chat_template.jinja").read_text() == template
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 18}'},
        {"role": "assistant", "content": "It is 18 C."},
        {"role": "user", "content": "Thanks"},
    ]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    text = env.from_string(template).render(
        messages=messages, tools=tools, add_generation_prompt=True, enable_thinking=False
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = env.from_string(template).render(messages=messages[1:2], add_generation_prompt=True)
    assert plain == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    tk = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert (
        tk.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        == text
    )


def test_generation_config_lists_the_eos_ids(ckpts):
    gen = json.loads((ckpts("bf16") / "generation_config.json").read_text())
    ids = synth_tok.special_token_ids()
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]


# ----------------------------------------------------------- presets, shards, CLI


def test_presets_and_custom_sizes(tmp_path):
    def total(preset, dense=False):
        units = plan_units(target_params(preset, dense), lambda m: "bf16", False, not dense)
        return sum(stored_bytes(u) for u in units)

    assert total(PRESETS["tiny"]) < 5e6
    assert total(PRESETS["bench"]) >= 1.1e9
    custom = Preset(hidden_size=96, num_hidden_layers=8, num_experts=4, vocab_size=640)
    d = write_target(tmp_path / "c", preset=custom, format="modelopt-nvfp4", shards=3)
    tc = json.loads((d / "config.json").read_text())["text_config"]
    assert tc["hidden_size"] == 96 and tc["layer_types"].count("full_attention") == 2
    assert len(list(d.glob("model-*-of-00003.safetensors"))) == 3
    draft = json.loads((write_draft(tmp_path / "cd", d) / "config.json").read_text())
    assert draft["hidden_size"] == 96 and all(0 <= i < 8 for i in draft["target_layer_ids"])
    assert draft_sizes(tc).target_layer_ids == tuple(draft["target_layer_ids"])
    single = write_target(tmp_path / "s", shards=1)
    assert (single / "model.safetensors").exists() and not (single / "model.safetensors.index.json").exists()
    with pytest.raises(ValueError, match="multiple of 32"):
        Preset(hidden_size=48)
    with pytest.raises(ValueError, match="unknown preset"):
        write_target(tmp_path / "u", preset="huge")


def test_ct_mixed_defaults_to_the_dense_model(tmp_path):
    d = write_target(tmp_path / "m", format="compressed-tensors-mixed")
    assert json.loads((d / "config.json").read_text())["model_type"] == "qwen3_5"
    assert len(list(d.glob("*.safetensors"))) == 1


def test_cli_pair_and_errors(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "monolith.synth", *args], check=False, capture_output=True, text=True
        )

    ok = run("pair", "--out", str(tmp_path / "p"), "--format", "modelopt-nvfp4", "--draft-format", "speculators")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == [str(tmp_path / "p" / "target"), str(tmp_path / "p" / "draft")]
    assert json.loads((tmp_path / "p" / "draft" / "config.json").read_text())["speculators_model_type"] == "dspark"
    bad = run("target", "--out", str(tmp_path / "q"), "--format", "gguf")
    assert bad.returncode == 1 and "invalid choice" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    nodir = run("draft", "--out", str(tmp_path / "r"), "--target", str(tmp_path / "missing"))
    assert nodir.returncode == 1 and "no config.json" in nodir.stderr
    target = run("target", "--out", str(tmp_path / "t"), "--dense", "--format", "compressed-tensors", "--seed", "2")
    assert target.returncode == 0 and target.stdout.strip() == str(tmp_path / "t")


def test_write_pair_returns_both_dirs(tmp_path):
    target, draft = write_pair(tmp_path, format="compressed-tensors", draft_format="dflash", seed=1)
    assert target == tmp_path / "target" and draft == tmp_path / "draft"
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == synth_tok.special_token_ids()["<|mask|>"]
    assert json.loads((target / "config.json").read_text())["quantization_config"]["format"] == "nvfp4-pack-quantized"
    with pytest.raises(ValueError, match="seed"):
        write_target(tmp_path / "neg", seed=-1)


def test_streamed_shards_are_the_bytes_write_safetensors_writes_and_safetensors_reads(ckpts, tmp_path):
    """Shards are filled unit by unit at their offsets: the bytes equal write_safetensors'
    of the same tensors, and the safetensors package reads every tensor back."""
    import torch
    from safetensors import safe_open

    from monolith.formats import write_safetensors
    from monolith.synth.writers import ST_METADATA

    for f in sorted(ckpts("modelopt-mixed").glob("*.safetensors")):
        st = SafetensorsFile(f)
        tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
        write_safetensors(tmp_path / f.name, tensors, metadata=ST_METADATA)
        assert (tmp_path / f.name).read_bytes() == f.read_bytes(), f
        with safe_open(f, framework="pt") as ref:
            assert sorted(ref.keys()) == sorted(tensors) and ref.metadata() == ST_METADATA
            for n, (_, bits) in tensors.items():
                t = ref.get_tensor(n)
                assert tuple(t.shape) == bits.shape, n
                assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == bits.tobytes(), n
