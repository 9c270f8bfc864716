"""Quantization configs as the real exporters write them (ModelOpt hf_quant_config /
compressed-tensors quantization_config), and the rules a loader uses to read back which
scheme each linear has. The writers quantize exactly what these rules say."""

from __future__ import annotations

import fnmatch
import re

from .values import Param

MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.47.0"}
COMPRESSED_TENSORS_VERSION = "0.12.2"


def modelopt_nvfp4_config(dense: bool) -> dict:
    exclude = ["lm_head"] + ([] if dense else ["*.mlp.gate", "*shared_expert_gate*"]) + ["model.visual*", "mtp*"]
    return {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": exclude, "kv_cache_quant_algo": None}


MIXED_FP8 = re.compile(r".*\.(self_attn\.(q|k|v|o)_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))$")
MIXED_W4A16 = re.compile(r"(lm_head|.*\.mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj)$")


def modelopt_mixed_config(params: list[Param], dense: bool) -> dict:
    """The nvidia Qwen3.6-35B-A3B table: experts, shared expert, dense MLP and lm_head
    W4A16_NVFP4; attention and GDN projections FP8; the rest BF16. Experts are listed by
    their container (`...mlp.experts`) in even layers and one by one in odd layers."""
    layers: dict[str, dict] = {}
    for prm in params:
        m = prm.module
        if m is None or m.startswith(("mtp", "model.visual")):
            continue
        if MIXED_FP8.match(m):
            layers[m] = {"quant_algo": "FP8"}
        elif MIXED_W4A16.match(m):
            container = re.match(r"(.*\.layers\.(\d+)\.mlp\.experts)\.\d+\.", m)
            if container and int(container.group(2)) % 2 == 0:
                m = container.group(1)
            layers[m] = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    exclude = ([] if dense else ["*.mlp.gate", "*shared_expert_gate*"]) + [
        "*linear_attn.in_proj_a",
        "*linear_attn.in_proj_b",
        "model.visual*",
        "mtp*",
    ]
    return {
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": "FP8",
        "exclude_modules": exclude,
        "quantized_layers": dict(sorted(layers.items())),
    }


def _ct_args(bits: int, strategy: str, group_size=None, dynamic=False, observer="minmax") -> dict:
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": dynamic,
        "group_size": group_size,
        "num_bits": bits,
        "observer": observer,
        "observer_kwargs": {},
        "strategy": strategy,
        "symmetric": True,
        "type": "float",
    }


def _ct_nvfp4_group(targets: list[str], dynamic_input: bool) -> dict:
    return {
        "format": "nvfp4-pack-quantized",
        "input_activations": _ct_args(4, "tensor_group", 16, dynamic="local" if dynamic_input else False),
        "output_activations": None,
        "targets": targets,
        "weights": _ct_args(4, "tensor_group", 16),
    }


def _ct_fp8_group(targets: list[str], strategy: str) -> dict:
    return {
        "format": "float-quantized",
        "input_activations": _ct_args(8, "token", dynamic=True, observer=None),
        "output_activations": None,
        "targets": targets,
        "weights": _ct_args(8, strategy),
    }


def compressed_tensors_config(mixed: bool) -> dict:
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$", "re:model.visual.*", "re:mtp.*"]
    if not mixed:
        groups = {"group_0": _ct_nvfp4_group(["Linear"], dynamic_input=False)}
        fmt = "nvfp4-pack-quantized"
    else:  # "Dynamic NVFP4": NVFP4 MLPs and GDN projections, FP8 attention, the rest BF16
        groups = {
            "group_0": _ct_nvfp4_group(
                [
                    r"re:.*mlp\.(gate|up|down)_proj$",
                    r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$",
                    r"re:.*mlp\.shared_expert\.(gate|up|down)_proj$",
                    r"re:.*linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$",
                ],
                dynamic_input=True,
            ),
            "group_1": _ct_fp8_group([r"re:.*self_attn\.(q|k|v)_proj$"], "channel"),
            "group_2": _ct_fp8_group([r"re:.*self_attn\.o_proj$"], "tensor"),
        }
        ignore += [r"re:.*linear_attn\.in_proj_(a|b)$"]
        fmt = "mixed-precision"
    return {
        "config_groups": groups,
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


# --------------------------------------------- scheme resolution (what a loader does)


def _ct_match(module: str, target: str) -> bool:
    if target == "Linear":
        return True  # every linear weight we write belongs to an nn.Linear
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def ct_scheme(module: str, qc: dict) -> str:
    if any(_ct_match(module, t) for t in qc["ignore"]):
        return "bf16"
    for _, group in sorted(qc["config_groups"].items()):
        if any(_ct_match(module, t) for t in group["targets"]):
            if group["format"] == "nvfp4-pack-quantized":
                return "ct-nvfp4" if group["input_activations"]["dynamic"] is False else "ct-nvfp4-dynamic"
            return f"ct-fp8-{group['weights']['strategy']}"
    return "bf16"


def modelopt_scheme(module: str, q: dict) -> str:
    if q["quant_algo"] == "MIXED_PRECISION":
        layers = q["quantized_layers"]
        entry = layers.get(module)
        if entry is None:
            entry = next((v for k, v in layers.items() if module.startswith(k + ".")), None)
        if entry is None:
            return "bf16"
        return {"FP8": "fp8", "W4A16_NVFP4": "w4a16", "NVFP4": "nvfp4"}[entry["quant_algo"]]
    if any(fnmatch.fnmatchcase(module, g) for g in q["exclude_modules"]):
        return "bf16"
    return "nvfp4"
