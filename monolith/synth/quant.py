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


def modelopt_mixed_config(
    params: list[Param], dense: bool, nvfp4_algo: str = "W4A16_NVFP4", experts_listed: str = "mixed"
) -> dict:
    """The nvidia Qwen3.6-35B-A3B table: experts, shared expert, dense MLP and lm_head
    NVFP4 (`nvfp4_algo`: W4A16_NVFP4, or NVFP4 with input scales as nvidia's export);
    attention and GDN projections FP8; the rest BF16. experts_listed: "container" lists
    each layer's experts by their container `...mlp.experts` (nvidia's export: its 35 kB
    hf_quant_config.json cannot list 10,240 experts one by one), "mixed" by container in
    even layers and one by one in odd layers (both forms in one file)."""
    if experts_listed not in ("container", "mixed"):
        raise ValueError(f"unknown experts_listed {experts_listed!r} (known: container, mixed)")
    layers: dict[str, dict] = {}
    for prm in params:
        m = prm.module
        if m is None or m.startswith(("mtp", "model.visual")):
            continue
        if MIXED_FP8.match(m):
            layers[m] = {"quant_algo": "FP8"}
        elif MIXED_W4A16.match(m):
            container = re.match(r"(.*\.layers\.(\d+)\.mlp\.experts)\.\d+\.", m)
            if container and (experts_listed == "container" or int(container.group(2)) % 2 == 0):
                m = container.group(1)
            layers[m] = {"quant_algo": nvfp4_algo, "group_size": 16}
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


def modelopt_mirror(hf_quant: dict) -> dict:
    """config.json `quantization_config` as ModelOpt's exporter writes it next to
    hf_quant_config.json (modelopt/torch/export/convert_hf_config.py): compressed-tensors
    shaped `config_groups` (one group per distinct layer setting, targets sorted),
    `quantized_layers` kept for MIXED_PRECISION, `ignore` = exclude_modules, `quant_algo`,
    `kv_cache_scheme` (the FP8 KV setting; `kv_cache_quant_algo` itself sits only in
    hf_quant_config.json), `producer`, `quant_method: "modelopt"`."""
    q = hf_quant["quantization"]
    algo = q["quant_algo"]
    if algo == "MIXED_PRECISION":
        by_setting: dict[tuple, list[str]] = {}
        for module, entry in q["quantized_layers"].items():
            by_setting.setdefault(tuple(sorted(entry.items())), []).append(module)
        settings = list(by_setting.items())
    else:
        settings = [((("group_size", q.get("group_size")), ("quant_algo", algo)), ["Linear"])]
    groups = {}
    for i, (setting, targets) in enumerate(settings):
        entry = dict(setting)
        group = _modelopt_group(entry["quant_algo"], entry.get("group_size"))
        groups[f"group_{i}"] = {**group, "targets": sorted(targets)}
    mirror = {"config_groups": groups}
    if algo == "MIXED_PRECISION":
        mirror["quantized_layers"] = q["quantized_layers"]
    mirror["ignore"] = list(q.get("exclude_modules") or [])
    mirror["quant_algo"] = algo
    if q.get("kv_cache_quant_algo") == "FP8":
        mirror["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    mirror["producer"] = hf_quant["producer"]
    mirror["quant_method"] = "modelopt"
    return mirror


def _modelopt_group(algo: str, group_size) -> dict:
    def args(bits, size=None):
        return {"dynamic": False, "num_bits": bits, "type": "float", **({"group_size": size} if size else {})}

    if algo == "FP8":
        return {"input_activations": args(8), "weights": args(8)}
    if algo == "NVFP4":
        return {"input_activations": args(4, group_size or 16), "weights": args(4, group_size or 16)}
    if algo == "W4A16_NVFP4":  # weight-only
        return {"weights": args(4, group_size or 16)}
    raise ValueError(f"synth: no ModelOpt mirror for quant_algo {algo!r}")


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


def unsloth_dynamic_config(fp8_mlps: list[str]) -> dict:
    """unsloth's "Dynamic NVFP4" (compressed-tensors mixed-precision) as on
    unsloth/Qwen3.6-27B-NVFP4: MLPs NVFP4 with static input scales (input_global_scale);
    FP8 per channel (dynamic per-token inputs) for the GDN in_proj_qkv/in_proj_z/out_proj,
    the attention projections, lm_head and the MLPs of the last layers (`fp8_mlps`, exact
    names, which win over the NVFP4 regex as compressed-tensors matches); BF16 for the
    rest; an FP8 KV cache (static per-tensor k_scale / v_scale). Nothing ignores `mtp.*`:
    the MTP layer is stored BF16 in model_mtp.safetensors although the NVFP4 and FP8
    regexes match its names."""
    fp8_targets = [
        r"re:.*linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$",
        r"re:.*self_attn\.(q|k|v|o)_proj$",
        "lm_head",
        *fp8_mlps,
    ]
    return {
        "config_groups": {
            "group_0": _ct_nvfp4_group([r"re:.*mlp\.(gate|up|down)_proj$"], dynamic_input=False),
            "group_1": _ct_fp8_group(fp8_targets, "channel"),
        },
        "format": "mixed-precision",
        "global_compression_ratio": None,
        "ignore": [r"re:.*linear_attn\.in_proj_(a|b)$", "re:model.visual.*"],
        "kv_cache_scheme": _ct_args(8, "tensor"),
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
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
    """As compressed-tensors matches: ignore wins; then an exact name beats a `re:`
    target, which beats a class name (`Linear`)."""
    if any(_ct_match(module, t) for t in qc["ignore"]):
        return "bf16"
    ranked = []
    for name, group in sorted(qc["config_groups"].items()):
        for t in group["targets"]:
            if _ct_match(module, t):
                ranked.append((2 if t == "Linear" else 1 if t.startswith("re:") else 0, name))
    if not ranked:
        return "bf16"
    group = qc["config_groups"][min(ranked)[1]]
    if group["format"] == "nvfp4-pack-quantized":
        return "ct-nvfp4" if group["input_activations"]["dynamic"] is False else "ct-nvfp4-dynamic"
    return f"ct-fp8-{group['weights']['strategy']}"


def modelopt_scheme(module: str, q: dict) -> str:
    if q["quant_algo"] == "MIXED_PRECISION":
        layers = q["quantized_layers"]
        parts = module.split(".")  # the module itself, else its closest listed parent
        prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
        entry = next((layers[k] for k in prefixes if k in layers), None)
        if entry is None:
            return "bf16"
        return {"FP8": "fp8", "W4A16_NVFP4": "w4a16", "NVFP4": "nvfp4"}[entry["quant_algo"]]
    if any(fnmatch.fnmatchcase(module, g) for g in q["exclude_modules"]):
        return "bf16"
    return "nvfp4"
