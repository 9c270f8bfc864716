"""The models run monolith.kernels: with the Metal kernels EMULATED (their bodies run
through the CPU emulator in place of mx.fast.metal_kernel, as a Mac would run them) a
synthetic NVFP4 MoE target and its DSpark draft give what they give with the MLX
references, and greedy speculative decoding still equals plain greedy decoding."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from decoding import plain, speculate
from metal_emulator import requires_emulator, run_kernel
from numeric import rel

from monolith.kernels import kernel as kernel_module
from monolith.models import load_draft, load_model
from monolith.pack import build_pack
from monolith.runtime.draft_model import DraftModelDrafter
from monolith.sampling import SamplingParams

pytestmark = requires_emulator

PROMPT = [401, 316, 265, 198, 71, 72, 402]
BLOCK = [77, 81, 5, 17, 2]
TOLERANCE = 2e-5  # max |a - b| / max |b| in float32


@pytest.fixture(scope="module")
def nvfp4_pair(tmp_path_factory):
    """A tiny MoE target in ModelOpt NVFP4 and an NVFP4-packed DSpark draft, float32 (target
    packs keep the embedding BF16: the NVFP4 gather runs on the draft's embed_tokens)."""
    from monolith.synth import write_draft, write_target

    root = tmp_path_factory.mktemp("kernels_model")
    target_dir = write_target(root / "target", format="modelopt-nvfp4")
    target = load_model(build_pack(target_dir, root / "target.pack", role="target"), "float32")
    draft_dir = write_draft(root / "draft", target_dir, format="deepspec", seed=3)
    draft = load_draft(build_pack(draft_dir, root / "draft.pack", role="draft", quantization="nvfp4"), target,
                       "float32")
    assert target.args.is_moe
    assert draft.markov is not None and draft.embed_tokens.table.precision == "nvfp4"
    return target, draft


@pytest.fixture
def emulated(monkeypatch):
    """The public functions take their Metal path, and each metal_kernel call runs in the
    emulator. Returns the count of kernel calls by name."""
    calls = Counter()

    def call(self, launch):
        calls[self.name] += 1
        return run_kernel(self, launch)

    monkeypatch.setattr(kernel_module, "backend", lambda: "metal")
    monkeypatch.setattr(kernel_module.MetalKernel, "__call__", call)
    return calls


def run_pair(target, draft) -> dict[str, mx.array]:
    """Prefill, a recorded verify block committed after 2 rows, one decode step, and the
    draft's context and block forward on the target's features."""
    cache = target.make_cache(32)
    taps = list(draft.taps)
    out = {}
    out["prefill"], features = target(mx.array(PROMPT, dtype=mx.int32), cache, taps)
    snap = cache.snapshot(record=True)
    out["verify"], verify_features = target(mx.array(BLOCK, dtype=mx.int32), cache, taps)
    cache.commit(snap, 2)
    out["decode"], _ = target(mx.array(BLOCK[2:3], dtype=mx.int32), cache)
    for i, state in enumerate(cache.snapshot().states):
        out[f"conv{i}"], out[f"recurrent{i}"] = state
    ctx = draft.make_context(32)
    draft.append_context(ctx, mx.concatenate([features, verify_features[:2]]))
    out["draft"] = draft.forward(ctx, BLOCK[1])
    out["bias"] = draft.markov.block_bias(mx.array(BLOCK, dtype=mx.int32), out["draft"][:len(BLOCK)])
    mx.eval(out)
    return out


def test_emulated_kernels_equal_the_references(nvfp4_pair, emulated):
    target, draft = nvfp4_pair
    with pytest.MonkeyPatch.context() as mp:  # the references, inside the emulated fixture
        mp.setattr(kernel_module, "backend", lambda: "reference")
        want = run_pair(target, draft)
        assert not emulated
    got = run_pair(target, draft)
    kernels = {"monolith_nvfp4_embedding", "monolith_gdn_premix", "monolith_gated_rms_norm", "monolith_moe_router",
               "monolith_attention_prologue", "monolith_add_rms_norm", "monolith_moe_combine", "monolith_gdn_replay"}
    assert set(emulated) == kernels
    for name, expected in want.items():
        assert got[name].shape == expected.shape and got[name].dtype == expected.dtype, name
        assert rel(got[name], expected) < TOLERANCE, (name, rel(got[name], expected))
    for name in ("prefill", "verify", "decode"):
        np.testing.assert_array_equal(np.argmax(got[name], -1), np.argmax(want[name], -1))


def test_greedy_speculative_equals_plain_with_emulated_kernels(nvfp4_pair, emulated):
    target, draft = nvfp4_pair
    greedy = SamplingParams()
    plain_out = plain(target, PROMPT, 12, greedy, [], 64).token_ids
    calls = sum(emulated.values())
    spec = speculate(target, DraftModelDrafter(draft), PROMPT, 12, greedy, [], 64, block_size=4)
    assert spec.token_ids == plain_out
    assert emulated["monolith_gdn_replay"] > 0 and sum(emulated.values()) > calls
