"""Golden DSpark block logits from the speculators package itself (0.9.0), for
tests/test_dspark.py. Run it through make_speculators_goldens.sh, in a venv of its own:
speculators pins transformers <= 5.19, which conflicts with ours. It never runs in the
test suite; its output in tests/data/speculators/ is committed.

For each case it builds a small DSpark head with speculators' own classes
(DSparkSpeculatorConfig over a qwen3 transformer_layer_config, DSparkDraftModel), saves
it with speculators' own save_pretrained (the real speculators checkpoint layout: no
embed_tokens, no lm_head unless the vocabulary is reduced, d2t/t2d buffers), and runs
DSparkDraftModel.forward, the training forward: its anchor-block mask
(create_anchor_block_mask_mod), its decoder layers, and its Markov and confidence heads,
on fixed context features with one anchor and teacher-forced block tokens. The
corrected block logits and confidence logits are taken where forward hands them to its
loss (compute_metrics, replaced here by a recorder); the final-normed hidden states by a
hook on the draft's final norm.

The draft's frozen embedding and lm_head are the verifier's: the script writes them
(verifier.safetensors) for the test to put into a synthetic target. Every weight is
rounded to bfloat16 before the forward and saved in bfloat16, so the checkpoints hold
exactly the weights the goldens were computed with. save_pretrained also copies
speculators' config module (config.py, for its auto_map): it is deleted, the project
carries no code from elsewhere, and monolith reads only config.json.
"""

from __future__ import annotations

import json
import os
import shutil
from importlib.metadata import version
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # the verifier name is synthetic: nothing to look up

import numpy as np
import speculators.models.dspark.core as dspark_core
import torch
from safetensors.torch import save_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import Qwen3Config

OUT = Path(__file__).resolve().parents[1] / "data" / "speculators"
HIDDEN, VOCAB = 64, 512  # the test target's (monolith.synth's tiny Preset)
AUX_IDS = [1, 3]  # speculators ids (embedding = 0): outputs of target layers 0 and 2
MASK = 500
CONTEXT = 16  # context rows before the anchor; longer than every window below
BLOCK = 5
RANK = 8
SLIDING = ["sliding_attention", "sliding_attention"]

CASES = {
    # a causal sliding layer and a full-attention layer (always bidirectional)
    "causal-window": {"layer_types": ["sliding_attention", "full_attention"], "non_causal": False,
                      "sample_from_anchor": True, "head": "vanilla", "draft_vocab": None, "seed": 1},
    "noncausal-window": {"layer_types": SLIDING, "non_causal": True,
                         "sample_from_anchor": True, "head": "gated", "draft_vocab": None, "seed": 2},
    # slot 0 is the bonus token: slot k predicts p + k from block token k - 1
    "bonus-anchor": {"layer_types": SLIDING, "non_causal": False,
                     "sample_from_anchor": False, "head": "vanilla", "draft_vocab": None, "seed": 3},
    "reduced-vocab": {"layer_types": SLIDING, "non_causal": False,
                      "sample_from_anchor": True, "head": "rnn", "draft_vocab": 128, "seed": 4},
}
WINDOW = 6


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def verifier(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    embed = bf16(torch.randn(VOCAB, HIDDEN, generator=gen))
    lm_head = bf16(torch.randn(VOCAB, HIDDEN, generator=gen) * 4 / HIDDEN**0.5)
    return embed, lm_head


def build(case: dict) -> DSparkDraftModel:
    layer = Qwen3Config(
        hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=len(case["layer_types"]),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        layer_types=case["layer_types"], use_sliding_window=True, sliding_window=WINDOW,
        tie_word_embeddings=False,
    )
    layer._attn_implementation = "eager"  # speculators' float mask from the same mask_mod
    sample_from_anchor = case["sample_from_anchor"]
    config = DSparkSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=case["draft_vocab"] or VOCAB,
        block_size=BLOCK,
        aux_hidden_state_layer_ids=AUX_IDS,
        mask_token_id=MASK,
        sliding_window_non_causal=case["non_causal"],
        sample_from_anchor=sample_from_anchor,
        markov_rank=RANK,
        markov_head_type=case["head"],
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK if sample_from_anchor else BLOCK - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="synthetic/target",
                                    architectures=["Qwen3_5MoeForConditionalGeneration"]),
        ),
    )
    return DSparkDraftModel(config)


def randomize(model: DSparkDraftModel, gen: torch.Generator, embed, lm_head, rows) -> None:
    """Random weights (norms near 1), the verifier's frozen embedding and lm_head, all
    bfloat16-exact."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                value = 1 + 0.2 * torch.randn(p.shape, generator=gen)
            elif name.endswith("bias"):
                value = 0.2 * torch.randn(p.shape, generator=gen)
            elif name == "markov_head.markov_w1.weight":
                value = torch.randn(p.shape, generator=gen)
            else:
                value = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            p.copy_(bf16(value))
        model.embed_tokens.weight.copy_(embed)
        head = lm_head if rows is None else lm_head[rows]
        model.lm_head.weight.copy_(head)
        model.verifier_lm_head.weight.copy_(head)  # only feeds the (unused) training targets
        model.verifier_norm.weight.fill_(1.0)


def run(model: DSparkDraftModel, gen: torch.Generator) -> dict:
    """One anchor at position CONTEXT, through DSparkDraftModel.forward."""
    total = CONTEXT + BLOCK + 1  # select_anchors never picks the last BLOCK positions
    features = bf16(torch.randn(1, total, len(AUX_IDS) * HIDDEN, generator=gen))
    input_ids = torch.randint(0, VOCAB, (1, total), generator=gen)
    loss_mask = torch.zeros(1, total, dtype=torch.long)
    loss_mask[0, CONTEXT] = 1  # the only valid anchor
    recorded = {}

    def record(logits, targets, confidence_logits, *args, **kwargs):
        recorded["logits"], recorded["confidence"] = logits, confidence_logits
        return torch.zeros(()), {}

    hook = model.norm.register_forward_hook(lambda module, inputs, output: recorded.setdefault("hidden", output))
    dspark_core.compute_metrics = record
    model.eval()
    with torch.no_grad():
        model(hidden_states=features, input_ids=input_ids, loss_mask=loss_mask,
              verifier_last_hidden_states=torch.zeros(1, total, HIDDEN), document_ids=torch.zeros(1, total),
              max_anchors=1)
    hook.remove()
    return {
        "features": features[0, :CONTEXT].numpy(),  # rows after the anchor are masked out
        "block_tokens": input_ids[0, CONTEXT:CONTEXT + BLOCK].numpy().astype(np.int64),  # [anchor, x_1..]
        "logits": recorded["logits"][0].numpy(),  # [BLOCK, draft vocab], Markov-corrected
        "confidence_logits": recorded["confidence"][0].numpy(),  # [BLOCK]
        "hidden": recorded["hidden"][0].numpy(),  # [BLOCK, HIDDEN] after the final norm
    }


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    embed, lm_head = verifier(gen)
    save_file({"embed_tokens": embed.to(torch.bfloat16), "lm_head": lm_head.to(torch.bfloat16)},
              OUT / "verifier.safetensors")
    for name, case in CASES.items():
        gen = torch.Generator().manual_seed(case["seed"])
        model = build(case)
        rows = None
        if case["draft_vocab"]:
            rows = torch.sort(torch.randperm(VOCAB, generator=gen)[:case["draft_vocab"]]).values
            t2d = torch.zeros(VOCAB, dtype=torch.bool)
            t2d[rows] = True
            model.load_vocab_mappings(t2d, rows - torch.arange(len(rows)))
        randomize(model, gen, embed, lm_head, rows)
        golden = run(model, gen)
        model.to(torch.bfloat16).save_pretrained(OUT / name)
        (OUT / name / "config.py").unlink()  # save_pretrained's copy of speculators' config code
        np.savez(OUT / f"{name}.npz", **golden)
    (OUT / "README.md").write_text(
        "Written by tests/reference/speculators_goldens.py with speculators "
        f"{version('speculators')}, torch {torch.__version__}; do not edit by hand.\n"
        f"Cases: {json.dumps(CASES)}; window {WINDOW}, block {BLOCK}, context {CONTEXT}, markov rank {RANK}, "
        f"aux_hidden_state_layer_ids {AUX_IDS}, mask_token_id {MASK}.\n")


if __name__ == "__main__":
    main()
