"""Golden MTP head outputs from the speculators package itself (0.9.0), for the MLX MTP
head. Run it through make_speculators_goldens.sh (the venv of speculators_goldens.py:
speculators pins transformers <= 5.19, which conflicts with ours). It never runs in the
test suite; its output in tests/data/speculators-mtp/ is committed, and the README there
says what every array is. What the head computes: docs/drafts.md 6.

Two cases over the tiny synthetic target's sizes (monolith.synth's "tiny" Preset, read
from monolith.synth itself so the head fits that target): `moe`, speculators'
Qwen35MoeMTPLayer (gated full attention + sparse MoE with a shared expert, over a
qwen3_5_moe_text config), and `dense`, its Qwen35MTPLayer (dense MLP, qwen3_5_text), as
in the 35B-A3B and the 27B. Each head is speculators' MTPDraftModel, random weights
rounded to bfloat16, the verifier's embedding and lm_head filled in.

Two schedules per case, both through speculators' own MTP layer:
- `train_*`: MTPDraftModel.forward itself (3 chained, teacher-forced steps). Logits are
  what forward returns; each step's hidden state (after mtp.norm) is taken by a hook on
  the MTP layer.
- `decode_*`: the layer driven as vLLM's MTP proposer drives it at inference (step 0 over
  the prompt, then one new row per step at the next position, attending to every earlier
  row as a KV cache would), each step's input token the argmax of the step before. The
  schedule is this script's; the layer, norms, rotary embedding and mask are speculators'.

Weights are saved in bfloat16 under the published checkpoint's names (speculators'
converter mapping, inverted), with the verifier's embedding and lm_head under the
synthetic target's names, so a test can put them into a synthetic target of the same
shape. Nothing of speculators' code is written.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # the verifier name is synthetic: nothing to look up

import numpy as np
import torch
from safetensors.torch import save_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.convert.mtp.converter import MTP_EXACT_REMAP, MTP_PREFIX_REMAP
from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
from speculators.models.mtp.core import _prepare_mtp_position_ids
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import AutoConfig
from transformers.masking_utils import create_causal_mask

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the synthetic target's sizes and tensor names
from monolith.synth.presets import PRESETS
from monolith.synth.target import LM, mtp_params, plan_units, text_config
from monolith.synth.writers import stored_specs

OUT = ROOT / "tests" / "data" / "speculators-mtp"
PRESET = PRESETS["tiny"]
STEPS = 3  # num_speculative_steps
TOKENS = 14  # input rows T: the training forward scores T - STEPS - 1 of them
FIRST_POSITION = 5  # positions FIRST_POSITION .. + T - 1 (a continued sequence)
MARGIN = 0.1  # every decode argmax leads the runner-up by this much, so a float32 head agrees on it
ROUTER_GAP = 1e-4  # the MoE router's 2nd and 3rd expert probabilities differ by this much, every row
CASES = {"moe": {"dense": False, "seed": 4}, "dense": {"dense": True, "seed": 2}}


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def layer_config(dense: bool):
    cfg = text_config(PRESET, dense)
    tc = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    tc._attn_implementation = "eager"
    return tc


def build(dense: bool) -> MTPDraftModel:
    tc = layer_config(dense)
    config = MTPSpeculatorConfig(
        transformer_layer_config=tc,
        speculators_config=SpeculatorsConfig(
            algorithm="mtp",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(
                name_or_path="synthetic/target",
                architectures=["Qwen3_5ForConditionalGeneration" if dense else "Qwen3_5MoeForConditionalGeneration"],
            ),
        ),
    )
    model = MTPDraftModel(config)
    model.eval()
    return model


def randomize(model: MTPDraftModel, gen: torch.Generator) -> None:
    """bfloat16-exact random weights: zero-centred norm weights (applied as 1 + w), linears
    and experts with std 1 / sqrt(fan in), an embedding of std 1, an lm_head that gives
    peaked logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                value = 0.1 * torch.randn(p.shape, generator=gen)
            elif name == "embed_tokens.weight":
                value = torch.randn(p.shape, generator=gen)
            elif name in ("lm_head.weight", "verifier_lm_head.weight"):
                value = torch.randn(p.shape, generator=gen) * 4 / p.shape[-1] ** 0.5
            else:
                value = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            p.copy_(bf16(value))


def published_name(name: str) -> str:
    """The checkpoint name speculators' converter maps to this parameter."""
    for src, dst in MTP_EXACT_REMAP.items():
        if name == dst:
            return src
    for src, dst in MTP_PREFIX_REMAP:
        if name.startswith(dst):
            return src + name[len(dst):]
    raise KeyError(name)


def checkpoint(model: MTPDraftModel, dense: bool) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    head = {published_name(k): v for k, v in state.items() if k.startswith("mtp_layers.")}
    # the published layout: nvidia's 35B keeps its MTP experts fused, the synthetic target too
    units = plan_units(mtp_params(PRESET, dense), lambda m: "bf16", share_scales=False, fuse_experts=True)
    expected = {name: shape for unit in units for name, _, shape in stored_specs(unit)}
    got = {k: tuple(v.shape) for k, v in head.items()}
    if got != expected:
        raise AssertionError(f"speculators' head differs from the published layout: {got} vs {expected}")
    head[f"{LM}.embed_tokens.weight"] = state["embed_tokens.weight"]
    head["lm_head.weight"] = state["lm_head.weight"]
    return {k: v.to(torch.bfloat16).contiguous() for k, v in head.items()}


def train(model: MTPDraftModel, input_ids, hidden, positions) -> dict:
    """MTPDraftModel.forward: logits as returned, each step's hidden by a hook on the layer."""
    recorded = []
    hook = model.mtp_layers[0].register_forward_hook(lambda module, inputs, output: recorded.append(output))
    with torch.no_grad():
        logits, _, _ = model(input_ids=input_ids, hidden_states=hidden, position_ids=positions)
    hook.remove()
    return {
        "train_hidden": torch.cat(recorded).numpy(),  # [STEPS, T - STEPS - 1, H]
        "train_logits": torch.cat(logits).numpy(),  # [STEPS, T - STEPS - 1, vocab]
    }


def layer_pass(model: MTPDraftModel, hidden, embeds, positions) -> torch.Tensor:
    """One causal pass of speculators' MTP layer over rows [1, n, H] at positions [1, n],
    with the mask, position ids and rotary embedding exactly as MTPDraftModel.forward
    makes them."""
    tc = model.config.transformer_layer_config
    n = hidden.shape[1]
    step_pos, rotary_pos = _prepare_mtp_position_ids(positions, n, tc.model_type)
    mask = create_causal_mask(config=tc, inputs_embeds=hidden, attention_mask=None,
                              past_key_values=None, position_ids=step_pos)
    return model.mtp_layers[0](hidden_states=hidden, token_embeddings=embeds, attention_mask=mask,
                               position_ids=step_pos, position_embeddings=model.rotary_emb(hidden, rotary_pos))


def decode(model: MTPDraftModel, input_ids, hidden, positions) -> dict:
    """vLLM's schedule: the prompt is rows 0..T-2 of the verifier's hidden states, and
    input_ids[T-1] is the token the verifier sampled after them. Step 0 pairs hidden row t
    with the embedding of token t + 1 at position t, over the whole prompt; step k > 0 adds
    one row: the step before's last output, the embedding of its argmax, the next position.
    Recomputing every row without a cache equals a KV cache, the layer being causal."""
    prompt = TOKENS - 1
    rows_h = hidden[:, :prompt]
    rows_e = model.embed_tokens(input_ids[:, 1:prompt + 1])
    rows_p = positions[:, :prompt]
    out_h, out_logits, drafted = [], [], []
    with torch.no_grad():
        for step in range(STEPS):
            out = layer_pass(model, rows_h, rows_e, rows_p)
            if step == 0:
                first = out[0]
            last = out[:, -1:]
            logits = model.lm_head(last)
            top2 = logits[0, -1].topk(2).values
            if top2[0] - top2[1] < MARGIN:
                raise AssertionError(f"decode step {step}: the argmax leads by only {float(top2[0] - top2[1])}")
            token = logits[0, -1].argmax().reshape(1, 1)
            out_h.append(last[0, 0])
            out_logits.append(logits[0, 0])
            drafted.append(int(token))
            rows_h = torch.cat([rows_h, last], dim=1)
            rows_e = torch.cat([rows_e, model.embed_tokens(token)], dim=1)
            rows_p = torch.cat([rows_p, rows_p[:, -1:] + 1], dim=1)
    return {
        "decode_step0_hidden": first.numpy(),  # [T - 1, H]: step 0 over the prompt, every row
        "decode_hidden": torch.stack(out_h).numpy(),  # [STEPS, H]: each step's new row
        "decode_logits": torch.stack(out_logits).numpy(),  # [STEPS, vocab]
        "decode_tokens": np.array(drafted, dtype=np.int64),  # [STEPS]: argmax of each step
    }


def watch_router(model: MTPDraftModel, gaps: list[float]):
    """Record, per router call, the smallest gap between the probabilities of the last
    expert kept and the first one dropped: the experts a row picks must not hang on
    rounding."""
    router = model.mtp_layers[0].mlp.gate

    def record(module, inputs, output):
        probs = output[0].softmax(-1).topk(router.top_k + 1).values
        gaps.append(float((probs[:, -2] - probs[:, -1]).min()))

    return router.register_forward_hook(record)


def run_case(name: str, case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    model = build(case["dense"])
    randomize(model, gen)
    h = PRESET.hidden_size
    input_ids = torch.randint(0, PRESET.vocab_size, (1, TOKENS), generator=gen)
    hidden = bf16(torch.randn(1, TOKENS, h, generator=gen))
    positions = (FIRST_POSITION + torch.arange(TOKENS)).unsqueeze(0)
    golden = {
        "input_ids": input_ids[0].numpy().astype(np.int64),
        "hidden_states": hidden[0].numpy(),
        "positions": positions[0].numpy().astype(np.int64),
    }
    gaps: list[float] = []
    hook = None if case["dense"] else watch_router(model, gaps)
    golden.update(train(model, input_ids, hidden, positions))
    golden.update(decode(model, input_ids, hidden, positions))
    if hook is not None:
        hook.remove()
        if min(gaps) < ROUTER_GAP:
            raise AssertionError(f"{name}: a router choice hangs on {min(gaps)}")
    # the two schedules share step 0 on the rows both score
    rows = golden["train_hidden"].shape[1]
    gap = np.abs(golden["decode_step0_hidden"][:rows] - golden["train_hidden"][0]).max()
    if gap > 1e-5:
        raise AssertionError(f"{name}: step 0 differs between the schedules by {gap}")
    for key, value in golden.items():
        if not np.isfinite(value).all():
            raise AssertionError(f"{name}: {key} is not finite")
    save_file(checkpoint(model, case["dense"]), OUT / f"{name}.safetensors")
    np.savez(OUT / f"{name}.npz", **golden)


def main() -> None:
    if OUT.exists():
        for path in OUT.iterdir():
            if path.name != "README.md":  # README.md is written by hand
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, case in CASES.items():
        run_case(name, case)
    (OUT / "provenance.json").write_text(json.dumps({
        "speculators": version("speculators"), "torch": torch.__version__, "transformers": version("transformers"),
        "steps": STEPS, "tokens": TOKENS, "first_position": FIRST_POSITION, "cases": CASES,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
