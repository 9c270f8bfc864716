"""monolith.synth targets: deterministic bytes, configs transformers accepts, the real
weight names, shapes and value conventions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from synth_helpers import bf16, read_all

from monolith.synth import PRESETS, write_draft, write_target
from monolith.synth import tokenizer as synth_tok


def files_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}



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
