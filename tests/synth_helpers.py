"""What the monolith.synth tests share: reading a checkpoint's tensors back, the tiny
targets written once per module, and the check that a ModelOpt config.json mirrors its
hf_quant_config.json (used by the quantized-target and the draft tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from monolith.formats import SafetensorsFile, bf16_bits_to_f32
from monolith.synth import write_target


def read_all(d: Path) -> dict[str, tuple[str, tuple, np.ndarray]]:
    """name -> (dtype, shape, stored bits) over every safetensors file of a checkpoint."""
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        st = SafetensorsFile(f)
        for n in st.names():
            assert n not in out, f"{n} in two files"
            out[n] = (st.dtype(n), st.shape(n), np.array(st.read(n)))
    return out


def bf16(t) -> np.ndarray:
    assert t[0] == "BF16", t[0]
    return bf16_bits_to_f32(t[2])


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny targets, written once per module: {(format, dense, layout): dir}."""
    root = tmp_path_factory.mktemp("synth")
    cache = {}

    def get(fmt="bf16", dense=False, layout=None, seed=0):
        key = (fmt, dense, layout, seed)
        if key not in cache:
            name = f"{fmt}-{'dense' if dense else 'moe'}-{layout}-{seed}"
            cache[key] = write_target(root / name, format=fmt, dense=dense, expert_layout=layout, seed=seed)
        return cache[key]

    return get


def assert_modelopt_mirror(mirror: dict, hf: dict) -> None:
    """config.json's quantization_config as ModelOpt's exporter derives it from
    hf_quant_config.json (modelopt.torch.export.convert_hf_config): compressed-tensors
    shaped groups, `ignore` = exclude_modules, the KV setting as `kv_cache_scheme`."""
    q = hf["quantization"]
    mixed = q["quant_algo"] == "MIXED_PRECISION"
    keys = {"config_groups", "ignore", "quant_algo", "producer", "quant_method"}
    keys |= {"quantized_layers"} if mixed else set()
    keys |= {"kv_cache_scheme"} if q.get("kv_cache_quant_algo") else set()
    assert set(mirror) == keys, sorted(mirror)
    assert mirror["quant_method"] == "modelopt" and mirror["producer"] == hf["producer"]
    assert mirror["quant_algo"] == q["quant_algo"] and mirror["ignore"] == (q.get("exclude_modules") or [])
    if q.get("kv_cache_quant_algo") == "FP8":
        assert mirror["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    groups = mirror["config_groups"]
    assert list(groups) == [f"group_{i}" for i in range(len(groups))]
    if not mixed:
        assert [g["targets"] for g in groups.values()] == [["Linear"]]
        return
    assert mirror["quantized_layers"] == q["quantized_layers"]
    bits = {"FP8": (8, 8), "NVFP4": (4, 4), "W4A16_NVFP4": (4, None)}
    listed = []
    for g in groups.values():
        assert g["targets"] == sorted(g["targets"])
        algos = {q["quantized_layers"][t]["quant_algo"] for t in g["targets"]}
        assert len(algos) == 1
        weights, inputs = bits[algos.pop()]
        assert g["weights"]["num_bits"] == weights and g["weights"]["type"] == "float"
        assert (g.get("input_activations") or {}).get("num_bits") == inputs
        listed += g["targets"]
    assert sorted(listed) == sorted(q["quantized_layers"])
