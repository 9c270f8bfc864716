"""Compile a metal_kernel call as C++ and run it on the CPU.

`run(...)` takes what `mx.fast.metal_kernel(...)(...)` takes. It builds the text MLX
would build (mlx_source.py), puts the shim include where MLX's preamble goes, appends a
launcher, compiles it with g++ -O1 into a shared library cached by source hash, and
calls it through ctypes on buffers it lays out itself:

- every buffer (inputs, shape/strides/ndim, outputs) sits in its own mapping between
  PROT_NONE guard regions (4x its size), flush against the upper guard (`align="end"`,
  catches reads and writes past the end) or the lower one (`align="start"`, before the
  start); the slack in the last page is a canary checked after the run (writes that stay
  inside the page);
- inputs are read-only; outputs start as 0xff bytes (NaN / -1) unless `init_value`;
- the kernel's threadgroup arrays (its function-local statics, found in the library's
  symbol table: GCC ignores section attributes on a template's statics) are refilled
  with 0xff bytes before every threadgroup;
- a fault is reported with the buffer and element it hit.
Threads run as fibers (runtime.h), scheduled "forward", "reverse" or "random" (seeded).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .buffers import POISON, Guarded, fiber_stacks
from .mlx_source import ArgInfo, kernel_source, template_value

HERE = Path(__file__).resolve().parent
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ["-std=c++17", "-O1", "-fPIC", "-shared", "-Wno-attributes", "-fno-strict-aliasing"]
MAX_BUFFERS = 31
SCHEDULES = {"forward": 0, "reverse": 1, "random": 2}

STORAGE = {  # numpy storage of each MLX dtype (bfloat16 as its bits)
    mx.bool_: np.bool_, mx.uint8: np.uint8, mx.uint16: np.uint16, mx.uint32: np.uint32, mx.uint64: np.uint64,
    mx.int8: np.int8, mx.int16: np.int16, mx.int32: np.int32, mx.int64: np.int64, mx.float16: np.float16,
    mx.bfloat16: np.uint16, mx.float32: np.float32,
}
FROM_NUMPY = {np.dtype(v): k for k, v in STORAGE.items() if k != mx.bfloat16}

_loaded: dict[str, ctypes.CDLL] = {}


class EmulatorError(RuntimeError):
    """The kernel failed to compile, faulted, or broke a Metal rule while running."""


class OutOfBounds(EmulatorError):
    """A thread touched memory outside a buffer (guard page or canary)."""


def cache_dir() -> Path:
    root = os.environ.get("MONOLITH_EMULATOR_CACHE")
    path = Path(root) if root else Path(tempfile.gettempdir()) / f"monolith-metal-emulator-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compiler_id() -> str:
    if "id" not in _compiler_id.__dict__:
        try:
            out = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise EmulatorError(f"the Metal emulator needs a C++ compiler ({CXX}): {e}") from None
        _compiler_id.id = out.splitlines()[0]
    return _compiler_id.id


def compile_unit(text: str) -> ctypes.CDLL:
    """g++ -O1 the translation unit into a shared library, cached by its hash."""
    shim = (HERE / "metal_shim.h").read_text() + (HERE / "runtime.h").read_text()
    key = hashlib.sha256("\0".join([text, shim, " ".join(CXXFLAGS), _compiler_id()]).encode()).hexdigest()[:32]
    lib_path = cache_dir() / f"{key}.so"
    if str(lib_path) in _loaded:
        return _loaded[str(lib_path)]
    if not lib_path.exists():
        src = cache_dir() / f"{key}.cpp"
        src.write_text(text)
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run([CXX, *CXXFLAGS, "-I", str(HERE), "-o", str(tmp), str(src)], capture_output=True,
                              text=True, check=False)
        if proc.returncode:
            raise EmulatorError(f"the kernel does not compile as C++ ({src}):\n{proc.stderr[-6000:]}")
        os.replace(tmp, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    lib.mlxemu_entry.restype = ctypes.c_int
    lib.mlxemu_entry.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint),
                                 ctypes.POINTER(ctypes.c_uint), ctypes.c_int, ctypes.c_uint, ctypes.c_void_p,
                                 ctypes.c_uint, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int, ctypes.c_char_p,
                                 ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
    _loaded[str(lib_path)] = lib
    return lib


def threadgroup_memory(lib: ctypes.CDLL, host: str) -> list[tuple[int, int]]:
    """(address, size) of every function-local static of the kernel `host` (its threadgroup
    arrays): read from the library's symbol table, relocated by the entry point's address."""
    if not hasattr(lib, "_mlxemu_tg"):
        out = subprocess.run(["nm", "-S", "-C", "--defined-only", lib._name], capture_output=True, text=True,
                             check=False)
        if out.returncode:
            raise EmulatorError(f"nm failed on {lib._name}: {out.stderr}")
        symbols = {}
        for line in out.stdout.splitlines():
            parts = line.split(maxsplit=3)
            if len(parts) == 4:
                symbols.setdefault(parts[3], []).append((int(parts[0], 16), int(parts[1], 16), parts[2]))
        entry = next(value for value, _, _ in symbols["mlxemu_entry"])
        load = ctypes.cast(lib.mlxemu_entry, ctypes.c_void_p).value - entry
        lib._mlxemu_tg = [(load + value, size) for name, entries in symbols.items()
                          if name.startswith(host) and ")::" in name
                          for value, size, kind in entries if kind.lower() in "bdvu" and size]
    return lib._mlxemu_tg


def launcher(host: str, call: str, slots) -> str:
    """The C++ after MLX's text: one fiber entry that calls the kernel with every slot."""
    args = []
    for s in slots:
        if s.kind == "attribute":
            args.append(f"f->a.{s.name}")
        elif s.kind == "output":
            args.append(f"reinterpret_cast<{s.ctype}*>(b[{s.slot}])")
        elif s.reference:
            args.append(f"*reinterpret_cast<const {s.ctype}*>(b[{s.slot}])")
        else:
            args.append(f"reinterpret_cast<const {s.ctype}*>(b[{s.slot}])")
    joined = ",\n      ".join(args)
    return f"""
// ---- metal emulator launcher ----
#include "runtime.h"
static void** mlxemu_buffers;
static void mlxemu_thread(mlxemu::Fiber* f) {{
  void** b = mlxemu_buffers;
  (void)b;
  {call}(
      {joined});
}}
extern "C" int mlxemu_entry(void** buffers, const unsigned* grid, const unsigned* tg, int schedule, unsigned seed,
                            char* stacks, unsigned stack_kb, const uint64_t* regions, int nregions, char* err,
                            int errlen, uint64_t* fault) {{
  mlxemu_buffers = buffers;
  return mlxemu::launch(mlxemu_thread, grid, tg, schedule, seed, stacks, stack_kb, regions, nregions, err, errlen,
                        fault);
}}
"""


def emulation_unit(name, input_names, output_names, source, header, inputs: list[ArgInfo], output_dtypes,
                   template=(), atomic_outputs=False) -> tuple[str, list, str]:
    """(C++ text, slots, host name): the shim include in place of MLX's preamble, MLX's
    text verbatim, the launcher."""
    host, text, slots = kernel_source(name, input_names, output_names, source, header, inputs, output_dtypes,
                                      template, atomic_outputs)
    n_buffers = sum(1 for s in slots if s.slot is not None)
    if n_buffers > MAX_BUFFERS:
        raise EmulatorError(f"{n_buffers} buffers: Metal binds at most {MAX_BUFFERS}")
    call = host + ("<" + ", ".join(template_value(v) for _, v in template) + ">" if template else "")
    unit = '#include "metal_shim.h"\n' + text + launcher(host, call, slots)
    return unit, slots, host


# ------------------------------------------------------------------ running


@dataclass
class _Input:
    array: np.ndarray  # storage dtype
    dtype: object  # MLX dtype


def _as_input(x) -> _Input:
    if isinstance(x, bool):
        return _Input(np.array(x, np.bool_), mx.bool_)
    if isinstance(x, int):
        return _Input(np.array(x, np.int32), mx.int32)
    if isinstance(x, float):
        return _Input(np.array(x, np.float32), mx.float32)
    if isinstance(x, mx.array):
        raw = x.view(mx.uint16) if x.dtype == mx.bfloat16 else x
        return _Input(np.array(raw), x.dtype)
    arr = np.asarray(x)
    if arr.dtype not in FROM_NUMPY:
        raise TypeError(f"no MLX dtype for numpy {arr.dtype}")
    return _Input(arr, FROM_NUMPY[arr.dtype])


def _to_mx(arr: np.ndarray, dtype) -> mx.array:
    out = mx.array(np.ascontiguousarray(arr))
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def run(name, input_names, output_names, source, *, inputs, grid, threadgroup, output_shapes, output_dtypes,
        header="", template=None, init_value=None, ensure_row_contiguous=True, atomic_outputs=False,
        schedule="forward", seed=0, align="end", stack_kb=64) -> list[mx.array]:
    """Run one metal_kernel call on the CPU; returns the outputs as MLX arrays."""
    _check_arguments(input_names, output_names, inputs, output_shapes, output_dtypes, schedule, align)
    ins = [_as_input(x) for x in inputs]
    infos = [ArgInfo(i.dtype, i.array.ndim, i.array.size) for i in ins]
    template = list(template or [])
    unit, slots, host = emulation_unit(name, input_names, output_names, source, header, infos, output_dtypes,
                                       template, atomic_outputs)
    lib = compile_unit(unit)

    buffers: list[Guarded] = []
    pointers = (ctypes.c_void_p * max(1, sum(1 for s in slots if s.slot is not None)))()
    outputs = []
    try:
        prepared = [_prepare_input(x.array, ensure_row_contiguous) for x in ins]
        for s in slots:
            if s.slot is None:
                continue
            if s.kind == "output":
                dtype = output_dtypes[s.input_index]
                g, storage, shape = _output_buffer(s.name, dtype, output_shapes[s.input_index], align, init_value)
                outputs.append((g, storage, shape, dtype))
            else:
                g = _input_buffer(s, prepared, align)
            buffers.append(g)
            pointers[s.slot] = g.address
        rc, err, fault = _launch(lib, host, pointers, grid, threadgroup, schedule, seed, stack_kb)
        if rc == 2:
            _raise_fault(name, fault, buffers, stack_kb)
        if rc:
            raise EmulatorError(f"{name}: {err.value.decode(errors='replace')}")
        bad = [b.name for b in buffers if not b.canary_ok()]
        if bad:
            raise OutOfBounds(f"{name}: a thread wrote outside buffer(s) {', '.join(bad)} (canary overwritten)")
        return [_to_mx(g.view(storage, shape).copy(), dtype) for g, storage, shape, dtype in outputs]
    finally:
        for b in buffers:
            b.close()


def _check_arguments(input_names, output_names, inputs, output_shapes, output_dtypes, schedule, align) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}")
    if align not in ("end", "start"):
        raise ValueError('align must be "end" or "start"')
    if len(inputs) != len(input_names):
        raise ValueError(f"{len(inputs)} inputs for {len(input_names)} input names")
    if len(output_shapes) != len(output_names) or len(output_dtypes) != len(output_names):
        raise ValueError("output_shapes and output_dtypes need one entry per output name")


def _prepare_input(arr: np.ndarray, ensure_row_contiguous: bool) -> tuple[np.ndarray, list[int]]:
    """(contiguous storage array or strided source, element strides) of one input."""
    if ensure_row_contiguous or arr.flags.c_contiguous or arr.ndim == 0:
        arr = np.ascontiguousarray(arr)
        return arr, _row_strides(arr.shape)
    if any(s < 0 for s in arr.strides):
        raise EmulatorError("inputs with negative strides are not emulated")
    return arr, [s // arr.itemsize for s in arr.strides]


def _input_buffer(s, prepared, align: str) -> Guarded:
    """The read-only buffer of an input slot: the input's elements, or its shape, strides or ndim."""
    arr, strides = prepared[s.input_index]
    if s.kind == "input":
        span = 1 + sum((n - 1) * st for n, st in zip(arr.shape, strides)) if arr.size else 0
        g = Guarded(s.name, span * arr.itemsize, arr.itemsize, align, 0)
        if arr.size:
            g.view(arr.dtype, arr.shape, [st * arr.itemsize for st in strides])[...] = arr
    else:  # "shape", "strides" or "ndim"
        values = {"shape": np.array(arr.shape, np.int32), "strides": np.array(strides, np.int64),
                  "ndim": np.array(arr.ndim, np.int32)}[s.kind]
        g = Guarded(s.name, values.nbytes, values.itemsize, align, 0)
        g.view(values.dtype, values.shape)[...] = values
    g.read_only()
    return g


def _output_buffer(name: str, dtype, shape, align: str, init_value) -> tuple[Guarded, np.dtype, tuple]:
    """An output buffer, poisoned or filled with init_value; with its storage dtype and shape."""
    storage = np.dtype(STORAGE[dtype])
    shape = tuple(shape)
    count = int(np.prod(shape, dtype=np.int64))
    g = Guarded(name, count * storage.itemsize, storage.itemsize, align, POISON)
    if init_value is not None:
        fill = np.array(init_value, np.float32)
        fill = mx.array(fill).astype(dtype)
        g.view(storage, shape)[...] = np.array(fill.view(mx.uint16) if dtype == mx.bfloat16 else fill)
    return g, storage, shape


def _launch(lib, host, pointers, grid, threadgroup, schedule: str, seed: int, stack_kb: int):
    """Call the compiled entry point; returns (rc, error text buffer, fault words)."""
    grid3 = (ctypes.c_uint * 3)(*[int(v) for v in grid])
    tg3 = (ctypes.c_uint * 3)(*[int(v) for v in threadgroup])
    err = ctypes.create_string_buffer(1024)
    fault = (ctypes.c_uint64 * 3)()
    regions = threadgroup_memory(lib, host)
    flat = (ctypes.c_uint64 * max(1, 2 * len(regions)))(*[v for r in regions for v in r])
    rc = lib.mlxemu_entry(pointers, grid3, tg3, SCHEDULES[schedule], int(seed) & 0xFFFFFFFF,
                          fiber_stacks(int(stack_kb)), int(stack_kb), flat, len(regions), err, len(err), fault)
    return rc, err, fault


def _raise_fault(name: str, fault, buffers: list[Guarded], stack_kb: int) -> None:
    """A thread faulted: name the fiber stack or the buffer (and byte) it ran off."""
    signal, address, in_stack = int(fault[0]), int(fault[1]), bool(fault[2])
    if in_stack:
        raise EmulatorError(f"signal {signal}: a thread overflowed its {stack_kb} KB fiber stack")
    where = next((d for d in (b.describe(address) for b in buffers) if d), None)
    if where:
        raise OutOfBounds(f"{name}: out-of-bounds access at {where} (signal {signal})")
    below = [b for b in buffers if b.address <= address]
    if below:  # e.g. a uint index that wrapped around
        near = max(below, key=lambda b: b.address)
        rel = address - near.address
        raise OutOfBounds(f"{name}: out-of-bounds access far past buffer {near.name!r}: byte {rel} "
                          f"(element {rel // near.itemsize} of {near.nbytes // near.itemsize}; signal {signal})")
    raise EmulatorError(f"{name}: signal {signal} at address {address:#x} (outside every buffer)")


def _row_strides(shape) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return list(reversed(strides))
