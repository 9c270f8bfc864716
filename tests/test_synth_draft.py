"""monolith.synth drafts: DSpark (deepspec, its NVFP4 export, the speculators twin) and
DFlash configs and tensors, derived from the target they draft for."""

from __future__ import annotations

import json

import numpy as np
import pytest
from synth_helpers import assert_modelopt_mirror, bf16, read_all, rel_err

from monolith.formats import dequantize_nvfp4
from monolith.synth import tokenizer as synth_tok
from monolith.synth import write_draft
from monolith.synth.values import as_bf16

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


def test_speculators_full_vocabulary_draft_is_saved_as_speculators_saves_it(drafts, tmp_path):
    """full_vocab: the target's whole vocabulary, in the files speculators' save_pretrained
    writes (its own output: tests/data/speculators/causal-window, a full-vocabulary vanilla
    head): the same tensor names (no lm_head, embed_tokens, d2t or t2d), auto_map, and
    config.py beside config.json, whose code here fails loudly if anything runs it; the
    weights are the DeepSpec twin's."""
    import runpy
    from pathlib import Path

    from monolith.formats import SafetensorsFile

    target, d = drafts
    genuine = Path(__file__).parent / "data" / "speculators" / "causal-window"
    full = write_draft(tmp_path / "full", target, format="speculators", seed=7, full_vocab=True)
    assert sorted(p.name for p in full.iterdir()) == ["config.json", "config.py", "model.safetensors"]
    cfg, want = (json.loads((p / "config.json").read_text()) for p in (full, genuine))
    vocab = json.loads((target / "config.json").read_text())["text_config"]["vocab_size"]
    assert cfg["draft_vocab_size"] == cfg["transformer_layer_config"]["vocab_size"] == vocab
    assert want["draft_vocab_size"] == want["transformer_layer_config"]["vocab_size"]  # what makes it full
    assert cfg["auto_map"] == want["auto_map"] == {"": "config.DSparkSpeculatorConfig"}
    sp, ds = read_all(full), read_all(d["deepspec"])
    assert set(sp) == set(SafetensorsFile(genuine / "model.safetensors").names())
    assert all(np.array_equal(v[2], ds[name][2]) for name, v in sp.items())
    with pytest.raises(SystemExit, match="executed"):
        runpy.run_path(str(full / "config.py"))
    write_draft(full, target, format="speculators", seed=7)  # rewritten reduced: no stale config.py
    assert not (full / "config.py").exists() and "auto_map" not in json.loads((full / "config.json").read_text())
    with pytest.raises(ValueError, match="full_vocab"):
        write_draft(tmp_path / "deepspec", target, format="deepspec", full_vocab=True)


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
