"""The vision tower on MLX (monolith/models/vision.py) against transformers'
Qwen3_5VisionModel / Qwen3_5MoeVisionModel in float32, on the synthetic checkpoint's
`model.visual.*` tensors loaded into both (docs/target.md, "Vision tower")."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from numeric import rel

from monolith.checkpoint import CheckpointError, open_checkpoint
from monolith.models.vision import load_vision_tower

# two images of different grids in one call (4 x 4 learned positions: one grid is
# smaller than the table along rows, both larger along columns), and a two-frame entry
GRIDS = [(1, 2, 6), (1, 8, 4), (2, 2, 2)]
TOLERANCE = 1e-5  # max |ours - ref| / max |ref|, float32
MEASURED: dict[str, str] = {}  # printed after the module (pytest -s)


def reference_model(ckpt, dense: bool):
    if dense:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig as Config
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel as Model
    else:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig as Config
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel as Model
    fields = {k: v for k, v in ckpt.config["vision_config"].items() if k != "model_type"}
    model = Model._from_config(Config(**fields), attn_implementation="eager", dtype=torch.float32).eval()
    prefix = "model.visual."
    state = {n[len(prefix):]: torch.from_numpy(ckpt.read_float(n).copy())
             for n in ckpt.tensor_names() if n.startswith(prefix)}
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "moe"])
def test_vision_tower_matches_transformers(synth_dir, dense):
    ckpt = open_checkpoint(synth_dir("target", "bf16", dense=dense))
    ref_model = reference_model(ckpt, dense)
    ours = load_vision_tower(ckpt)
    assert ckpt.config["vision_config"]["model_type"] == ("qwen3_5_vision" if dense else "qwen3_5_moe_vision")

    n = sum(t * h * w for t, h, w in GRIDS)
    patches = np.random.default_rng(0).standard_normal((n, ours.args.patch_dim), dtype=np.float32)
    captured = {}
    hook = ref_model.patch_embed.register_forward_hook(lambda m, i, o: captured.setdefault("embeds", o))
    with torch.no_grad():
        ref = ref_model(torch.from_numpy(patches), grid_thw=torch.tensor(GRIDS))
    hook.remove()
    out = ours.forward(patches, GRIDS)
    mx.eval(out)

    pairs = {
        "patch_embeds": (out.patch_embeds, captured["embeds"]),
        "hidden": (out.hidden, ref.last_hidden_state),
        "merged": (out.merged, ref.pooler_output),
    }
    assert out.merged.shape == (n // 4, ckpt.config["text_config"]["hidden_size"])
    for name, (mine, theirs) in pairs.items():
        mine, theirs = np.array(mine), theirs.numpy()
        assert mine.shape == theirs.shape, name
        assert np.abs(theirs).max() > 0.1, f"{name}: the reference is degenerate"
        err = rel(mine, theirs)
        MEASURED[f"vision {'dense' if dense else 'moe'} {name}"] = (
            f"rel {err:.2e}, max abs {np.abs(mine - theirs).max():.2e} (max |ref| {np.abs(theirs).max():.2f})")
        assert err < TOLERANCE, (name, err)


def test_vision_tower_refuses_what_it_cannot_run(synth_dir, tmp_path):
    source = synth_dir("target", "bf16", dense=True)
    tower = load_vision_tower(source)
    patch_dim = tower.args.patch_dim
    with pytest.raises(ValueError, match="grid_thw"):
        tower(np.zeros((6, patch_dim), np.float32), [(1, 3, 2)])  # h not a multiple of the merge size
    with pytest.raises(ValueError, match=r"patches: shape \(7, "):
        tower(np.zeros((7, patch_dim), np.float32), [(1, 2, 4)])

    # a config the tensors do not match: the culprit tensor is named
    for f in source.iterdir():
        (tmp_path / f.name).symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    config["vision_config"]["depth"] += 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing \['blocks\.1\."):
        load_vision_tower(tmp_path)
    config["vision_config"].update(depth=config["vision_config"]["depth"] - 1, hidden_act="gelu")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="hidden_act 'gelu'"):
        load_vision_tower(tmp_path)
