"""monolith.formats.stfile: the files we write, read back by `mx.load` and
`safetensors.safe_open`, and clear errors for malformed files.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors import safe_open

from monolith.formats import (
    FormatError,
    SafetensorsFile,
    bf16_bits_to_f32,
    e4m3_decode,
    f32_to_bf16_bits,
    write_safetensors,
)
from monolith.formats.stfile import STORAGE_DTYPES

# ---------------------------------------------------------------------------------
# stfile
# ---------------------------------------------------------------------------------


def _all_dtype_tensors(rng) -> dict[str, tuple[str, np.ndarray]]:
    tensors = {}
    for dtype, storage in STORAGE_DTYPES.items():
        nbytes = np.dtype(storage).itemsize * 12
        raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
        if dtype == "BOOL":
            arr = (raw % 2).astype(np.bool_).reshape(3, 4)
        elif dtype in ("F16", "F32", "F64"):
            arr = rng.standard_normal(12).astype(storage).reshape(3, 4)
        elif dtype == "BF16":
            arr = f32_to_bf16_bits(rng.standard_normal(12).astype(np.float32)).reshape(3, 4)
        elif dtype == "F8_E4M3":
            arr = raw.reshape(3, 4).copy()
            arr[(arr & 0x7F) == 0x7F] = 0x3C  # keep it NaN-free for value comparisons
        else:
            arr = raw.view(storage).reshape(3, 4)
        tensors[f"t.{dtype.lower()}"] = (dtype, arr)
    tensors["scalar.f32"] = ("F32", np.array(0.125, np.float32))
    tensors["empty.u8"] = ("U8", np.zeros((0, 4), np.uint8))
    return tensors


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fb" and a.dtype.itemsize > 1 else a


def test_stfile_round_trip_every_dtype(tmp_path):
    import torch

    tensors = _all_dtype_tensors(np.random.default_rng(17))
    path = tmp_path / "all.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt", "b": 2})

    f = SafetensorsFile(path)
    assert sorted(f.names()) == sorted(tensors)
    assert f.metadata == {"b": "2", "format": "pt"}
    for name, (dtype, arr) in tensors.items():
        assert f.dtype(name) == dtype and f.shape(name) == arr.shape
        assert f.nbytes(name) == arr.nbytes
        got = f.read(name)
        assert got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(_bits(got), _bits(arr))

    # safetensors (torch) reads the same bits with the right dtypes
    torch_dtypes = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F16": torch.float16,
                    "F32": torch.float32, "F64": torch.float64, "BOOL": torch.bool}
    with safe_open(str(path), "pt") as sf:
        assert sorted(sf.keys()) == sorted(tensors)
        assert sf.metadata() == {"b": "2", "format": "pt"}
        for name, (dtype, arr) in tensors.items():
            t = sf.get_tensor(name)
            if dtype in torch_dtypes:
                assert t.dtype == torch_dtypes[dtype]
            if dtype == "BF16":
                t = t.view(torch.uint16)
            elif dtype == "F8_E4M3":
                t = t.view(torch.uint8)
                np.testing.assert_array_equal(
                    sf.get_tensor(name).float().numpy(), e4m3_decode(arr)
                )
            np.testing.assert_array_equal(_bits(t.numpy()), _bits(arr))

    # mx.load: F64 is not supported by MLX's safetensors reader, so check it apart
    no_f64 = {k: v for k, v in tensors.items() if v[0] != "F64"}
    path2 = tmp_path / "no_f64.safetensors"
    write_safetensors(path2, no_f64)
    with pytest.raises(Exception, match="F64"):
        mx.load(str(path))
    loaded = mx.load(str(path2))
    assert sorted(loaded) == sorted(no_f64)
    for name, (dtype, arr) in no_f64.items():
        a = loaded[name]
        if dtype == "BF16":
            assert a.dtype == mx.bfloat16
            np.testing.assert_array_equal(np.array(a.view(mx.uint16)), arr)
            np.testing.assert_array_equal(np.array(a.astype(mx.float32)), bf16_bits_to_f32(arr))
        elif dtype == "F8_E4M3":
            assert a.dtype == mx.uint8  # raw bytes, docs/formats.md 2d
            np.testing.assert_array_equal(np.array(a), arr)
            np.testing.assert_array_equal(
                np.array(mx.from_fp8(a, dtype=mx.float32)), e4m3_decode(arr)
            )
        else:
            np.testing.assert_array_equal(_bits(np.array(a)), _bits(arr))


def test_stfile_writes_are_deterministic(tmp_path):
    tensors = _all_dtype_tensors(np.random.default_rng(18))
    reordered = dict(reversed(list(tensors.items())))
    write_safetensors(tmp_path / "a.safetensors", tensors, metadata={"x": 1, "a": "y"})
    write_safetensors(tmp_path / "b.safetensors", reordered, metadata={"a": "y", "x": 1})
    a = (tmp_path / "a.safetensors").read_bytes()
    assert a == (tmp_path / "b.safetensors").read_bytes()
    n = int.from_bytes(a[:8], "little")
    assert n % 8 == 0
    header = json.loads(a[8 : 8 + n])
    names = [k for k in header if k != "__metadata__"]
    assert names == sorted(names)


def test_stfile_rejects_unstorable_arrays(tmp_path):
    with pytest.raises(FormatError, match="bad"):
        write_safetensors(tmp_path / "x.safetensors", {"bad": ("BF16", np.zeros(2, np.float32))})
    with pytest.raises(FormatError, match="bad"):
        write_safetensors(tmp_path / "x.safetensors", {"bad": ("F4", np.zeros(2, np.uint8))})


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_stfile_errors_name_file_and_tensor(tmp_path):
    good = tmp_path / "good.safetensors"
    write_safetensors(good, {"a.weight": ("F32", np.arange(8, dtype=np.float32)),
                             "b.weight": ("U8", np.arange(16, dtype=np.uint8))})
    raw = good.read_bytes()

    # truncated in the data: names the file and the tensor that runs past the end
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[:-4])
    with pytest.raises(FormatError) as e:
        SafetensorsFile(cut)
    assert str(cut) in str(e.value) and "b.weight" in str(e.value)

    # truncated inside the 8-byte length
    stub = tmp_path / "stub.safetensors"
    stub.write_bytes(raw[:5])
    with pytest.raises(FormatError, match="truncated") as e:
        SafetensorsFile(stub)
    assert str(stub) in str(e.value)

    # header length past the end of the file
    long = tmp_path / "long.safetensors"
    long.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    with pytest.raises(FormatError) as e:
        SafetensorsFile(long)
    assert str(long) in str(e.value)

    # corrupt header JSON (and non-UTF-8 bytes; and JSON that is not an object)
    n = int.from_bytes(raw[:8], "little")
    for i, body in enumerate([b"{" + b"x" * (n - 1), b"\xff" * n, b"[1]" + b" " * (n - 3)]):
        bad = tmp_path / f"json{i}.safetensors"
        bad.write_bytes(raw[:8] + body + raw[8 + n :])
        with pytest.raises(FormatError, match="header") as e:
            SafetensorsFile(bad)
        assert str(bad) in str(e.value)

    # data_offsets inconsistent with dtype and shape
    off = _raw_file(tmp_path / "off.safetensors",
                    {"x.ok": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                     "x.bad": {"dtype": "F32", "shape": [2, 3], "data_offsets": [4, 24]}},
                    bytes(32))
    with pytest.raises(FormatError) as e:
        SafetensorsFile(off)
    assert str(off) in str(e.value) and "x.bad" in str(e.value)

    # offsets past the end of the data, an unknown dtype, a malformed entry
    for i, entry in enumerate([
        {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]},
        {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
        {"dtype": "F32", "shape": [4]},
    ]):
        p = _raw_file(tmp_path / f"entry{i}.safetensors", {"y.w": entry}, bytes(16))
        with pytest.raises(FormatError) as e:
            SafetensorsFile(p)
        assert str(p) in str(e.value) and "y.w" in str(e.value)

    # reading a name that is not there
    with pytest.raises(FormatError, match="nope"):
        SafetensorsFile(good).read("nope")


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [-1], "data_offsets": [4, 0]},  # accepted, reads as empty
    {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]},  # accepted, read -> TypeError
    {"dtype": "F32", "shape": [2], "data_offsets": ["0", 8]},  # TypeError, not FormatError
])
def test_stfile_rejects_malformed_shape_or_offsets(tmp_path, entry):
    p = _raw_file(tmp_path / "m.safetensors", {"z.w": entry}, bytes(8))
    try:
        SafetensorsFile(p).read("z.w")
    except FormatError as e:
        assert str(p) in str(e) and "z.w" in str(e)
        return
    raise AssertionError("malformed header entry was accepted")
