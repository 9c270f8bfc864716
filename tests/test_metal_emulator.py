"""The CPU emulator for Metal kernel bodies (tests/metal_emulator): it builds the text
MLX builds, runs threads as fibers with Metal's launch rules, and catches the bugs that
matter for our kernels: wrong indices, missing barriers, wrong SIMD reductions."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from metal_emulator import EmulatorError, OutOfBounds, kernel_source, requires_emulator, run
from metal_emulator.mlx_source import ArgInfo, mlx_generated_source

pytestmark = requires_emulator

SCHEDULES = ("forward", "reverse", "random")


def f32(x):
    return np.array(x.astype(mx.float32)) if x.dtype != mx.float32 else np.array(x)


# ------------------------------------------------------------------ the source text


def _infos(inputs):
    out = []
    for x in inputs:
        a = x if isinstance(x, mx.array) else mx.array(x)
        out.append(ArgInfo(a.dtype, a.ndim, a.size))
    return out


def _same_text(name, input_names, output_names, source, inputs, output_shapes, output_dtypes, **kw):
    _, ours, _ = kernel_source(name, input_names, output_names, source, kw.get("header", ""), _infos(inputs),
                               output_dtypes, kw.get("template"), kw.get("atomic_outputs", False))
    theirs = mlx_generated_source(name, input_names, output_names, source, inputs=inputs,
                                  output_shapes=output_shapes, output_dtypes=output_dtypes, **kw)
    assert ours == theirs
    return ours


def test_signature_matches_mlx_for_every_dtype_and_rule():
    dtypes = [mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32, mx.int64,
              mx.float16, mx.bfloat16, mx.float32]
    inputs = [mx.zeros((8,), d) for d in dtypes]
    inputs[0] = mx.zeros((7,), mx.bool_)  # fewer than 8 elements: constant address space
    inputs[4] = mx.array(3, mx.uint64)  # 0-d: a reference, and never a _shape even when named
    names = [f"x{i}" for i in range(len(dtypes))]
    source = ("uint3 a = thread_position_in_grid; uint l = thread_index_in_simdgroup; // x3_shape x4_shape\n"
              "x4_strides; x5_ndim; dispatch_threads_per_threadgroup; x0_shape; x11_strides; x11_ndim;")
    text = _same_text("probe", names + ["s1", "s2", "s3"], ["o1", "o2"], source, inputs + [1, 2.5, True],
                      [(3,), (2, 2)], [mx.float32, mx.int32], header="// header\n",
                      template=[("T", mx.bfloat16), ("N", 3), ("B", True), ("C", False)], atomic_outputs=True)
    assert "const constant bool* x0 [[buffer(0)]]" in text
    assert "const constant uint64_t& x4 [[buffer(6)]]" in text and "x4_strides [[" not in text
    assert "const constant int32_t& s1" in text and "const constant float& s2" in text
    assert "const constant bool& s3" in text
    assert "x3_shape [[buffer(5)]]" in text  # a comment naming it is enough
    assert "device atomic<int32_t>* o2" in text
    assert "template <typename T, int N, bool B, bool C>" in text and "<bfloat16_t, 3, 1, 0>;" in text
    # dispatch_threads_per_threadgroup contains threads_per_threadgroup: both are appended
    assert "uint3 threads_per_threadgroup [[threads_per_threadgroup]]" in text


def test_signature_matches_mlx_quirks():
    # no template, no thread attribute and a named _shape: MLX closes the parameter
    # list after the first output (its slot counter includes the shape slot)
    x = mx.zeros((16,))
    text = _same_text("quirk", ["x"], ["o", "p"], "o[0] = x[x_shape[0] - 1];", [x], [(1,), (1,)],
                      [mx.float32, mx.float32])
    assert "device float* o [[buffer(2)]]) {" in text
    # a header without a trailing newline runs into the next line
    text = _same_text("glued", ["x"], ["o"], "o[0] = x[0];", [x], [(1,)], [mx.float32], header="// note",
                      template=[("T", mx.float32)])
    assert text.startswith("// notetemplate <typename T>")


def test_edge_threadgroups_and_thread_attributes():
    source = """
    uint3 p = thread_position_in_grid;
    uint i = p.x + p.y * threads_per_grid.x;
    out[i * 6 + 0] = threadgroup_position_in_grid.x;
    out[i * 6 + 1] = threadgroup_position_in_grid.y;
    out[i * 6 + 2] = threads_per_threadgroup.x * 100 + threads_per_threadgroup.y;
    out[i * 6 + 3] = thread_index_in_threadgroup;
    out[i * 6 + 4] = simdgroup_index_in_threadgroup * 100 + thread_index_in_simdgroup;
    out[i * 6 + 5] = threadgroups_per_grid.x * 100 + dispatch_threads_per_threadgroup.x;
    """
    gx, gy, tx, ty = 100, 3, 48, 2
    out, = run("attrs", [], ["out"], source, inputs=[], grid=(gx, gy, 1), threadgroup=(tx, ty, 1),
               output_shapes=[(gx * gy, 6)], output_dtypes=[mx.uint32])
    out = np.array(out).reshape(gy, gx, 6)
    for y in range(gy):
        for x in range(gx):
            bx, by = x // tx, y // ty
            ax, ay = min(tx, gx - bx * tx), min(ty, gy - by * ty)  # edge groups are smaller
            lin = (x - bx * tx) + (y - by * ty) * ax
            assert list(out[y, x]) == [bx, by, ax * 100 + ay, lin, (lin // 32) * 100 + lin % 32, 3 * 100 + tx]


def test_threadgroup_clamped_to_grid_and_limits():
    src = "out[thread_position_in_grid.x] = threads_per_threadgroup.x;"
    out, = run("clamp", [], ["out"], src, inputs=[], grid=(5, 1, 1), threadgroup=(256, 1, 1),
               output_shapes=[(5,)], output_dtypes=[mx.uint32])
    assert np.array(out).tolist() == [5] * 5
    with pytest.raises(EmulatorError, match="more than 1024"):
        run("big", [], ["out"], src, inputs=[], grid=(2048, 1, 1), threadgroup=(1025, 1, 1), output_shapes=[(2048,)],
            output_dtypes=[mx.uint32])
    with pytest.raises(EmulatorError, match="32 KB"):
        run("tgmem", [], ["out"], "threadgroup float big[9000]; uint i = thread_position_in_grid.x; big[i] = 1;"
            "threadgroup_barrier(mem_flags::mem_threadgroup); out[i] = big[8999 - i];", inputs=[],
            grid=(9000, 1, 1), threadgroup=(1024, 1, 1), output_shapes=[(9000,)], output_dtypes=[mx.float32])
    names = [f"x{i}" for i in range(16)]
    with pytest.raises(EmulatorError, match="at most 31"):
        run("many", names, ["out"], "out[0] = 0; " + " ".join(f"{n}_shape;" for n in names),
            inputs=[mx.zeros((8,))] * 16, grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
            output_dtypes=[mx.float32])


def test_scalars_small_inputs_shapes_and_templates():
    source = """
    uint i = thread_position_in_grid.x;
    if (i >= uint(x_shape[0] * x_shape[1])) return;
    int row = int(i) / x_shape[1], col = int(i) % x_shape[1];
    float v = float(x[row * x_strides[0] + col * x_strides[1]]) * scale + float(bias[col % 3]) + float(x_ndim);
    out[i] = static_cast<T>(flip ? -v : v) + static_cast<T>(N) + static_cast<T>(HALVE ? -0.5f : 0.0f);
    """
    x = mx.arange(40, dtype=mx.float32).reshape(5, 8).astype(mx.bfloat16)
    bias = mx.array([1.0, 2.0, 3.0])
    for flip in (False, True):
        out, = run("scal", ["x", "scale", "bias", "flip"], ["out"], source, inputs=[x, 0.5, bias, flip],
                   template=[("T", mx.float16), ("N", 7), ("HALVE", flip)], grid=(64, 1, 1), threadgroup=(32, 1, 1),
                   output_shapes=[(40,)], output_dtypes=[mx.float16])
        v = np.arange(40, dtype=np.float32) * 0.5 + np.tile([1, 2, 3], 14)[:40][np.arange(40) % 8 % 3] + 2
        assert out.dtype == mx.float16
        want = (-v if flip else v).astype(np.float16).astype(np.float32) + 7 - (0.5 if flip else 0)
        np.testing.assert_array_equal(f32(out), want)
    _, text, _ = kernel_source("scal", ["x", "scale", "bias", "flip"], ["out"], source, "",
                               _infos([x, 0.5, bias, flip]), [mx.float16],
                               [("T", mx.float16), ("N", 7), ("HALVE", True)])
    assert "template <typename T, int N, bool HALVE>" in text and "<float16_t, 7, 1>;" in text
    assert "const constant float* bias" in text and "const constant float& scale" in text


def test_half_and_bfloat_round_to_nearest_even():
    values = np.array([1.0, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 65519.0, 65520.0, 1e-8,
                       6e-8, 3e-5, -2.5, 3.0e38, np.inf, -np.inf, 1 + 2 ** -9 + 2 ** -20], np.float32)
    source = """
    uint i = thread_position_in_grid.x;
    h[i] = static_cast<half>(x[i]);
    b[i] = static_cast<bfloat16_t>(x[i]);
    hb[i] = float(h[i]) + float(b[i]);
    """
    h, b, hb = run("rne", ["x"], ["h", "b", "hb"], source, inputs=[mx.array(values)], grid=(len(values), 1, 1),
                   threadgroup=(32, 1, 1), output_shapes=[values.shape] * 3,
                   output_dtypes=[mx.float16, mx.bfloat16, mx.float32])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(np.array(h), values.astype(np.float16))
    np.testing.assert_array_equal(np.array(b.view(mx.uint16)), np.array(mx.array(values).astype(mx.bfloat16)
                                                                          .view(mx.uint16)))
    np.testing.assert_array_equal(np.array(hb), f32(h) + f32(b))


SIMD_SOURCE = """
    uint i = thread_position_in_grid.x;
    float v = x[i];
    out[i * 9 + 0] = simd_sum(v);
    out[i * 9 + 1] = simd_max(v);
    out[i * 9 + 2] = simd_min(v);
    out[i * 9 + 3] = simd_prefix_inclusive_sum(v);
    out[i * 9 + 4] = simd_prefix_exclusive_sum(v);
    out[i * 9 + 5] = simd_shuffle_down(v, 3);
    out[i * 9 + 6] = simd_shuffle_up(v, 5);
    out[i * 9 + 7] = simd_shuffle_xor(v, 1);
    out[i * 9 + 8] = simd_broadcast(v, 2);
"""


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_simd_collectives(schedule):
    n = 72  # one threadgroup of 72: simdgroups of 32, 32 and 8 lanes
    x = np.arange(n, dtype=np.float32) * 0.25 - 3
    out, = run("simd", ["x"], ["out"], SIMD_SOURCE, inputs=[mx.array(x)], grid=(n, 1, 1), threadgroup=(128, 1, 1),
               output_shapes=[(n, 9)], output_dtypes=[mx.float32], schedule=schedule, seed=3)
    out = np.array(out)
    for i in range(n):
        lo = i // 32 * 32
        g = x[lo:min(lo + 32, n)]
        lane = i - lo
        # a source lane past the SIMD width keeps the own value; an inactive lane is undefined
        down = x[i] if lane + 3 >= 32 else g[lane + 3] if lane + 3 < len(g) else out[i, 5]
        want = [g.sum(), g.max(), g.min(), g[:lane + 1].sum(), g[:lane].sum(), down,
                g[lane - 5] if lane >= 5 else x[i], g[lane ^ 1], g[2]]
        np.testing.assert_allclose(out[i], want, rtol=1e-6, err_msg=f"thread {i}")


def test_atomic_outputs():
    src = """
    uint i = thread_position_in_grid.x;
    atomic_fetch_add_explicit(&hist[uint(x[i]) % 5], 1, memory_order_relaxed);
    atomic_fetch_max_explicit(&hist[5], int(x[i]), memory_order_relaxed);
    """
    x = np.random.default_rng(2).integers(0, 50, 300)
    hist, = run("hist", ["x"], ["hist"], src, inputs=[mx.array(x.astype(np.float32))], grid=(300, 1, 1),
                threadgroup=(64, 1, 1), output_shapes=[(6,)], output_dtypes=[mx.int32], init_value=0,
                atomic_outputs=True)
    assert np.array(hist).tolist() == np.bincount(x % 5, minlength=5).tolist() + [x.max()]


@pytest.mark.parametrize("template", [None, [("T", mx.float32), ("N", 4)]])
def test_threadgroup_memory_starts_poisoned_in_every_threadgroup(template):
    # a template kernel's statics are not placed like a plain function's: both are found
    src = """
    threadgroup float buf[64];
    uint i = thread_position_in_threadgroup.x;
    out[thread_position_in_grid.x] = buf[i];
    buf[i] = 1.0f;
    """
    out, = run("poison", [], ["out"], src, inputs=[], grid=(128, 1, 1), threadgroup=(64, 1, 1),
               output_shapes=[(128,)], output_dtypes=[mx.float32], template=template)
    assert np.isnan(np.array(out)).all()


def test_init_value_and_unwritten_outputs():
    src = "if (thread_position_in_grid.x % 2 == 0) out[thread_position_in_grid.x] = 1.0f;"
    out, = run("init", [], ["out"], src, inputs=[], grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8,)],
               output_dtypes=[mx.float32], init_value=5.0)
    assert np.array(out).tolist() == [1, 5] * 4
    out, = run("init", [], ["out"], src, inputs=[], grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8,)],
               output_dtypes=[mx.float32])
    assert np.isnan(np.array(out)[1::2]).all()  # uninitialized outputs read as NaN here


# ------------------------------------------------------------------ what it catches: wrong indices

COPY = "uint i = thread_position_in_grid.x; out[{dst}] = inp[{src}];"


def _copy(src_index, dst_index, n=100, **kw):
    x = mx.arange(n, dtype=mx.float32)
    return run("copy", ["inp"], ["out"], COPY.format(src=src_index, dst=dst_index), inputs=[x], grid=(n, 1, 1),
               threadgroup=(32, 1, 1), output_shapes=[(n,)], output_dtypes=[mx.float32], **kw)[0]


def test_catches_read_past_the_end():
    assert np.array(_copy("i", "i")).tolist() == list(range(100))
    with pytest.raises(OutOfBounds, match=r"buffer 'inp' .*past the end; element 100 of 100"):
        _copy("i + 1", "i")


def test_catches_read_before_the_start():
    with pytest.raises(OutOfBounds, match=r"'inp' .*before the start"):
        _copy("int(i) - 1", "i", align="start")
    # the same bug with uint arithmetic wraps to element 2^32 - 1
    with pytest.raises(OutOfBounds, match=r"far past buffer 'inp'.*element 4294967295 of 100"):
        _copy("i - 1", "i")


def test_catches_write_past_the_end_by_fault_or_canary():
    with pytest.raises(OutOfBounds, match="'out'"):
        _copy("i", "i + 1")  # flush against the guard page: faults
    with pytest.raises(OutOfBounds, match="canary"):
        _copy("i", "i + 1", align="start")  # inside the last page: the canary catches it


def test_catches_wrong_element():
    # a transposed index stays in bounds: the result is what gives it away
    x = mx.arange(24, dtype=mx.float32).reshape(4, 6)
    src = "uint r = thread_position_in_grid.y, c = thread_position_in_grid.x; out[r * 6 + c] = inp[{}];"
    good, = run("t", ["inp"], ["out"], src.format("r * 6 + c"), inputs=[x], grid=(6, 4, 1), threadgroup=(4, 4, 1),
                output_shapes=[(4, 6)], output_dtypes=[mx.float32])
    bad, = run("t", ["inp"], ["out"], src.format("c * 4 + r"), inputs=[x], grid=(6, 4, 1), threadgroup=(4, 4, 1),
               output_shapes=[(4, 6)], output_dtypes=[mx.float32])
    assert mx.array_equal(good, x)
    assert not mx.array_equal(bad, x)


# ------------------------------------------------------------------ missing barriers

REDUCE = """
    threadgroup float partial[32];
    uint tid = thread_position_in_threadgroup.x;
    float s = simd_sum(x[thread_position_in_grid.x]);
    if (thread_index_in_simdgroup == 0) partial[simdgroup_index_in_threadgroup] = s;
    {barrier}
    float total = 0.0f;
    for (uint i = 0; i < simdgroups_per_threadgroup; ++i) total += partial[i];
    out[thread_position_in_grid.x] = total;
"""

NEIGHBOUR = """
    threadgroup float buf[256];
    uint tid = thread_position_in_threadgroup.x;
    buf[tid] = x[thread_position_in_grid.x] * 2.0f;
    {barrier}
    out[thread_position_in_grid.x] = buf[(tid + {shift}) % threads_per_threadgroup.x];
"""
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def _run_tg(source, schedule, n=256, tg=128):
    x = mx.array(np.random.default_rng(1).standard_normal(n).astype(np.float32))
    out, = run("tg", ["x"], ["out"], source, inputs=[x], grid=(n, 1, 1), threadgroup=(tg, 1, 1),
               output_shapes=[(n,)], output_dtypes=[mx.float32], schedule=schedule, seed=7)
    return np.array(x), np.array(out)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_catches_missing_barrier_in_a_reduction(schedule):
    x, out = _run_tg(REDUCE.format(barrier=BARRIER), schedule)
    want = np.repeat(x.reshape(2, 128).sum(axis=1), 128)
    np.testing.assert_allclose(out, want, rtol=1e-5)
    _, out = _run_tg(REDUCE.format(barrier=""), schedule)
    assert not np.allclose(out, want, rtol=1e-3, equal_nan=False)  # stale (poisoned) partial sums


@pytest.mark.parametrize("shift", [1, 127])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_catches_missing_barrier_between_neighbours(schedule, shift):
    # a thread that runs before the writer of the slot it reads sees poisoned memory:
    # every order has such a pair here (the read wraps around the threadgroup)
    x, out = _run_tg(NEIGHBOUR.format(barrier=BARRIER, shift=shift), schedule)
    tid = np.arange(256) % 128
    want = x[(np.arange(256) - tid) + (tid + shift) % 128] * 2
    np.testing.assert_array_equal(out, want)
    _, out = _run_tg(NEIGHBOUR.format(barrier="", shift=shift), schedule)
    assert not np.array_equal(out, want)


def test_catches_barrier_in_divergent_code():
    src = """
    uint tid = thread_position_in_threadgroup.x;
    if (tid < 16) {{ {} }}
    out[thread_position_in_grid.x] = x[thread_position_in_grid.x];
    """
    with pytest.raises(EmulatorError, match="threadgroup_barrier reached by 16 of 64 threads"):
        _run_tg(src.format(BARRIER), "forward", n=64, tg=64)
    src = """
    uint tid = thread_position_in_threadgroup.x;
    if (tid < 16) { threadgroup_barrier(mem_flags::mem_threadgroup); }
    else { threadgroup_barrier(mem_flags::mem_threadgroup); threadgroup_barrier(mem_flags::mem_threadgroup); }
    out[thread_position_in_grid.x] = x[thread_position_in_grid.x];
    """
    with pytest.raises(EmulatorError, match="barrier"):
        _run_tg(src, "forward", n=64, tg=64)


def test_catches_divergent_simd_collectives():
    src = """
    uint lane = thread_index_in_simdgroup;
    float v = x[thread_position_in_grid.x];
    float s = lane < 8 ? simd_max(v) : simd_sum(v);
    out[thread_position_in_grid.x] = s;
    """
    with pytest.raises(EmulatorError, match="divergent SIMD"):
        _run_tg(src, "forward", n=64, tg=64)


# ------------------------------------------------------------------ wrong SIMD reductions

SHUFFLE_SUM = """
    float v = x[thread_position_in_grid.x];
    for (ushort delta = {start}; delta > 0; delta /= 2) v += simd_shuffle_{direction}(v, delta);
    out[thread_position_in_grid.x] = {read};
"""


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_catches_wrong_simd_reduction(schedule):
    def total(start, direction="xor", read="v"):
        x, out = _run_tg(SHUFFLE_SUM.format(start=start, direction=direction, read=read), schedule)
        return x.reshape(-1, 32).sum(axis=1), out.reshape(-1, 32)

    want, out = total(16)  # butterfly: every lane ends with the SIMD group's sum
    np.testing.assert_allclose(out, np.repeat(want[:, None], 32, axis=1), rtol=1e-5)
    want, out = total(16, "down", "simd_broadcast(v, 0)")  # shuffle-down tree: lane 0 has it
    np.testing.assert_allclose(out, np.repeat(want[:, None], 32, axis=1), rtol=1e-5)
    want, out = total(8)  # one step short: sums of 16 lanes only
    assert not np.allclose(out, np.repeat(want[:, None], 32, axis=1), rtol=1e-3)
    want, out = total(16, "up", "simd_broadcast(v, 0)")  # wrong direction: lane 0 never sees the others
    assert not np.allclose(out, np.repeat(want[:, None], 32, axis=1), rtol=1e-3)
    x, out = _run_tg("out[thread_position_in_grid.x] = simd_max(x[thread_position_in_grid.x]);", schedule)
    assert not np.allclose(out.reshape(-1, 32), np.repeat(x.reshape(-1, 32).sum(axis=1)[:, None], 32, axis=1))


def test_compile_errors_are_reported():
    with pytest.raises(EmulatorError, match="does not compile"):
        run("broken", [], ["out"], "out[0] = undefined_name;", inputs=[], grid=(1, 1, 1), threadgroup=(1, 1, 1),
            output_shapes=[(1,)], output_dtypes=[mx.float32])
