"""config.json, the quantization config and the architecture they name.

Only JSON is read: `auto_map` and custom modeling code are never looked at.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import CheckpointError

# Our architecture names, their one home: the pack recipes and the models' registry
# (monolith.models.loading) key on these.
QWEN3_5_MOE = "qwen3_5_moe"  # the MoE target (35B-A3B)
QWEN3_5 = "qwen3_5"  # the dense target (27B)
DSPARK = "dspark"  # a DeepSpec-native draft (or its NVFP4 export)
DSPARK_SPECULATORS = "dspark-speculators"  # a speculators-format DSpark draft
DFLASH = "dflash"  # a z-lab DFlash draft
TARGET_ARCHITECTURES = (QWEN3_5_MOE, QWEN3_5)
DRAFT_ARCHITECTURES = (DSPARK, DSPARK_SPECULATORS, DFLASH)
# our architecture name -> role
ARCHITECTURE_ROLES = {**dict.fromkeys(TARGET_ARCHITECTURES, "target"), **dict.fromkeys(DRAFT_ARCHITECTURES, "draft")}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_ROLES)

# Hugging Face class names and model types of the targets
TARGET_CLASSES = {
    "Qwen3_5MoeForConditionalGeneration": QWEN3_5_MOE,
    "Qwen3_5MoeForCausalLM": QWEN3_5_MOE,
    "Qwen3_5ForConditionalGeneration": QWEN3_5,
    "Qwen3_5ForCausalLM": QWEN3_5,
}
TARGET_MODEL_TYPES = {
    "qwen3_5_moe": QWEN3_5_MOE,
    "qwen3_5_moe_text": QWEN3_5_MOE,
    "qwen3_5": QWEN3_5,
    "qwen3_5_text": QWEN3_5,
}

MODELOPT_ALGOS = {"NVFP4": "modelopt-nvfp4", "W4A16_NVFP4": "modelopt-nvfp4", "MIXED_PRECISION": "modelopt-mixed"}
QUANT_METHODS = ("modelopt", "compressed-tensors")

CONFIG_FILE = "config.json"
HF_QUANT_FILE = "hf_quant_config.json"


def load_json(path: Path) -> dict:
    """A JSON object from `path`, or CheckpointError naming the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def text_config_of(config: dict) -> dict:
    """Language fields: `text_config` when the model is multimodal, else the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def detect_architecture(config: dict, where: Path) -> str:
    """One of SUPPORTED_ARCHITECTURES. Drafts are checked first: a DeepSpec draft's
    config is a copy of a Qwen config plus its own fields. A draft's name here only picks
    its format (monolith.pack.draft_formats: where its config keeps its fields and the
    defaults it implies); what the draft computes (its Markov and confidence heads, the
    block mask, sample_from_anchor) is decided in pack.draft_recipe from the tensors
    present and every field that states it, since a `DFlashDraftModel` label or a
    `dflash_config` block can sit on a DSpark head."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    spec_type = config.get("speculators_model_type")
    if spec_type is not None:
        if spec_type == "dspark":
            return DSPARK_SPECULATORS
        raise CheckpointError(
            f"{where}: speculators_model_type {spec_type!r} is not supported "
            f"(supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if "Qwen3DSparkModel" in archs or isinstance(config.get("dspark_config"), dict):
        return DSPARK
    if "DFlashDraftModel" in archs or isinstance(config.get("dflash_config"), dict):
        return DFLASH
    for cls in archs:
        if cls in TARGET_CLASSES:
            return TARGET_CLASSES[cls]
    for model_type in (config.get("model_type"), text_config_of(config).get("model_type")):
        if model_type in TARGET_MODEL_TYPES:
            return TARGET_MODEL_TYPES[model_type]
    raise CheckpointError(
        f"{where}: unsupported architecture (architectures={archs}, "
        f"model_type={config.get('model_type')!r}); supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
        f"(targets {', '.join(TARGET_CLASSES)}; drafts Qwen3DSparkModel / dspark_config, "
        "speculators_model_type 'dspark', DFlashDraftModel / dflash_config)"
    )


def read_quant_config(path: Path, config: dict) -> tuple[str, dict | None, str]:
    """(quant_format, quant_config, where) for the checkpoint directory `path`.

    Sources, first found wins: hf_quant_config.json "quantization" (ModelOpt),
    config.json "quantization_config" (ModelOpt mirror or compressed-tensors),
    config.json "lithos_quantization" with format nvfp4 (treated as ModelOpt NVFP4
    without exclusions). `where` names the file and field for error messages.

    ModelOpt mirrors hf_quant_config.json into config.json. Recent exports write the
    mirror compressed-tensors-shaped (modelopt/torch/export/convert_hf_config.py):
    `config_groups`, `ignore` (= exclude_modules), `quantized_layers` (MIXED_PRECISION),
    `quant_algo`, `kv_cache_scheme`, `producer`, `quant_method: "modelopt"`; older ones
    `quant_library: "modelopt"` and no per-layer detail. Both are read; when
    hf_quant_config.json is there too, the two must name the same quant_algo.
    """
    qc = config.get("quantization_config")
    hf_quant = path / HF_QUANT_FILE
    if hf_quant.is_file():
        block = load_json(hf_quant).get("quantization")
        where = f"{hf_quant}: quantization"
        if not isinstance(block, dict):
            raise CheckpointError(f"{hf_quant}: missing the 'quantization' object")
        quant_format = _modelopt_format(block, where)
        if isinstance(qc, dict) and _is_modelopt(qc) and "quant_algo" in qc:
            if str(qc["quant_algo"]).upper() != str(block.get("quant_algo")).upper():
                raise CheckpointError(
                    f"{where}.quant_algo is {block.get('quant_algo')!r} but {path / CONFIG_FILE}: "
                    f"quantization_config.quant_algo is {qc['quant_algo']!r}; the two must agree"
                )
        return quant_format, block, where

    if isinstance(qc, dict):
        where = f"{path / CONFIG_FILE}: quantization_config"
        method = qc.get("quant_method")
        if method == "compressed-tensors":
            return "compressed-tensors", qc, where
        if _is_modelopt(qc):
            return _modelopt_format(qc, where), qc, where
        raise CheckpointError(
            f"{where}.quant_method {method!r} is not supported (supported: {', '.join(QUANT_METHODS)})"
        )

    lithos = config.get("lithos_quantization")
    if isinstance(lithos, dict) and str(lithos.get("format", "")).lower() == "nvfp4":
        return "modelopt-nvfp4", lithos, f"{path / CONFIG_FILE}: lithos_quantization"
    return "unquantized", None, f"{path / CONFIG_FILE}"


def _is_modelopt(qc: dict) -> bool:
    method = qc.get("quant_method")
    return method == "modelopt" or (method is None and ("quant_algo" in qc or qc.get("quant_library") == "modelopt"))


def _modelopt_format(block: dict, where: str) -> str:
    algo = str(block.get("quant_algo")).upper()
    if algo not in MODELOPT_ALGOS:
        raise CheckpointError(
            f"{where}.quant_algo {block.get('quant_algo')!r} is not supported "
            f"(supported: {', '.join(MODELOPT_ALGOS)})"
        )
    return MODELOPT_ALGOS[algo]
