"""monolith.kernels: every Metal kernel, run by the CPU emulator, matches its MLX
reference; the references are drop-ins for the model's ops; the backend choice; the
bodies ship with the package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from metal_emulator import kernel_source, requires_emulator, run_kernel
from metal_emulator.kernel_cases import (
    CASES,
    as_list,
    assert_matches,
    check_case,
    f32,
    normal,
    public_order,
    replay_tape,
)
from metal_emulator.mlx_source import ArgInfo, mlx_generated_source

from monolith import kernels
from monolith.kernels import (
    KERNELS,
    add_norm,
    attention,
    combine,
    embedding,
    gated_norm,
    premix,
    replay,
    router,
)
from monolith.kernels.source import find_body
from monolith.runtime.prefill import prefill

REPO = Path(__file__).resolve().parents[1]


@requires_emulator
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kernel_matches_reference_under_emulator(case):
    args = case.make(np.random.default_rng(CASES.index(case)))
    module = case.module
    check_case(case, public_order(module, run_kernel(module.KERNEL, module.launch(*args))),
               as_list(module.reference(*args)))


@requires_emulator
@pytest.mark.parametrize("schedule", ["reverse", "random"])
@pytest.mark.parametrize("kernel", ["premix", "gated_norm", "router", "attention", "add_norm", "combine", "replay"])
def test_kernels_with_barriers_or_collectives_under_other_schedules(kernel, schedule):
    case = next(c for c in CASES if c.kernel == kernel)
    args = case.make(np.random.default_rng(11))
    module = case.module
    check_case(case, public_order(module, run_kernel(module.KERNEL, module.launch(*args), schedule=schedule, seed=5)),
               as_list(module.reference(*args)))


@requires_emulator
@pytest.mark.parametrize("kernel", ["embedding", "premix", "gated_norm", "add_norm", "combine"])
def test_kernels_stay_in_bounds_from_below(kernel):
    case = next(c for c in CASES if c.kernel == kernel)
    args = case.make(np.random.default_rng(12))
    module = case.module
    check_case(case, public_order(module, run_kernel(module.KERNEL, module.launch(*args), align="start")),
               as_list(module.reference(*args)))


@requires_emulator
def test_router_needs_its_barrier():
    """The router's round barrier is load-bearing: without it the emulator sees stale
    per-SIMD-group winners (and the double buffer alone does not save it)."""
    case = next(c for c in CASES if c.id == "router-real-eight-rows")
    args = case.make(np.random.default_rng(13))
    assert router.KERNEL.source.count("threadgroup_barrier(mem_flags::mem_threadgroup);") == 1
    ids, _ = _run_variant(router, args, "threadgroup_barrier(mem_flags::mem_threadgroup);", "")
    want, _ = router.reference(*args)
    assert not np.array_equal(np.array(ids), np.array(want))


def _run_variant(module, args, old, new, **options):
    """Run a kernel whose body has `old` replaced by `new` (a planted bug)."""
    from metal_emulator import run

    k, launch = module.KERNEL, module.launch(*args)
    assert module.KERNEL.source.count(old) >= 1
    return run(k.name + "_variant", k.input_names, k.output_names, k.source.replace(old, new), inputs=launch.inputs,
               template=launch.template, grid=launch.grid, threadgroup=launch.threadgroup,
               output_shapes=launch.output_shapes, output_dtypes=launch.output_dtypes, **options)


@requires_emulator
def test_emulator_catches_a_wrong_row_stride_in_the_gather():
    from metal_emulator import OutOfBounds

    case = next(c for c in CASES if c.id == "embedding-real-vocab")
    args = case.make(np.random.default_rng(23))
    with pytest.raises(OutOfBounds, match="'scales'"):  # scales rows are WORDS / 2 long, not WORDS
        _run_variant(embedding, args, "scales[row * (WORDS / 2) + w / 2]", "scales[row * WORDS + w / 2]")


@requires_emulator
def test_emulator_catches_a_wrong_reduction_in_the_norms():
    case = next(c for c in CASES if c.id == "gated_norm-real-eight-rows")
    args = case.make(np.random.default_rng(24))
    got, = _run_variant(gated_norm, args, "simd_sum(sumsq)", "simd_max(sumsq)")
    with pytest.raises(AssertionError):
        assert_matches(got, gated_norm.reference(*args))
    case = next(c for c in CASES if c.id == "add_norm-real-eight-rows")
    args = case.make(np.random.default_rng(25))
    _, normed = _run_variant(add_norm, args, "threadgroup_barrier(mem_flags::mem_threadgroup);", "")
    assert not np.isfinite(f32(normed)).all()  # partial sums read before they were written


@requires_emulator
def test_replay_one_compiled_kernel_serves_every_accepted_length():
    rng = np.random.default_rng(14)
    tape = replay_tape(rng, 8, 2, 32, 4, 32)
    texts = set()
    for rows in range(9):
        launch = replay.launch(*tape, rows)
        infos = [ArgInfo(*_info(x)) for x in launch.inputs]
        texts.add(kernel_source(replay.KERNEL.name, replay.KERNEL.input_names, replay.KERNEL.output_names,
                                replay.KERNEL.source, "", infos, launch.output_dtypes, launch.template)[1])
        state, conv = run_kernel(replay.KERNEL, launch)
        want_conv, want_state = replay.reference(*tape, rows)
        assert_matches(state, want_state, what=f"rows={rows}")
        assert_matches(conv, want_conv, what=f"rows={rows}")
    assert len(texts) == 1


def _info(x):
    a = x if isinstance(x, mx.array) else mx.array(x)
    return a.dtype, a.ndim, a.size


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_generated_source_is_what_mlx_builds(kernel):
    case = next(c for c in CASES if c.kernel == kernel)
    module = case.module
    launch = module.launch(*case.make(np.random.default_rng(15)))
    k = module.KERNEL
    ours = kernel_source(k.name, k.input_names, k.output_names, k.source, k.header,
                         [ArgInfo(*_info(x)) for x in launch.inputs], launch.output_dtypes, launch.template)[1]
    theirs = mlx_generated_source(k.name, k.input_names, k.output_names, k.source, inputs=launch.inputs,
                                  output_shapes=launch.output_shapes, output_dtypes=launch.output_dtypes,
                                  header=k.header, template=launch.template, grid=launch.grid,
                                  threadgroup=launch.threadgroup)
    assert ours == theirs


def test_metal_kernel_calls_build_one_graph_node_each():
    """Traced without Metal (mx.export_function), each kernel call is one CustomKernel
    primitive in the graph: what bench/primitives.py counts it as."""
    import io
    import tempfile

    for kernel in KERNELS:
        case = next(c for c in CASES if c.kernel == kernel)
        args = case.make(np.random.default_rng(16))
        module = case.module
        mx.eval([a for a in args if isinstance(a, mx.array)])
        labels = []

        def traced(module=module, args=args, labels=labels):
            outs = module.metal(*args)
            dot = io.StringIO()
            mx.export_to_dot(dot, *as_list(outs))
            labels.extend(line for line in dot.getvalue().splitlines() if "shape=rectangle" in line)
            return as_list(outs)

        with tempfile.TemporaryDirectory() as tmp:
            mx.export_function(str(Path(tmp) / "f.mlxfn"), traced)
        names = [line.split('label ="')[1].split('"')[0] for line in labels]
        # inputs that are views (the model's conv weight) may add their own view op
        assert names.count("CustomKernel") == 1 and len(names) <= 2, (kernel, names)


# ------------------------------------------------------------------ the model's ops


@pytest.fixture(scope="module")
def gdn_model(tmp_path_factory):
    """A tiny target whose GDN heads are not the default shape (key head dim 32, value 16)."""
    from monolith.models import load_model
    from monolith.pack import build_pack
    from monolith.synth import Preset, write_target

    root = tmp_path_factory.mktemp("kernels")
    ckpt = write_target(root / "t", preset=Preset(linear_key_head_dim=32, linear_value_head_dim=16), format="bf16")
    return load_model(build_pack(ckpt, root / "p"), dtype="float32")


@requires_emulator
def test_premix_and_replay_match_the_models_tape(gdn_model, monkeypatch):
    """Drop-in check: on the model's own GDN inputs, the pre-mixer reproduces the tape the
    model records (q, k, v, gamma, beta, window) and the replay kernel the states
    HybridCache.commit builds from it."""
    from monolith.models.mixers import GatedDeltaNet

    seen = []
    original = GatedDeltaNet.__call__

    def spy(self, x, states, spans):
        (state,), (span,) = states, spans  # one sequence: one segment
        seen.append((self, span.of(x), state.conv))
        return original(self, x, states, spans)

    monkeypatch.setattr(GatedDeltaNet, "__call__", spy)
    cache = gdn_model.make_cache(32)
    prefill(gdn_model, mx.array([3, 14, 15, 92, 65], dtype=mx.int32), cache)
    snap = cache.snapshot(record=True)
    seen.clear()
    block = mx.array([35, 89, 79, 32, 38, 46], dtype=mx.int32)
    gdn_model(block, cache)
    gdn = [layer for layer in cache.layers if hasattr(layer, "tape")]
    assert len(seen) == len(gdn) > 0
    for (mixer, x, conv), state in zip(seen, gdn):
        proj = mixer.in_proj(x)
        got = premix.Premix(*run_kernel(premix.KERNEL, premix.launch(
            proj, conv, mixer.conv_weight, mixer.neg_decay, mixer.dt_bias, mixer.hk, mixer.dk, mixer.hv, mixer.dv)))
        tape = state.tape
        for name in ("q", "k", "v", "gamma", "beta", "window"):
            assert_matches(getattr(got, name), getattr(tape, name), what=name)
    states = []
    for (conv, recurrent), layer in zip(snap.states, gdn):
        t = layer.tape
        states.append(run_kernel(replay.KERNEL, replay.launch(t.window, t.k, t.v, t.gamma, t.beta, recurrent, 4)))
    cache.commit(snap, 4)
    for (state, conv), (want_conv, want_state) in zip(states, cache.snapshot().states):
        assert_matches(conv, want_conv)
        assert_matches(state, want_state)


@requires_emulator
def test_gated_norm_matches_the_models_op(gdn_model):
    mixer = next(layer.mixer for layer in gdn_model.layers if layer.kind == "linear_attention")
    rng = np.random.default_rng(17)
    proj = normal(rng, 1, 6, mixer.in_proj.out_features)
    o = normal(rng, 1, 6, mixer.hv, mixer.dv)
    c = mixer.conv_dim
    z = proj[..., c:c + mixer.value_dim].reshape(1, 6, mixer.hv, mixer.dv)
    z32 = z.astype(mx.float32)  # the op the model ran before monolith.kernels
    want = (mx.fast.rms_norm(o, mixer.norm, mixer.eps) * (z32 * mx.sigmoid(z32))).reshape(1, 6, -1)
    got, = run_kernel(gated_norm.KERNEL, gated_norm.launch(o, proj, mixer.norm, mixer.eps, c))
    assert_matches(got, want.astype(got.dtype))


@requires_emulator
def test_attention_prologue_is_a_drop_in_for_the_models_attention(gdn_model):
    from monolith.models.cache import KVCache
    from monolith.models.mixers import Span

    layer = next(layer for layer in gdn_model.layers if layer.kind == "full_attention")
    attn = layer.mixer
    x = normal(np.random.default_rng(18), 1, 5, gdn_model.args.hidden_size)
    offset = 3
    cache = KVCache(attn.kv_heads, attn.head_dim, 16, mx.float32)
    cache.update(mx.zeros((1, attn.kv_heads, offset, attn.head_dim)), mx.zeros((1, attn.kv_heads, offset,
                                                                               attn.head_dim)), 0)
    want = attn(x, [cache], [Span(0, 5, offset)])
    q, k, v, gate = run_kernel(attention.KERNEL, attention.launch(
        attn.qkv(x), attn.q_norm, attn.k_norm, offset, attn.heads, attn.kv_heads, attn.head_dim, attn.rotary_dim,
        attn.rope_theta, attn.eps))
    keys, values = cache.update(k, v, offset)
    o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask="causal")
    got = attn.o_proj(o.transpose(0, 2, 1, 3).reshape(1, 5, -1) * gate)
    assert_matches(got, want)


@requires_emulator
def test_router_and_combine_are_drop_ins_for_the_moe_block(gdn_model):
    from monolith.models.layers import rms_norm

    block = gdn_model.layers[0].mlp
    next_norm = gdn_model.layers[1].input_layernorm
    rng = np.random.default_rng(19)
    x = normal(rng, 7, gdn_model.args.hidden_size)
    residual = normal(rng, 1, 7, gdn_model.args.hidden_size)
    logits = block.router(x)
    want_ids, want_weights = block.route(x)
    ids, weights = run_kernel(router.KERNEL, router.launch(logits, block.top_k))
    order = np.argsort(np.array(want_ids), axis=-1)
    np.testing.assert_array_equal(np.sort(np.array(ids), axis=-1), np.take_along_axis(np.array(want_ids), order, -1))
    got_w = np.take_along_axis(np.array(weights), np.argsort(np.array(ids), axis=-1), -1)
    np.testing.assert_allclose(got_w, np.take_along_axis(np.array(want_weights), order, -1), rtol=1e-5)
    expert_out = block.experts(x, ids)
    h, normed = run_kernel(combine.KERNEL, combine.launch(expert_out, weights, block.shared_expert(x),
                                                          block.shared_expert_gate(x), residual, next_norm, 1e-6))
    want, want_normed = block.add_norm(x, residual, next_norm, 1e-6)
    assert_matches(h, want)
    assert_matches(normed, want_normed)
    assert_matches(normed, rms_norm(want, next_norm, 1e-6))


@requires_emulator
def test_add_rms_norm_is_the_models_residual_and_post_attention_norm(gdn_model):
    from monolith.models.layers import rms_norm

    layer = gdn_model.layers[0]
    rng = np.random.default_rng(22)
    x, y = normal(rng, 1, 6, gdn_model.args.hidden_size), normal(rng, 1, 6, gdn_model.args.hidden_size)
    h, normed = run_kernel(add_norm.KERNEL, add_norm.launch(x, y, layer.post_attention_layernorm, layer.eps))
    assert_matches(h, x + y)
    assert_matches(normed, rms_norm(x + y, layer.post_attention_layernorm, layer.eps))


@requires_emulator
def test_nvfp4_embedding_matches_the_models_gather():
    from monolith.models.layers import Embedding, Linear

    tokens, words, scales, tensor_scale, _ = next(c for c in CASES if c.id == "embedding-bf16").make(
        np.random.default_rng(20))
    table = Linear(words, "nvfp4", scales=scales, tensor_scale=tensor_scale, shape=(words.shape[0], words.shape[1] * 8))
    want = Embedding(table, mx.bfloat16)(tokens)
    got, = run_kernel(embedding.KERNEL, embedding.launch(tokens, words, scales, tensor_scale, mx.bfloat16))
    assert mx.array_equal(got, want)


@requires_emulator
def test_router_reference_breaks_ties_by_lower_expert_index():
    logits = mx.array([[1.0, 3.0, 3.0, 0.0, 3.0, 1.0], [0.0] * 6])
    ids, weights = router.reference(logits, 4)
    assert np.array(ids).tolist() == [[1, 2, 4, 0], [0, 1, 2, 3]]
    got_ids, got_weights = run_kernel(router.KERNEL, router.launch(logits, 4))
    assert np.array(got_ids).tolist() == np.array(ids).tolist()
    assert_matches(got_weights, weights)


def test_router_reference_ranks_nan_as_minus_infinity():
    """Non-finite logits: NaN ranks as -inf; a slot with only -inf left takes the lowest
    free expert (the tie rule); the weights are the limit of the softmax over the selected
    logits: +inf logits share the weight, -inf below a larger logit get 0, and an all-equal
    selection (all -inf, all +inf) is uniform. Ids always distinct and in [0, E)."""
    nan, inf = float("nan"), float("inf")
    logits = mx.array([[nan, 2.0, nan, -inf, 2.0, nan], [nan] * 6, [-inf] * 6, [inf] * 6,
                       [0.0, inf, 5.0, inf, nan, -inf], [np.log(3.0), nan, 0.0, -inf, -inf, -inf]])
    ids, weights = router.reference(logits, 4)
    assert np.array(ids).tolist() == [[1, 4, 0, 2], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [1, 3, 2, 0],
                                      [0, 2, 1, 3]]
    np.testing.assert_allclose(np.array(weights), [[0.5, 0.5, 0, 0], [0.25] * 4, [0.25] * 4, [0.25] * 4,
                                                   [0.5, 0.5, 0, 0], [0.75, 0.25, 0, 0]], rtol=1e-6, atol=0)


# ------------------------------------------------------------------ backend choice


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels.backend() == ("metal" if mx.metal.is_available() else "reference")
    monkeypatch.setenv(kernels.ENV, "reference")
    assert kernels.backend() == "reference" and not kernels.use_metal()
    monkeypatch.setenv(kernels.ENV, "gpu")
    with pytest.raises(kernels.KernelBackendError, match="must be one of"):
        kernels.backend()
    monkeypatch.setenv(kernels.ENV, "metal")
    if mx.metal.is_available():
        assert kernels.backend() == "metal"
    else:
        with pytest.raises(kernels.KernelBackendError, match="Metal is not available"):
            kernels.backend()
        with pytest.raises(kernels.KernelBackendError):
            kernels.moe_route(mx.zeros((1, 8)), 2)


def test_public_functions_use_the_reference_without_metal(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "reference")
    rng = np.random.default_rng(21)
    public = {"embedding": kernels.nvfp4_embedding, "premix": kernels.gdn_premix, "gated_norm": kernels.gated_rms_norm,
              "router": kernels.moe_route, "attention": kernels.attention_prologue, "add_norm": kernels.add_rms_norm,
              "combine": kernels.moe_combine, "replay": kernels.gdn_replay}
    for kernel, fn in public.items():
        case = next(c for c in CASES if c.kernel == kernel)
        args = case.make(rng)
        for a, b in zip(as_list(fn(*args)), as_list(KERNELS[kernel].reference(*args))):
            assert mx.array_equal(a, b)


# ------------------------------------------------------------------ packaging


def test_astype_to_the_same_dtype_adds_no_graph_node(tmp_path):
    """The references and the models cast with `astype` wherever a dtype may already
    match: MLX returns the array itself then (no AsType in the graph), a real cast only
    where the dtype differs."""
    x = mx.ones((4,), dtype=mx.float32) + 1
    for dtype, nodes in ((mx.float32, 0), (mx.float16, 1)):
        path = tmp_path / f"{dtype}.dot"
        mx.export_to_dot(str(path), x.astype(dtype))
        assert path.read_text().count('"AsType"') == nodes


def test_every_kernel_body_is_in_metal_dir():
    for module in KERNELS.values():
        path = find_body(module.KERNEL.filename)
        assert path == REPO / "metal" / module.KERNEL.filename


def test_primitives_bench_meets_the_goal(tmp_path):
    """bench/primitives.py: the fused path needs at least 40% fewer MLX primitives per
    decode step and per verify round on the 35B shapes (both paths are the model's own
    forward: tests/test_kernels_model.py checks the kernel path's numbers)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_primitives", REPO / "bench" / "primitives.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--out", str(tmp_path / "primitives.json")])
    for kind in ("decode", "round"):
        assert results[kind]["fewer_primitives"] >= 0.40, (kind, results[kind]["fewer_primitives"])


def test_bodies_ship_in_the_wheel_and_load_from_an_install(tmp_path):
    """pip wheel . puts metal/*.metal under <prefix>/share/monolith/metal; source.py finds
    them there from an installed copy (no checkout next to it)."""
    import shutil

    import setuptools  # noqa: F401  (a test dependency: the wheel is built without build isolation, offline)

    src = tmp_path / "src"  # build from a copy: setuptools writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("monolith", "metal", "packs"):  # packs: the bundled demo pair ships as data files too
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(src)], check=True, capture_output=True)
    wheel = next(wheels.glob("monolith-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for module in KERNELS.values():
        assert any(n.endswith(f".data/data/share/monolith/metal/{module.KERNEL.filename}") for n in names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True)
    # source.py and data_files.py are standard library only: load source.py from the installed
    # package by path, under its own name (not through monolith.kernels, which needs MLX)
    script = ("import importlib.util, pathlib, sysconfig\n"
              "path = pathlib.Path(sysconfig.get_path('purelib')) / 'monolith' / 'kernels' / 'source.py'\n"
              "spec = importlib.util.spec_from_file_location('monolith.kernels.source', path)\n"
              "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
              "import sys\n"
              "for name in sys.argv[1:]:\n"
              "    print(m.find_body(name))\n"
              "    assert m.read_body(name).strip()\n")
    out = subprocess.run([str(py), "-c", script, *[m.KERNEL.filename for m in KERNELS.values()]], check=True,
                         capture_output=True, text=True, cwd=tmp_path).stdout.split()
    assert len(out) == len(KERNELS)
    assert all(Path(p).is_relative_to(venv) and "share/monolith/metal" in p for p in out)
