"""A float copy of a ModelOpt NVFP4 checkpoint, for mlx-lm (bench/prompt_cache.py,
bench/agent_session.py), or by hand:

    python -m bench.mlx_lm_checkpoint [SOURCE] --out DIR [--dtype F32|BF16]

(SOURCE: a checkpoint directory, default the bundled demo target), then
`python -m mlx_lm.server --model DIR` serves the same weights monolith serves.

mlx-lm 0.32 loads ModelOpt NVFP4 by its hf_quant_config, but its qwen3_5_moe model
does not take the per-expert `weight_scale` / `weight_scale_2` / `input_scale` tensors
(it refuses them as "parameters not in model"), and `monolith.pack unpack` writes that
same ModelOpt layout back. So this dequantizes every NVFP4 / FP8 module with monolith's
checkpoint reader (w = E2M1 code * E4M3 block scale * tensor scale, exact in float32)
and stores it as F32 (BF16 on request), per-expert projections stacked into transformers' fused layout
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I], which
mlx-lm's sanitize splits), the other tensors as they are, beside the source's config
(without its quantization config) and tokenizer files. F32 is the default because
MLX's CPU GatherMM (mlx-lm's expert matmul) "only supports float32"; F32 also keeps
every dequantized value exact, where BF16 rounds it to nearest even.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np

from monolith.checkpoint.reader import open_checkpoint
from monolith.formats.codecs import f32_to_bf16_bits
from monolith.formats.stfile import write_safetensors

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".weight_global_scale", ".input_global_scale")
EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
          "special_tokens_map.json", "vocab.json", "merges.txt")


def write_float_checkpoint(source: Path, out: Path, dtype: str = "F32") -> Path:
    """`out` holds a float (`dtype` F32 or BF16) checkpoint of `source`, a directory; returns `out`."""
    if dtype not in ("F32", "BF16"):
        raise ValueError(f"dtype must be F32 or BF16, got {dtype}")

    def stored(values: np.ndarray) -> tuple[str, np.ndarray]:
        return (dtype, f32_to_bf16_bits(values) if dtype == "BF16" else values.astype(np.float32))

    ckpt = open_checkpoint(source, local_files_only=True)
    modules = {name: ckpt.module(name) for name in ckpt.module_names()}
    quantized = {name for name, spec in modules.items() if spec.precision in ("nvfp4", "fp8")}
    tensors = {}
    for name in ckpt.tensor_names():
        module = name.rsplit(".", 1)[0]
        if module in quantized:
            if name.endswith((".weight", ".weight_packed")):
                tensors[module + ".weight"] = stored(ckpt.dequantize(module))
            elif not name.endswith(SCALE_SUFFIXES):
                raise ValueError(f"{source}: {name}: a tensor of quantized module {module} this copy does not know")
            continue
        tensors[name] = stored(ckpt.read_float(name))
    _fuse_experts(tensors, dtype)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
    config = json.loads((Path(source) / "config.json").read_text())
    config.pop("quantization_config", None)
    config.get("text_config", {}).pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, out / name)
    return out


def _fuse_experts(tensors: dict, dtype: str) -> None:
    """Replace `experts.{e}.{gate,up,down}_proj.weight` by the stacked fused tensors, in place."""
    groups: dict[str, dict[tuple[int, str], np.ndarray]] = {}
    for name in [n for n in tensors if EXPERT.match(n)]:
        prefix, expert, kind = EXPERT.match(name).groups()
        groups.setdefault(prefix, {})[int(expert), kind] = tensors.pop(name)[1]
    for prefix, parts in groups.items():
        experts = sorted({e for e, _ in parts})
        if experts != list(range(len(experts))) or len(parts) != 3 * len(experts):
            raise ValueError(f"{prefix}: experts are not numbered 0..E-1 with gate, up and down each")
        tensors[prefix + ".gate_up_proj"] = (dtype, np.stack(
            [np.concatenate([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in experts]))
        tensors[prefix + ".down_proj"] = (dtype, np.stack([parts[e, "down_proj"] for e in experts]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", type=Path, help="checkpoint directory (default: the bundled demo target)")
    ap.add_argument("--out", type=Path, required=True, help="where the float checkpoint is written")
    ap.add_argument("--dtype", choices=("F32", "BF16"), default="F32")
    args = ap.parse_args(argv)
    source = args.source
    if source is None:
        from monolith.pack.demo import bundle_dir

        source = bundle_dir() / "target"
    out = write_float_checkpoint(source, args.out, args.dtype)
    print(f"wrote {out} ({args.dtype}); serve it with: python -m mlx_lm.server --model {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
