"""The exact source text `mx.fast.metal_kernel` builds (MLX 0.32, mlx/backend/common/
metal_kernel.cpp: `write_signature`, `write_template`, the kernel name), written here in
Python so the emulator compiles what Metal would compile, and checked against MLX's own
`verbose=True` output in tests/test_metal_emulator.py.

What MLX prepends when it builds the library (its utils preamble) is not part of this
text; the emulator puts its shim include there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx

# Inputs with fewer elements are passed in the constant address space
MAX_CONSTANT_ARRAY_SIZE = 8

# (attribute, type) in MLX's order; one is appended when its name is a substring of the body
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

TYPE_STRINGS = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
}


def type_string(dtype) -> str:
    try:
        return TYPE_STRINGS[dtype]
    except KeyError:
        raise TypeError(f"no Metal type for {dtype}") from None


@dataclass(frozen=True)
class ArgInfo:
    """What the signature depends on for one input: its dtype, rank and size."""

    dtype: object
    ndim: int
    size: int


@dataclass(frozen=True)
class Slot:
    """One kernel parameter: a buffer slot (kind input/shape/strides/ndim/output) or a
    thread attribute (slot None)."""

    kind: str
    name: str
    ctype: str
    slot: int | None
    input_index: int | None = None
    reference: bool = False


def shape_infos(source: str, input_names) -> list[tuple[bool, bool, bool]]:
    return [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in input_names]


def attributes(source: str) -> list[tuple[str, str]]:
    return [(name, kind) for name, kind in METAL_ATTRIBUTES if name in source]


def template_value(value) -> str:
    if isinstance(value, bool):  # before int: Python bools are ints
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return type_string(value)


def template_kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    return "typename"


def template_def(template) -> str:
    return "<" + ", ".join(template_value(v) for _, v in template) + ">"


def kernel_name(name: str, inputs: list[ArgInfo], output_dtypes, template) -> str:
    out = "custom_kernel_" + name
    if template:
        hashed = re.sub(r"<|>|(, )", "_", template_def(template))[:-1]
        out += "_" + hashed
    for a in inputs:
        out += "_" + type_string(a.dtype)
        if a.ndim == 0:
            out += "s"
        elif a.size < MAX_CONSTANT_ARRAY_SIZE:
            out += "c"
    for d in output_dtypes:
        out += "_" + type_string(d)
    return out


def kernel_source(name, input_names, output_names, source, header, inputs: list[ArgInfo], output_dtypes,
                  template=(), atomic_outputs=False) -> tuple[str, str, list[Slot]]:
    """(host name, full text, parameters in order) exactly as metal_kernel builds them."""
    template = list(template or ())
    if len(inputs) != len(input_names):
        raise ValueError(f"[metal_kernel] Expected `inputs` to have size {len(input_names)} but got size {len(inputs)}.")
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    host = kernel_name(name, inputs, output_dtypes, template)
    infos = shape_infos(source, input_names)
    attrs = attributes(source)
    text = header
    if template:
        text += "template <" + ", ".join(f"{template_kind(v)} {n}" for n, v in template) + ">\n"
    text += "[[kernel]] void " + host + "(\n"
    slots: list[Slot] = []
    index = 0
    for i, (n, a) in enumerate(zip(input_names, inputs)):
        ctype = type_string(a.dtype)
        location = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if a.ndim == 0 else "*"
        text += f"  const {location} {ctype}{ref} {n} [[buffer({index})]],\n"
        slots.append(Slot("input", n, ctype, index, i, reference=a.ndim == 0))
        index += 1
        if a.ndim > 0:
            if infos[i][0]:
                text += f"  const constant int* {n}_shape [[buffer({index})]],\n"
                slots.append(Slot("shape", n + "_shape", "int", index, i))
                index += 1
            if infos[i][1]:
                text += f"  const constant int64_t* {n}_strides [[buffer({index})]],\n"
                slots.append(Slot("strides", n + "_strides", "int64_t", index, i))
                index += 1
            if infos[i][2]:
                text += f"  const constant int& {n}_ndim [[buffer({index})]],\n"
                slots.append(Slot("ndim", n + "_ndim", "int", index, i, reference=True))
                index += 1
    for i, (n, d) in enumerate(zip(output_names, output_dtypes)):
        ctype = type_string(d)
        text += "  device " + (f"atomic<{ctype}>" if atomic_outputs else ctype) + "* " + n + f" [[buffer({index})]]"
        # MLX compares the buffer slot (which counts shape/strides/ndim slots) with the
        # number of inputs + outputs: reproduced as is
        if index < len(inputs) + len(output_names) - 1 or attrs:
            text += ",\n"
        else:
            text += ") {\n"
        slots.append(Slot("output", n, f"metal::atomic<{ctype}>" if atomic_outputs else ctype, index, i))
        index += 1
    for k, (attr, kind) in enumerate(attrs):
        text += f"  {kind} {attr} [[{attr}]]"
        text += ",\n" if k < len(attrs) - 1 else ") {\n"
        slots.append(Slot("attribute", attr, kind, None))
    text += source
    text += "\n}\n"
    if template:
        tdef = host + template_def(template)
        text += f'\ntemplate [[host_name("{host}")]] [[kernel]] decltype({tdef}) {tdef};\n'
    return host, text, slots


def mlx_generated_source(name, input_names, output_names, source, *, inputs, output_shapes, output_dtypes,
                         header="", template=None, atomic_outputs=False, grid=(1, 1, 1),
                         threadgroup=(1, 1, 1)) -> str:
    """The text MLX itself generates for this call (its verbose=True output). Without Metal
    the call only builds under mx.export_function tracing, so it is traced into a
    throwaway file; MLX writes the text to the C++ stdout, captured at the fd level."""
    import os
    import sys
    import tempfile

    kernel = mx.fast.metal_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                                  source=source, header=header, atomic_outputs=atomic_outputs)
    kwargs = {"template": list(template)} if template else {}

    def call():
        return kernel(inputs=list(inputs), grid=grid, threadgroup=threadgroup, output_shapes=list(output_shapes),
                      output_dtypes=list(output_dtypes), verbose=True, **kwargs)

    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as out:
        os.dup2(out.fileno(), 1)
        try:
            mx.export_function(os.path.join(tmp, "trace.mlxfn"), call)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        text = out.read().decode()
    start = text.index("```\n") + 4
    return text[start:text.rindex("\n```")]
