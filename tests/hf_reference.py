"""Test helper: the transformers implementation of a target checkpoint, in float32, on
the checkpoint's DEQUANTIZED weights (whatever its format), as the reference our MLX
runtime must match.

transformers 5.x holds MoE experts fused (`experts.gate_up_proj [E, 2I, H]`, first I
rows gate; `experts.down_proj [E, H, I]`); per-expert checkpoints are stacked here.
Its gated DeltaNet runs the pure-torch fallback (no flash-linear-attention here).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from monolith.checkpoint import open_checkpoint

PREFIXES = ("model.language_model.", "model.")
SKIP = ("model.visual.", "model.language_model.visual.", "mtp.")
ACTIVATION_SCALES = ("input_scale", "input_global_scale", "k_scale", "v_scale", "output_scale")


def _float_weights(ckpt) -> dict[str, np.ndarray]:
    """Every language-model tensor as float32 under transformers' CausalLM names."""
    prefix = next(p for p in PREFIXES if ckpt.has(p + "embed_tokens.weight"))
    modules = ckpt.modules()
    out: dict[str, np.ndarray] = {}
    done: set[str] = set()
    for name, spec in modules.items():
        if name.startswith(SKIP):
            continue
        out[name + ".weight"] = ckpt.dequantize(name)
        done.update(spec.tensors.values())
    for t in ckpt.tensor_names():
        if t in done or t.startswith(SKIP) or t.rsplit(".", 1)[-1] in ACTIVATION_SCALES:
            continue
        if ckpt.dtype(t) in ("BF16", "F16", "F32", "F64"):
            out[t] = ckpt.read_float(t)
    renamed = {}
    for name, value in out.items():
        if name.startswith(prefix):
            name = "model." + name[len(prefix):]
        elif not name.startswith("lm_head."):
            continue
        renamed[name] = value
    return _stack_experts(renamed)


def _stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    per_expert: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    out = {}
    for name, value in weights.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m:
            per_expert.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = value
        else:
            out[name] = value
    for container, experts in per_expert.items():
        ids = sorted(experts)
        gate_up = [np.concatenate([experts[e]["gate"], experts[e]["up"]]) for e in ids]
        out[container + ".gate_up_proj"] = np.stack(gate_up)
        out[container + ".down_proj"] = np.stack([experts[e]["down"] for e in ids])
    return out


def build_reference(ckpt_dir):
    """(transformers CausalLM in float32 with the checkpoint's dequantized weights, ckpt)."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    ckpt = open_checkpoint(ckpt_dir)
    moe = ckpt.architecture == "qwen3_5_moe"
    text = dict(ckpt.text_config)
    text.pop("quantization_config", None)
    config = (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(**text)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the plain per-expert loop of the modeling file
    config.tie_last_hidden_states = False  # hidden_states[i + 1] = output of layer i, even the last
    torch.manual_seed(0)
    model = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(config).to(torch.float32).eval()
    state = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in _float_weights(ckpt).items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise AssertionError(f"reference weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


@torch.no_grad()
def reference_outputs(model, token_ids) -> tuple[np.ndarray, list[np.ndarray]]:
    """(logits float32 [T, vocab], hidden_states: [embeddings, output of layer 0, ...])."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return out.logits[0].float().numpy(), [h[0].float().numpy() for h in out.hidden_states]


def build_vlm_reference(ckpt_dir):
    """transformers' Qwen3_5ForConditionalGeneration (or the MoE class) in float32 with the
    checkpoint's dequantized language-model weights and its `model.visual.*` tensors."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    ckpt = open_checkpoint(ckpt_dir)
    moe = ckpt.architecture == "qwen3_5_moe"
    fields = {k: v for k, v in ckpt.config.items() if k not in ("architectures", "model_type", "dtype")}
    fields["text_config"] = {k: v for k, v in fields["text_config"].items() if k != "quantization_config"}
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(**fields)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = config.vision_config._attn_implementation = "eager"
    config.text_config._experts_implementation = "eager"
    torch.manual_seed(0)
    model_class = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    model = model_class(config).to(torch.float32).eval()
    state = {}
    for name, value in _float_weights(ckpt).items():
        name = "model.language_model." + name[len("model."):] if name.startswith("model.") else name
        state[name] = torch.from_numpy(np.array(value, dtype=np.float32))
    for name in ckpt.tensor_names():
        if name.startswith("model.visual."):
            state[name] = torch.from_numpy(ckpt.read_float(name).copy())
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise AssertionError(f"reference weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model
