"""The checkpoint's own MTP head: packed with --with-mtp from both published layouts
(nvidia's inline fused experts, unsloth's separate BF16 shard under matching NVFP4/FP8
rules), and run on MLX (monolith/models/mtp.py).

Independent references: goldens from speculators 0.9.0 itself (its training forward
and vLLM's decode schedule, tests/data/speculators-mtp/README.md), the source checkpoint (unpack gives the head's tensors back
bit for bit), the target's own full-attention layer (the head's layer is packed as it
is), the pack without --with-mtp (unchanged), and the head's own KV cache (one step over
T rows equals T one-row steps)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from numeric import rel
from pack_helpers import assert_cli_error, copy_checkpoint, run_cli

from monolith.checkpoint import open_checkpoint
from monolith.formats import SafetensorsFile, write_safetensors
from monolith.models import load_model, load_mtp
from monolith.pack import (
    PackError,
    build_pack,
    read_manifest,
    resolve_pack,
    unpack_pack,
)
from monolith.synth import write_target
from monolith.synth.published import TARGET_LAYOUTS, write_published_target

FULL_LAYER = "model.layers.3."  # the tiny layouts' full-attention layer (layer_types: every 4th)
MTP_LAYER = "mtp.layers.0."
KEPT = ("mtp.layers.0.mlp.gate", "mtp.layers.0.mlp.shared_expert_gate")  # a draft's keep rules
MEASURED: dict[str, object] = {}  # printed after the module's tests with pytest -s


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Per published layout: its source, its pack without the head, with it (auto) and
    with it unquantized."""
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for layout in TARGET_LAYOUTS:
        src = write_published_target(root / layout, layout)
        out[layout] = {
            "src": src,
            "plain": build_pack(src, root / f"{layout}-plain"),
            "auto": build_pack(src, root / f"{layout}-mtp", with_mtp=True),
            "none": build_pack(src, root / f"{layout}-none", quantization="none", with_mtp=True),
        }
    return out


def mtp_entries(manifest: dict) -> dict:
    return {n: e for n, e in manifest["entries"].items() if n.startswith("mtp.")}


@pytest.mark.parametrize("layout", TARGET_LAYOUTS)
def test_the_head_is_packed_as_a_target_full_attention_layer(layouts, layout):
    plain, mtp = read_manifest(layouts[layout]["plain"]), read_manifest(layouts[layout]["auto"])
    head = mtp_entries(mtp)
    layer = {n[len(FULL_LAYER):]: e for n, e in mtp["entries"].items() if n.startswith(FULL_LAYER)}
    assert {n[len(MTP_LAYER):] for n in head if n.startswith(MTP_LAYER)} == set(layer)
    for name, entry in layer.items():  # the same fusions, shapes and norm convention
        twin = head[MTP_LAYER + name]
        assert (twin["kind"], twin["shape"], twin.get("transform")) == (entry["kind"], entry["shape"],
                                                                          entry.get("transform")), name
    h = open_checkpoint(layouts[layout]["src"]).text_config["hidden_size"]
    assert head["mtp.fc"]["kind"] == "linear" and head["mtp.fc"]["shape"] == [h, 2 * h]
    for norm in ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm"):
        assert head[norm]["transform"] == mtp["entries"]["model.norm"]["transform"] == "one_plus_f32"
    assert mtp["layout"]["mtp"]["num_layers"] == 1
    skipped = json.loads((layouts[layout]["auto"] / "conversion.json").read_text())["skipped"]
    assert not any(n.startswith("mtp.") for n in skipped)
    # the rest of the pack is the pack without the head, tensor for tensor
    assert not mtp_entries(plain) and "mtp" not in plain["layout"]
    rest = {n: t for n, t in mtp["tensors"].items() if not n.startswith("mtp.")}
    assert {n: t["sha256"] for n, t in rest.items()} == {n: t["sha256"] for n, t in plain["tensors"].items()}


@pytest.mark.parametrize("layout", TARGET_LAYOUTS)
def test_auto_quantizes_the_bf16_head_as_a_draft_and_dry_run_says_so(layouts, layout):
    """Under auto a target keeps its precision, a draft's float linears become NVFP4: the
    head's do (its router and shared-expert gate stay BF16, as a draft's would)."""
    head = mtp_entries(read_manifest(layouts[layout]["auto"]))
    matrices = {n: e for n, e in head.items() if e["kind"] != "tensor"}
    assert {e["source_precision"] for e in matrices.values()} == {"bf16"}
    assert {n for n, e in matrices.items() if e["precision"] != "nvfp4"} == {n for n in KEPT if n in matrices}
    assert {e["precision"] for e in mtp_entries(read_manifest(layouts[layout]["none"])).values()} <= {"bf16", "f32"}
    src = layouts[layout]["src"]
    with_head = run_cli("build", src, "--dry-run", "--with-mtp")
    assert with_head.returncode == 0, with_head.stderr
    source = "mtp.layers.0.mlp.experts.gate_up_proj" if layout == "nvidia-35b" else "mtp.layers.0.mlp.gate_proj.weight"
    line = next(x for x in with_head.stdout.splitlines() if x.strip().startswith(source + " "))
    assert " quantize " in line and "-> mtp.layers.0.mlp." in line, line
    without = run_cli("build", src, "--dry-run")
    assert next(x for x in without.stdout.splitlines() if x.strip().startswith(source + " ")).split()[1] == "drop"


@pytest.mark.parametrize("layout", TARGET_LAYOUTS)
def test_unpack_gives_the_head_back_bit_for_bit(layouts, layout, tmp_path):
    """Unquantized, the norms' 1 + w, the fusions and stacked experts undo exactly."""
    src = open_checkpoint(layouts[layout]["src"])
    back = open_checkpoint(unpack_pack(layouts[layout]["none"], tmp_path / "back"))
    names = sorted(n for n in src.tensor_names() if n.startswith("mtp."))
    assert names == sorted(n for n in back.tensor_names() if n.startswith("mtp."))
    for name in names:
        assert back.dtype(name) == src.dtype(name) and np.array_equal(back.read(name), src.read(name)), name


def test_with_mtp_packs_get_their_own_cache_entry(layouts, tmp_path):
    src = layouts["unsloth-27b"]["src"]
    plain = resolve_pack(src, role="target", cache_dir=tmp_path)
    head = resolve_pack(src, role="target", cache_dir=tmp_path, with_mtp=True)
    assert plain != head and mtp_entries(read_manifest(head)) and not mtp_entries(read_manifest(plain))
    stamp = (plain / "manifest.json").stat().st_mtime_ns
    assert resolve_pack(src, role="target", cache_dir=tmp_path) == plain  # not rebuilt by the other
    assert (plain / "manifest.json").stat().st_mtime_ns == stamp
    assert read_manifest(plain)["pack_sha256"] == read_manifest(layouts["unsloth-27b"]["plain"])["pack_sha256"]


def test_with_mtp_refuses_a_checkpoint_without_a_head_and_a_draft(synth_dir, tmp_path):
    src = copy_checkpoint(synth_dir("target", "bf16"), tmp_path / "src")
    for path in src.glob("*.safetensors"):
        st = SafetensorsFile(path)
        kept = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names() if not n.startswith("mtp.")}
        st.close()
        write_safetensors(path, kept)
    index = src / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {n: f for n, f in data["weight_map"].items() if not n.startswith("mtp.")}
        index.write_text(json.dumps(data))
    assert_cli_error(run_cli("build", src, "--out", tmp_path / "p", "--with-mtp"), "no MTP head", "mtp.fc.weight")
    assert_cli_error(run_cli("build", synth_dir("draft", "deepspec"), "--out", tmp_path / "d", "--with-mtp"),
                     "--with-mtp", "draft")


# ------------------------------------------------------------------ the head on MLX


@pytest.fixture(scope="module")
def moe_head(layouts):
    pack = layouts["nvidia-35b"]["none"]
    target = load_model(pack, "float32")
    return target, load_mtp(pack, target)


def test_the_head_chains_steps_over_its_own_cache(moe_head):
    target, head = moe_head
    rng = np.random.default_rng(0)
    h, vocab = target.args.hidden_size, target.args.vocab_size
    hidden = mx.array(rng.standard_normal((5, h)).astype(np.float32))
    tokens = rng.integers(0, vocab, 5)
    cache = head.make_cache(16)
    steps = head.chain(hidden, tokens, cache, 3)
    assert [tuple(o.shape) for o, _ in steps] == [(5, h), (1, h), (1, h)]
    assert [tuple(lg.shape) for _, lg in steps] == [(5, vocab), (1, vocab), (1, vocab)]
    assert all(lg.dtype == mx.float32 for _, lg in steps) and cache.offset == 7
    # one step over five rows == five one-row steps (the causal KV cache)
    rows = head.make_cache(16)
    one_by_one = [head(hidden[i:i + 1], tokens[i:i + 1], rows) for i in range(5)]
    got = np.concatenate([np.array(lg) for _, lg in one_by_one])
    assert np.abs(got - np.array(steps[0][1])).max() <= 1e-5 * np.abs(got).max()
    # going back in the head's cache and redrafting gives the same proposals
    cache.rewind(5)
    again = head.chain(steps[0][0][-1:], [int(mx.argmax(steps[0][1][-1]).item())], cache, 2)
    for (o, lg), (want_o, want_lg) in zip(again, steps[1:]):
        assert np.array_equal(np.array(o), np.array(want_o)) and np.array_equal(np.array(lg), np.array(want_lg))
    with pytest.raises(ValueError, match="hidden must be"):
        head(hidden[:2], tokens[:3], head.make_cache(8))


def test_load_mtp_refuses_a_pack_without_a_head_or_of_another_target(layouts, moe_head):
    target, _ = moe_head
    with pytest.raises(PackError, match="no MTP head.*--with-mtp"):
        load_mtp(layouts["nvidia-35b"]["plain"], target)
    with pytest.raises(PackError, match="not the pack the target model was loaded from"):
        load_mtp(layouts["nvidia-35b"]["auto"], target)


# ------------------------------------------------------------------ speculators' own goldens

SPECULATORS_MTP = Path(__file__).parent / "data" / "speculators-mtp"
GOLDEN_CASES = ("moe", "dense")
# max |ours - speculators| / max |speculators|: both float32 on the same bf16 weights, so only
# the summation order differs, and our positions: the head's cache starts at 0 where the
# goldens' rows sit at 5.., which attention does not see (RoPE scores depend on position
# differences) but the rotation angles round differently (measured <= 8e-7)
GOLDEN_TOL = 1e-5


@pytest.fixture(scope="module")
def golden_heads(tmp_path_factory):
    """Per case: the tiny synthetic target of the goldens' shape (MoE with fused experts, or
    dense), its MTP head, embedding and lm_head replaced by the goldens' (published names),
    packed --with-mtp unquantized and loaded in float32."""
    root, heads = tmp_path_factory.mktemp("mtp-goldens"), {}
    for case in GOLDEN_CASES:
        src = write_target(root / case, format="bf16", dense=case == "dense")
        gold = SafetensorsFile(SPECULATORS_MTP / f"{case}.safetensors")
        ckpt = open_checkpoint(src)
        assert set(gold.names()) <= set(ckpt.tensor_names())
        for path in {ckpt.file_of(name) for name in gold.names()}:
            st = SafetensorsFile(path)
            tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
            st.close()
            for name in set(gold.names()) & set(tensors):
                assert tensors[name][0] == gold.dtype(name) and tensors[name][1].shape == gold.shape(name), name
                tensors[name] = (gold.dtype(name), np.array(gold.read(name)))
            write_safetensors(path, tensors)
        pack = build_pack(src, root / f"{case}-pack", quantization="none", with_mtp=True)
        target = load_model(pack, "float32")
        heads[case] = load_mtp(pack, target)
    return heads


def golden(case: str) -> dict:
    with np.load(SPECULATORS_MTP / f"{case}.npz") as data:
        return {k: data[k] for k in data.files}


def decode_errors(head, want: dict) -> dict:
    """vLLM's schedule (the goldens' README): step 0 over the prompt rows (hidden t, token
    t + 1), then one row a step, greedy, over the head's KV cache."""
    ids, hidden = want["input_ids"], mx.array(want["hidden_states"])
    steps = head.chain(hidden[:-1], ids[1:], head.make_cache(32), 3)
    assert [int(np.argmax(np.array(lg[-1]))) for _, lg in steps] == want["decode_tokens"].tolist()
    return {"step 0 rows": rel(np.array(steps[0][0]), want["decode_step0_hidden"]),
            "hidden": rel(np.stack([np.array(o[-1]) for o, _ in steps]), want["decode_hidden"]),
            "logits": rel(np.stack([np.array(lg[-1]) for _, lg in steps]), want["decode_logits"])}


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_the_head_matches_speculators_decoding(golden_heads, case):
    errs = decode_errors(golden_heads[case], golden(case))
    MEASURED[f"{case} decode vs speculators (rel)"] = {k: f"{v:.1e}" for k, v in errs.items()}
    assert max(errs.values()) < GOLDEN_TOL, errs


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_the_head_matches_speculators_training_forward(golden_heads, case):
    """MTPDraftModel.forward: three teacher-forced steps, step k over rows t with the step
    before's output and token t + k + 1, each step a fresh pass at the same positions."""
    head, want = golden_heads[case], golden(case)
    rows = want["train_hidden"].shape[1]
    hidden = mx.array(want["hidden_states"][:rows])
    for k in range(3):
        hidden, logits = head(hidden, want["input_ids"][k + 1:k + 1 + rows], head.make_cache(32))
        errs = rel(np.array(hidden), want["train_hidden"][k]), rel(np.array(logits), want["train_logits"][k])
        MEASURED[f"{case} training step {k} vs speculators (rel hidden, logits)"] = f"{errs[0]:.1e}, {errs[1]:.1e}"
        assert max(errs) < GOLDEN_TOL, (k, errs)


def test_the_goldens_see_the_head_s_own_final_norm(golden_heads):
    """The comparison notices the target's final norm in place of the head's mtp.norm."""
    head, want = golden_heads["moe"], golden("moe")
    saved, head.norm = head.norm, head.target.norm
    try:
        out, _ = head(mx.array(want["hidden_states"][:-1]), want["input_ids"][1:], head.make_cache(32))
    finally:
        head.norm = saved
    assert rel(np.array(out), want["decode_step0_hidden"]) > 100 * GOLDEN_TOL
