"""What a draft pack takes from its checkpoint and what loading checks: the draft
against the target, the block mask, sample_from_anchor and embedding scale settings
of every layout, and the architecture registry."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from dspark_world import (
    CONTEXT,
    GREEDY,
    SPECULATORS_DATA,
    context_of,
    edit_config,
)

from monolith.checkpoint import open_checkpoint
from monolith.engine_setup import load_target
from monolith.models import DraftError, load_draft
from monolith.models.draft_args import DraftArgs
from monolith.pack import PackError, build_pack
from monolith.synth import Preset, write_target

# ------------------------------------------------------------------ load-time checks


def _target(world, name, preset):
    root = world["root"]
    target_dir = root / f"target-{name}"
    if not target_dir.exists():
        write_target(target_dir, preset=preset, format="bf16", seed=0)
    return load_target(target_dir, "float32", cache_dir=root / "cache")


@pytest.mark.parametrize("case, preset, draft_name, field", [
    ("shallow", Preset(num_hidden_layers=2, full_attention_interval=2), "deepspec-bf16", "target_layer_ids"),
    ("shallow", Preset(num_hidden_layers=2, full_attention_interval=2), "twin-speculators",
     "aux_hidden_state_layer_ids"),
    ("wide", Preset(hidden_size=96), "deepspec-bf16", "hidden_size"),
    ("vocab640", Preset(vocab_size=640), "deepspec-bf16", "embed_tokens"),
    ("vocab640", Preset(vocab_size=640), "twin-speculators", "markov_head.markov_w1"),
    ("vocab448", Preset(vocab_size=448), "speculators-460", "d2t"),
    ("vocab448", Preset(vocab_size=448), "dflash-nvfp4", None),  # binds the target's: fits any vocabulary
])
def test_load_draft_checks_the_draft_against_the_target(world, case, preset, draft_name, field):
    _, pack = world["draft"](draft_name)
    target = _target(world, case, preset)
    if field is None:
        assert load_draft(pack, target, "float32").draft_vocab == 448
        return
    with pytest.raises(DraftError, match=field.replace(".", r"\.")):
        load_draft(pack, target, "float32")


def test_reduced_vocabulary_without_d2t_and_missing_settings(world, tmp_path):
    _, pack = world["draft"]("twin-speculators")
    broken = tmp_path / "no-d2t"
    shutil.copytree(pack, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    del manifest["entries"]["d2t"]
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DraftError, match=r"draft_vocab_size 256 is not the target vocabulary \(512\).*no d2t"):
        load_draft(broken, world["target"], "float32", verify="never")  # an edited manifest: past verification
    settings = manifest["layout"]["draft"]
    config = json.loads((broken / "config.json").read_text())
    for field in ("mask_token_id", "block_size"):
        with pytest.raises(DraftError, match=field):
            DraftArgs.from_pack(config, {**settings, field: None}, "dspark-speculators", "config.json")


def test_draft_vocab_size_neither_the_targets_nor_a_d2t_is_refused(world, tmp_path):
    """A draft_vocab_size is the target's vocabulary (full) or the length of d2t (reduced):
    a full-vocabulary draft on a target of another vocabulary is refused on load, and a
    checkpoint whose draft_vocab_size is not its own vocab_size and has no d2t when
    packed, each naming draft_vocab_size."""
    _, pack = world["draft"]("speculators-full")
    with pytest.raises(DraftError, match=r"draft_vocab_size 512 is not the target vocabulary \(640\).*no d2t"):
        load_draft(pack, _target(world, "vocab640", Preset(vocab_size=640)), "float32")
    odd = tmp_path / "odd"
    shutil.copytree(world["root"] / "speculators-full", odd)
    edit_config(odd, {"draft_vocab_size": 500})
    with pytest.raises(PackError, match=r"draft_vocab_size 500 is not the draft's vocab_size \(512\).*no d2t"):
        build_pack(odd, tmp_path / "odd.pack", role="draft", quantization="none")


# ------------------------------------------------------------------ what the pack reads from a draft's config


def settings_of(src, tmp_path, edits=None, drop=()):
    """draft_settings of a copy of the checkpoint `src` with config.json fields set
    (edit_config) and top-level fields dropped."""
    from monolith.pack.draft_recipe import draft_settings

    out = tmp_path / f"edited-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(src, out)
    edit_config(out, edits or {})
    config = json.loads((out / "config.json").read_text())
    for key in drop:
        del config[key]
    (out / "config.json").write_text(json.dumps(config))
    return draft_settings(open_checkpoint(out))


SLIDING_FULL = {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True,
                "sliding_window": 8}


@pytest.mark.parametrize("source, edits, drop, windows, causal", [
    # speculators: non_causal = sliding_window is None or sliding_window_non_causal, per layer
    ("causal-window", {}, (), [6, None], [True, False]),
    ("causal-window", {}, ("sliding_window_non_causal",), [6, None], [True, False]),  # its default: false
    ("causal-window", {"sliding_window_non_causal": True}, (), [6, None], [False, False]),
    ("causal-window", {"transformer_layer_config": {"use_sliding_window": False}}, (), [None, None], [False, False]),
    ("causal-window", {"is_causal": True}, (), "is_causal", None),
    ("causal-window", {"dflash_config": {"causal": True}}, (), "dflash_config", None),
    ("causal-window", {"sliding_window_non_causal": "no"}, (), "sliding_window_non_causal", None),
    # elsewhere (vLLM's _dflash_layer_causal): is_causal, else dflash_config.causal, else the sliding layers
    ("dflash", {}, (), [None, None], [False, False]),
    ("dflash", SLIDING_FULL, (), [8, None], [True, False]),
    ("dflash", {**SLIDING_FULL, "dflash_config": {"causal": False}}, (), [8, None], [False, False]),
    ("dflash", {**SLIDING_FULL, "dflash_config": {"causal": False}, "is_causal": True}, (), [8, None], [True, True]),
    ("dflash", {"dflash_config": {"causal": True}}, (), [None, None], [True, True]),
    ("dflash", {"sliding_window_non_causal": False}, (), "sliding_window_non_causal", None),
    ("dflash", {**SLIDING_FULL, "use_sliding_window": False}, (), "without a window", None),
    ("dflash", {"layer_types": ["full_attention"]}, (), "layer_types", None),
    ("dflash", {"dflash_config": {"causal": 1}}, (), "dflash_config.causal", None),
    ("dflash", {"dflash_config": {"use_swa": True}}, (), "dflash_config.use_swa", None),
    ("dflash", {"dflash_config": {"swa_window_size": 8}}, (), "dflash_config.swa_window_size", None),
    ("dflash", {"dflash_config": {"use_aux_hidden_state": False}}, (), "use_aux_hidden_state", None),
])
def test_block_mask_settings(world, tmp_path, source, edits, drop, windows, causal):
    """Per layer, the window and whether the block is causal, as speculators' mask
    function (speculators drafts) or vLLM's DFlash loader (the others) reads them; a
    field that would change the mask in one of them and is not read is refused."""
    if source == "dflash":
        world["draft"]("dflash-nvfp4")
        src = world["root"] / "dflash-nvfp4"
    else:
        src = SPECULATORS_DATA / source
    if causal is None:
        with pytest.raises(PackError, match=windows):
            settings_of(src, tmp_path, edits, drop)
        return
    settings = settings_of(src, tmp_path, edits, drop)
    assert (settings["sliding_windows"], settings["block_causal"]) == (windows, causal)


@pytest.mark.parametrize("source, edits, drop, want", [
    ("bonus-anchor", {}, (), False),
    # speculators_config: block_size 5 - speculative_tokens 4 = 1, the anchor is the bonus token
    ("bonus-anchor", {}, ("sample_from_anchor",), False),
    ("causal-window", {}, ("sample_from_anchor",), True),
    ("bonus-anchor", {"sample_from_anchor": True}, (),
     "sample_from_anchor True and block_size 5 - speculative_tokens 4"),
    ("bonus-anchor", {}, ("sample_from_anchor", "speculators_config"), "neither sample_from_anchor nor"),
    ("bonus-anchor", {"speculators_config": {"proposal_methods": [{"proposal_type": "greedy",
                                                                   "speculative_tokens": 2}]}}, (), "differ by"),
    ("bonus-anchor", {"speculators_config": {"default_proposal_method": "tree"}}, (), "default_proposal_method"),
    ("dflash", {}, (), False),
    ("dflash", {"dflash_config": {"sample_from_anchor": True}}, (), True),
    ("dflash", {"dspark_bonus_anchor": False}, (), True),
    ("dflash", {"dspark_bonus_anchor": True, "sample_from_anchor": True}, (), "contradict"),
    ("deepspec", {}, (), True),
    ("deepspec", {"dspark_bonus_anchor": True}, (), False),
])
def test_sample_from_anchor_settings(world, tmp_path, source, edits, drop, want):
    """Whether slot 0 predicts: every field that states it must agree (a speculators
    draft's block_size minus its default proposal method's speculative_tokens among
    them); unstated, DeepSpec's convention is true and DFlash's false, and a speculators
    draft must state it (speculators reads a missing field as true, vLLM as false)."""
    if source in ("dflash", "deepspec"):
        name = "dflash-nvfp4" if source == "dflash" else "deepspec-bf16"
        world["draft"](name)
        src = world["root"] / name
    else:
        src = SPECULATORS_DATA / source
    if isinstance(want, str):
        with pytest.raises(PackError, match=want):
            settings_of(src, tmp_path, edits, drop)
        return
    assert settings_of(src, tmp_path, edits, drop)["sample_from_anchor"] is want


def test_input_embedding_scale_settings(world, tmp_path):
    world["draft"]("dflash-nvfp4")
    src = world["root"] / "dflash-nvfp4"
    assert settings_of(src, tmp_path)["input_embedding_scale"] == 1.0
    assert settings_of(src, tmp_path, {"dflash_config": {"input_embedding_scale": 0.5}})["input_embedding_scale"] == 0.5
    for bad in (0, -1.0, float("nan"), "2", True):
        with pytest.raises(PackError, match="input_embedding_scale"):
            settings_of(src, tmp_path, {"dflash_config": {"input_embedding_scale": bad}})


def test_dflash_labelled_draft_with_markov_heads_runs_them(world, tmp_path):
    """A DSpark head whose config says DFlashDraftModel / dflash_config and omits the
    Markov fields (as a Qwen3.6-27B head does) gets its heads from its tensors: it
    proposes exactly what the same weights as a DeepSpec draft propose."""
    deep, _ = world["draft"]("deepspec-bf16")
    src = world["root"] / "deepspec-bf16"
    config = json.loads((src / "config.json").read_text())
    relabelled = tmp_path / "relabelled"
    shutil.copytree(src, relabelled)
    for key in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                "block_size", "mask_token_id", "target_layer_ids"):
        del config[key]
    config |= {"architectures": ["DFlashDraftModel"],
               "dflash_config": {"block_size": deep.block_size, "mask_token_id": deep.args.mask_token_id,
                                 "target_layer_ids": deep.taps, "sample_from_anchor": True}}
    (relabelled / "config.json").write_text(json.dumps(config))
    pack = build_pack(relabelled, tmp_path / "pack", role="draft", quantization="none")
    draft = load_draft(pack, world["target"], "float32")
    assert draft.args.architecture == "dflash" and draft.args.markov_rank == deep.args.markov_rank
    assert draft.args.confidence_head and draft.args.confidence_with_markov
    feats, anchor = world["features"](draft.taps), world["tokens"][CONTEXT]
    a = draft.propose(context_of(draft, feats), anchor, draft.max_proposals, GREEDY)
    b = deep.propose(context_of(deep, feats), anchor, deep.max_proposals, GREEDY)
    assert np.array_equal(np.array(a.tokens), np.array(b.tokens))
    assert np.array_equal(np.array(a.confidence), np.array(b.confidence))
    # unstated, sample_from_anchor follows the tensors too: a DSpark head predicts from every slot
    del config["dflash_config"]["sample_from_anchor"]
    (relabelled / "config.json").write_text(json.dumps(config))
    assert settings_of(relabelled, tmp_path)["sample_from_anchor"] is True
    # the heads' fields, when stated, must agree with the tensors
    for edits, field in (({"markov_rank": 0}, "markov_rank 0"), ({"markov_rank": 4}, "markov_rank 4"),
                         ({"markov_head_type": "gated"}, "markov_head.gate_proj"),
                         ({"enable_confidence_head": False}, "enable_confidence_head"),
                         ({"confidence_head_with_markov": False}, "confidence_head_with_markov")):
        with pytest.raises(PackError, match=field):
            settings_of(relabelled, tmp_path, {"dflash_config": edits})


def test_detect_architecture_names_the_layout():
    from monolith.checkpoint.config import detect_architecture

    assert detect_architecture({"model_type": "qwen3", "dspark_config": {"block_size": 7}}, "c") == "dspark"
    assert detect_architecture({"architectures": ["Qwen3DSparkModel"], "dflash_config": {}}, "c") == "dspark"
    assert detect_architecture({"architectures": ["DFlashDraftModel"], "dflash_config": {"markov_rank": 8}},
                               "c") == "dflash"
    assert detect_architecture({"architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark"},
                               "c") == "dspark-speculators"


def test_every_architecture_has_one_model_and_every_draft_one_pack_format():
    """The architecture names live in monolith.checkpoint.config alone: the models'
    registry covers each of them, the draft formats' registry each draft, nothing else."""
    from monolith.checkpoint.config import ARCHITECTURE_ROLES
    from monolith.models import MODELS, Draft
    from monolith.pack.draft_formats import DRAFT_FORMATS

    drafts = {name for name, role in ARCHITECTURE_ROLES.items() if role == "draft"}
    assert set(MODELS) == set(ARCHITECTURE_ROLES) and drafts
    assert {name for name, (model, _) in MODELS.items() if model is Draft} == drafts
    assert set(DRAFT_FORMATS) == drafts
