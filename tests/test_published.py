"""monolith.synth.published: each published repository's exact file set (names, index,
tensor names, dtypes, config nesting), at tiny widths and as full-size header-only
skeletons; and at tiny widths every layout packs, loads and generates, and greedy
speculative decoding equals plain decoding for every published draft layout.

Independent references: transformers' Qwen3.6 config defaults (the 35B-A3B and its
vision tower), compressed-tensors' own target matching, the published file and tensor
counts and sizes (issue 13, the model pages), and speculative == plain."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from oracles import PROMPT, assert_same_greedy
from synth_helpers import assert_modelopt_mirror

from monolith.formats import SafetensorsFile, bf16_bits_to_f32, dequantize_fp8
from monolith.synth.presets import PRESETS
from monolith.synth.published import (
    DRAFT_LAYOUTS,
    TARGET_LAYOUTS,
    layout_preset,
    write_published_draft,
    write_published_target,
)
from monolith.synth.values import Param, generate

LM = "model.language_model"
TOKENIZER = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
TARGET_FILES = {
    "nvidia-35b": {
        "config.json",
        "generation_config.json",
        "hf_quant_config.json",
        "model.safetensors.index.json",
        *(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)),
        "preprocessor_config.json",  # the image processor's settings (synth writes them for its tower)
        *TOKENIZER,
    },
    "unsloth-27b": {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "model_mtp.safetensors",
        *(f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)),
        "preprocessor_config.json",
        *TOKENIZER,
    },
}
DRAFT_FILES = {
    "koopah-dspark": {"config.json", "model.safetensors", *TOKENIZER},
    "lithos-dspark": {
        "config.json",
        "model-00001.safetensors",
        "model-00002.safetensors",
        "model.safetensors.index.json",
        *TOKENIZER,
    },
    "redhat-dspark": {"config.json", "model.safetensors"},
    "zlab-dflash": {"config.json", "model.safetensors"},
    "speculators-27b": {"config.json", "model.safetensors"},
}
ITEMSIZE = {"BF16": 2, "U8": 1, "F8_E4M3": 1, "F32": 4, "I64": 8, "BOOL": 1}


@functools.cache
def tensors(d: Path) -> dict[str, tuple[str, str, tuple]]:
    """name -> (file, dtype, shape) over every safetensors file of a checkpoint (the
    checkpoints a module writes do not change)."""
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        st = SafetensorsFile(f)
        for n in st.names():
            assert n not in out, f"{n} in two files"
            out[n] = (f.name, st.dtype(n), st.shape(n))
    return out


def read(d: Path, name: str) -> np.ndarray:
    return np.array(SafetensorsFile(Path(d) / tensors(d)[name][0]).read(name))


def config(d: Path) -> dict:
    return json.loads((Path(d) / "config.json").read_text())


def write_all(root: Path, preset="tiny", skeleton=False, seed=0) -> dict[str, Path]:
    out = {t: write_published_target(root / t, t, preset, seed=seed, skeleton=skeleton) for t in TARGET_LAYOUTS}
    for name, d in DRAFT_LAYOUTS.items():
        out[name] = write_published_draft(root / name, name, out[d.target], seed=seed, skeleton=skeleton)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("published"))


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Every layout at its published widths and depth, header-only."""
    return write_all(tmp_path_factory.mktemp("skeletons"), preset="full", skeleton=True)


# ---------------------------------------------------------------- the file sets


@pytest.mark.parametrize("layout", [*TARGET_FILES, *DRAFT_FILES])
def test_each_layout_writes_its_exact_file_set_and_a_consistent_index(tiny, full, layout):
    expected = {**TARGET_FILES, **DRAFT_FILES}[layout]
    for d in (tiny[layout], full[layout]):
        assert {p.name for p in d.iterdir()} == expected
        got = tensors(d)
        index = d / "model.safetensors.index.json"
        if index.exists():
            data = json.loads(index.read_text())
            assert data["weight_map"] == {n: v[0] for n, v in got.items()}
            assert data["metadata"]["total_size"] == sum(ITEMSIZE[t] * math.prod(s) for _, t, s in got.values())


def test_nvidia_35b_tensors_and_configs(tiny):
    d = tiny["nvidia-35b"]
    p = layout_preset("nvidia-35b")
    cfg, hf = config(d), json.loads((d / "hf_quant_config.json").read_text())
    tc = cfg["text_config"]
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and "hidden_size" not in cfg
    assert tc["layer_types"] == ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(4)]
    assert tc["full_attention_interval"] == 4 and tc["mtp_num_hidden_layers"] == 1
    generation = json.loads((d / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tc["eos_token_id"], tc["bos_token_id"]]  # [im_end, endoftext]
    q = hf["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION" and q["kv_cache_quant_algo"] == "FP8"
    assert_modelopt_mirror(cfg["quantization_config"], hf)
    assert "kv_cache_quant_algo" not in json.dumps(cfg)  # only in hf_quant_config.json
    assert {e["quant_algo"] for e in q["quantized_layers"].values()} == {"NVFP4", "FP8"}
    assert f"{LM}.layers.0.mlp.experts" in q["quantized_layers"]  # experts listed by container

    t = tensors(d)
    visual = {n: v for n, v in t.items() if n.startswith("model.visual.")}
    assert len(visual) == 27 * 12 + 3 + 6 == 333 and {v[1] for v in visual.values()} == {"BF16"}
    mtp = {n: v for n, v in t.items() if n.startswith("mtp.")}
    assert {v[1] for v in mtp.values()} == {"BF16"} and not any(".experts.0." in n for n in mtp)
    e, i, h = p.num_experts, p.moe_intermediate_size, p.hidden_size
    assert mtp["mtp.layers.0.mlp.experts.gate_up_proj"][1:] == ("BF16", (e, 2 * i, h))
    assert mtp["mtp.layers.0.mlp.experts.down_proj"][1:] == ("BF16", (e, h, i))
    for layer in range(p.num_hidden_layers):
        ex = f"{LM}.layers.{layer}.mlp.experts"
        assert f"{ex}.gate_up_proj" not in t
        for j in range(e):  # per expert: U8 codes, E4M3 scales, F32 scalars
            m = f"{ex}.{j}.down_proj"
            assert [t[f"{m}.{s}"][1:] for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")] == [
                ("U8", (h, i // 2)), ("F8_E4M3", (h, i // 16)), ("F32", ()), ("F32", ())]
    assert t["lm_head.input_scale"][1:] == ("F32", ()) and t["lm_head.weight"][1] == "U8"
    assert t[f"{LM}.layers.0.mlp.shared_expert.up_proj.weight"][1] == "U8"
    for m in (f"{LM}.layers.0.linear_attn.in_proj_qkv", f"{LM}.layers.3.self_attn.o_proj"):
        assert t[f"{m}.weight"][1] == "F8_E4M3"
        assert t[f"{m}.weight_scale"][1:] == t[f"{m}.input_scale"][1:] == ("F32", ())
    assert t[f"{LM}.layers.0.linear_attn.in_proj_a.weight"][1] == "BF16"
    assert t[f"{LM}.layers.3.self_attn.k_proj.k_scale"][1:] == ("F32", ())
    assert t[f"{LM}.layers.3.self_attn.v_proj.v_scale"][1:] == ("F32", ())


def test_unsloth_27b_tensors_and_the_rules_compressed_tensors_applies(tiny):
    """Every module's stored scheme is the one compressed-tensors' own matcher picks
    from the config; the MTP layer is the exception (BF16, in model_mtp.safetensors,
    although the config's rules match it: issue 13 item 1)."""
    from compressed_tensors.quantization import QuantizationConfig

    d = tiny["unsloth-27b"]
    p = layout_preset("unsloth-27b")
    cfg = config(d)
    qc = cfg["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.format == "mixed-precision" and parsed.kv_cache_scheme.num_bits == 8
    assert not (d / "hf_quant_config.json").exists()
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "intermediate_size" in cfg["text_config"]
    t = tensors(d)
    mtp = {n: v for n, v in t.items() if v[0] == "model_mtp.safetensors"}
    assert len(mtp) == 15 and all(n.startswith("mtp.") for n in mtp) and {v[1] for v in mtp.values()} == {"BF16"}
    assert not any(n.startswith("mtp.") for n, v in t.items() if v[0] != "model_mtp.safetensors")
    assert sum(n.startswith("model.visual.") and v[1] == "BF16" for n, v in t.items()) == 333

    seen = _checked_schemes(t, qc)
    last = p.num_hidden_layers - 1
    for m in ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj", "mlp.down_proj"):
        assert seen[f"{LM}.layers.0.{m}"] == ("nvfp4-pack-quantized" if m.startswith("mlp") else "float-quantized")
    assert seen[f"{LM}.layers.{last}.mlp.gate_proj"] == "float-quantized"  # the last eighth of the layers
    assert seen[f"{LM}.layers.{last}.self_attn.q_proj"] == seen["lm_head"] == "float-quantized"
    assert seen[f"{LM}.layers.0.linear_attn.in_proj_b"] is None
    # the MTP layer is BF16 although the NVFP4 and FP8 rules match its names
    assert seen["mtp.layers.0.mlp.gate_proj"] == "nvfp4-pack-quantized"
    assert seen["mtp.layers.0.self_attn.q_proj"] == "float-quantized" and seen["mtp.fc"] is None
    assert t[f"{LM}.layers.{last}.self_attn.k_scale"][1:] == ("BF16", (1,))
    assert t[f"{LM}.layers.{last}.self_attn.v_scale"][1:] == ("BF16", (1,))
    # the FP8 codes were made with the BF16-rounded scale they are stored with
    m = f"{LM}.layers.0.linear_attn.out_proj"
    scale = bf16_bits_to_f32(read(d, f"{m}.weight_scale"))
    ref = generate(0, Param(f"{m}.weight", t[f"{m}.weight"][2], "linear"))
    deq = dequantize_fp8(read(d, f"{m}.weight"), scale)
    assert np.abs(deq / scale).max() <= 448 and np.abs(deq - ref).max() <= np.abs(ref).max() / 16


def _checked_schemes(t: dict, qc: dict) -> dict:
    """Check every 2-D module's stored tensors against the scheme compressed-tensors' own
    matcher picks from `qc` (MTP modules: BF16 whatever matches); returns module -> the
    matched group's format (None: not quantized)."""
    import torch
    from compressed_tensors.utils.match import match_name, match_targets

    linear = torch.nn.Linear(1, 1)
    target_to_group = {tgt: g for g, group in qc["config_groups"].items() for tgt in group["targets"]}
    seen = {}
    for name in sorted(n for n in t if n.endswith((".weight", ".weight_packed")) and len(t[n][2]) == 2):
        module = name.rsplit(".", 1)[0]
        if "embed" in module:
            continue
        ignored = any(match_name(module, entry) for entry in qc["ignore"])
        matched = [] if ignored else match_targets(module, linear, list(target_to_group))
        group = qc["config_groups"][target_to_group[matched[0]]] if matched else None
        kind = None if group is None else group["format"]
        if module.startswith("mtp."):
            assert t[f"{module}.weight"][1] == "BF16", module
            seen[module] = kind
            continue
        seen[module] = kind
        n, k = (t[name][2][0], t[name][2][1] * (2 if name.endswith("_packed") else 1))
        if kind == "nvfp4-pack-quantized":
            assert [t[f"{module}.{s}"][1:] for s in
                    ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")] == [
                ("U8", (n, k // 2)), ("F8_E4M3", (n, k // 16)), ("F32", (1,)), ("F32", (1,))], module
        elif kind == "float-quantized":
            assert group["weights"]["strategy"] == "channel"
            assert t[f"{module}.weight"][1:] == ("F8_E4M3", (n, k)), module
            assert t[f"{module}.weight_scale"][1:] == ("BF16", (n, 1)), module
        else:
            assert t[f"{module}.weight"][1] == "BF16", module
    return seen


def test_draft_layouts(tiny):
    t35 = config(tiny["nvidia-35b"])["text_config"]
    taps = [0, 1, 2, 3]  # the published taps spread over the tiny target's 4 layers
    koopah, lithos = config(tiny["koopah-dspark"]), config(tiny["lithos-dspark"])
    for c in (koopah, lithos):
        assert c["architectures"] == ["Qwen3DSparkModel"] and c["model_type"] == "qwen3" and c["num_anchors"] == 512
        assert c["num_hidden_layers"] == 6 and c["block_size"] == 8 and c["target_layer_ids"] == taps
        assert c["rope_theta"] == 1e7 and not {"partial_rotary_factor", "mrope_section", "mrope_interleaved"} & set(c)
    assert {v[1] for v in tensors(tiny["koopah-dspark"]).values()} == {"BF16"}
    lt = tensors(tiny["lithos-dspark"])
    assert lithos["lithos_quantization"] == {"block_size": 16, "format": "nvfp4", "keep": ["markov_w1"]}
    assert "quantization_config" not in lithos and not (tiny["lithos-dspark"] / "hf_quant_config.json").exists()
    assert sum(v[1] == "U8" for v in lt.values()) == 46  # embedding, fc, 6 x 7 layer matrices, lm_head, W2
    assert lt["markov_head.markov_w1.weight"][1] == "BF16" and lt["embed_tokens.weight"][1] == "U8"

    red = config(tiny["redhat-dspark"])
    assert red["speculators_model_type"] == "dspark" and red["aux_hidden_state_layer_ids"] == [1, 2, 3, 4]
    layer = red["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention"] * 5 and red["sliding_window_non_causal"] is False
    rt = tensors(tiny["redhat-dspark"])
    assert rt["d2t"][1:] == ("I64", (red["draft_vocab_size"],)) and rt["t2d"][1:] == ("BOOL", (t35["vocab_size"],))

    z = config(tiny["zlab-dflash"])
    assert z["architectures"] == ["DFlashDraftModel"] and z["dflash_config"]["target_layer_ids"] == taps
    assert z["layer_types"] == ["full_attention"] * 8 and z["block_size"] == z["dflash_config"]["block_size"] == 16
    assert not {"embed_tokens.weight", "lm_head.weight"} & set(tensors(tiny["zlab-dflash"]))

    s27 = config(tiny["speculators-27b"])
    vocab = config(tiny["unsloth-27b"])["text_config"]["vocab_size"]
    # a full vocabulary, saved as speculators saves it (tests/data/speculators/causal-window): no lm_head, d2t, t2d
    assert s27["draft_vocab_size"] == vocab
    assert not {"lm_head.weight", "d2t", "t2d"} & set(tensors(tiny["speculators-27b"]))
    assert s27["block_size"] == 16 and s27["transformer_layer_config"]["num_hidden_layers"] == 5


# ---------------------------------------------------------- full-size skeletons


def test_full_size_configs_are_the_published_ones(full):
    import transformers

    tc = config(full["nvidia-35b"])["text_config"]
    reference = transformers.Qwen3_5MoeTextConfig()  # its defaults are Qwen3.6-35B-A3B's
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "vocab_size", "layer_types"):
        assert tc[key] == getattr(reference, key), key
    assert tc["rope_parameters"]["mrope_section"] == [11, 11, 10] and tc["rope_parameters"]["rope_theta"] == 1e7
    vision = transformers.Qwen3_5MoeVisionConfig()
    vc = config(full["nvidia-35b"])["vision_config"]
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "num_position_embeddings"):
        assert vc[key] == getattr(vision, key), key
    t27 = config(full["unsloth-27b"])["text_config"]
    assert (t27["hidden_size"], t27["num_hidden_layers"], t27["intermediate_size"]) == (5120, 64, 17408)
    assert t27["layer_types"].count("full_attention") == 16
    assert (t27["num_attention_heads"], t27["num_key_value_heads"], t27["linear_num_value_heads"]) == (24, 4, 48)
    layers_fp8 = [t for t in config(full["unsloth-27b"])["quantization_config"]["config_groups"]["group_1"]["targets"]
                  if ".mlp." in t]
    assert sorted({int(t.split(".")[3]) for t in layers_fp8}) == list(range(56, 64))

    k = config(full["koopah-dspark"])
    assert k["target_layer_ids"] == [1, 6, 11, 16, 22, 27, 32, 37] and k["markov_rank"] == 256
    heads = (k["num_attention_heads"], k["num_key_value_heads"], k["head_dim"], k["intermediate_size"])
    assert heads == (32, 8, 128, 6144)
    kt = tensors(full["koopah-dspark"])
    assert kt["fc.weight"][2] == (2048, 16384) and kt["confidence_head.proj.weight"][2] == (1, 2304)
    assert kt["lm_head.weight"][2] == kt["embed_tokens.weight"][2] == (248320, 2048)
    r = config(full["redhat-dspark"])
    assert r["aux_hidden_state_layer_ids"] == [2, 10, 20, 30, 37] and r["mask_token_id"] == 248077
    assert r["draft_vocab_size"] == 32000 and r["transformer_layer_config"]["sliding_window"] == 2048
    assert tensors(full["redhat-dspark"])["d2t"][2] == (32000,)
    z = config(full["zlab-dflash"])
    assert z["dflash_config"]["mask_token_id"] == 248070
    assert z["dflash_config"]["target_layer_ids"] == [1, 10, 19, 28, 37]
    assert config(full["speculators-27b"])["aux_hidden_state_layer_ids"] == [2, 17, 32, 47, 62]
    t = tensors(full["nvidia-35b"])
    assert t["mtp.layers.0.mlp.experts.gate_up_proj"][1:] == ("BF16", (256, 1024, 2048))
    assert sum(n.startswith("model.visual.") for n in t) == 333


# published sizes: nvidia's page (23.4 GB of safetensors; config.json 58.1 kB, hf_quant_config.json
# 35.1 kB), LithosAI's 952 MB, Koopah's about 3.1 GB
PUBLISHED_BYTES = {"nvidia-35b": 23.4e9, "lithos-dspark": 952e6, "koopah-dspark": 3.1e9}


def test_skeleton_sizes_are_the_real_sizes_computed_from_shapes(full):
    for layout, d in full.items():
        total = 0
        for f in sorted(d.glob("*.safetensors")):
            with open(f, "rb") as fh:
                header = 8 + int.from_bytes(fh.read(8), "little")
            data = sum(ITEMSIZE[t] * math.prod(shape) for file, t, shape in tensors(d).values() if file == f.name)
            assert f.stat().st_size == header + data, f
            assert f.stat().st_blocks * 512 <= header + (1 << 20), f"{f} is not sparse"
            total += data
        if layout in PUBLISHED_BYTES:
            assert abs(total / PUBLISHED_BYTES[layout] - 1) < 0.02, (layout, total)
    n = full["nvidia-35b"]
    assert abs((n / "config.json").stat().st_size / 58.1e3 - 1) < 0.1
    assert abs((n / "hf_quant_config.json").stat().st_size / 35.1e3 - 1) < 0.1


def test_a_tiny_skeleton_has_the_real_files_headers_and_sizes(tiny, tmp_path):
    skeletons = write_all(tmp_path, skeleton=True)
    for layout, d in tiny.items():
        for f in sorted(d.iterdir()):
            s = skeletons[layout] / f.name
            if f.suffix != ".safetensors":
                assert s.read_bytes() == f.read_bytes(), s
                continue
            real = f.read_bytes()
            header = 8 + int.from_bytes(real[:8], "little")
            assert s.stat().st_size == len(real) and s.read_bytes()[:header] == real[:header], s


def test_same_seed_same_bytes(tiny, tmp_path):
    again = write_all(tmp_path / "again")
    other = write_published_target(tmp_path / "seed1", "unsloth-27b", seed=1)
    for layout, d in tiny.items():
        files = {f.name: f.read_bytes() for f in d.iterdir()}
        assert files == {f.name: f.read_bytes() for f in again[layout].iterdir()}
    mtp = "model_mtp.safetensors"
    assert (other / mtp).read_bytes() != (tiny["unsloth-27b"] / mtp).read_bytes()


def test_bad_layout_arguments_are_refused_by_name(tiny, tmp_path):
    from monolith.synth import Preset

    with pytest.raises(ValueError, match="unknown target layout 'gguf'"):
        write_published_target(tmp_path / "a", "gguf")
    with pytest.raises(ValueError, match="unknown draft layout 'eagle'"):
        write_published_draft(tmp_path / "b", "eagle", tiny["nvidia-35b"])
    with pytest.raises(ValueError, match="vocab_size 64"):
        write_published_target(tmp_path / "c", "nvidia-35b", Preset(vocab_size=64))
    with pytest.raises(ValueError, match="fits a unsloth-27b target"):
        write_published_draft(tmp_path / "d", "speculators-27b", tiny["nvidia-35b"])


# ------------------------------------------------ pack, load, generate, speculate


@pytest.fixture(scope="module")
def packs(tiny, tmp_path_factory):
    """packs(layout) -> the target pack, built on first use (a failure is raised to
    each test that needs it)."""
    from monolith.pack import build_pack

    root = tmp_path_factory.mktemp("packs")
    built = {}

    def get(layout):
        if layout not in built:
            built[layout] = build_pack(tiny[layout], root / layout, role="target")
        return built[layout]

    return get


@pytest.mark.parametrize("layout", list(TARGET_LAYOUTS))
def test_each_target_layout_packs_loads_and_generates(packs, layout):
    from decoding import plain as run

    from monolith.models import load_model
    from monolith.sampling import SamplingParams

    model = load_model(packs(layout), dtype="float32")
    out = run(model, PROMPT, 12, SamplingParams(), [], 64).token_ids
    assert len(out) == 12 and all(0 <= t < PRESETS["tiny"].vocab_size for t in out)


@pytest.mark.parametrize("layout", list(DRAFT_LAYOUTS))
def test_each_draft_layout_speculative_equals_plain(tiny, packs, layout, monkeypatch, tmp_path):
    from decoding import plain as run
    from decoding import speculate

    from monolith.engine_setup import load_drafter
    from monolith.models import load_model
    from monolith.sampling import SamplingParams

    monkeypatch.setenv("MONOLITH_CACHE", str(tmp_path / "cache"))
    model = load_model(packs(DRAFT_LAYOUTS[layout].target), dtype="float32")
    drafter = load_drafter(tiny[layout], model, dtype="float32")
    plain = run(model, PROMPT, 24, SamplingParams(), [], 128).token_ids
    spec = speculate(model, drafter, PROMPT, 24, SamplingParams(), [], 128, prefill_chunk_size=4)
    assert spec.speculative.rounds >= 1
    assert_same_greedy(model, PROMPT, spec.token_ids, plain)
