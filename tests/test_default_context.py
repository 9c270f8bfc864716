"""The default context is the model's own (its config's max_position_embeddings, the text
config's in a nested VLM config), capped so that --max-batch sequences' caches at that
context take at most half the memory free after loading, and logged in one line saying
the number and why. An explicit --max-context is honoured; past the model's own it is
honoured with a warning. The demo pair declares Qwen3.6's 262,144, so a coding agent's
33,000-token prompt fits the embedded default. One sequence's cache is what the config
says, and --max-batch sequences whose caches do not fit the free memory are refused at
start."""

from __future__ import annotations

import json

import httpx
import pytest
from serving_rig import Server

from monolith import engine_setup, model_flags
from monolith.pack.demo import bundle_dir
from monolith.runtime import sizing
from monolith.serve import build_parser

GIB = 2**30


def own_context(target_dir) -> int:
    config = json.loads((target_dir / "config.json").read_text())
    return config.get("text_config", config)["max_position_embeddings"]


def bytes_per_token(model, drafter) -> int:
    """KV bytes of one more token, from the configs: every attention layer of the target
    and every draft layer keeps a key and a value row per token."""
    a, d = model.args, drafter.draft.args
    size = 4  # float32
    target = sum(t == "full_attention" for t in a.layer_types) * 2 * a.num_key_value_heads * a.head_dim * size
    return target + d.num_layers * 2 * d.num_kv_heads * d.head_dim * size


def start(demo, *argv, draft: bool = True):
    """The engine `python -m monolith.serve ARGV` makes on the loaded demo pair, drafting
    with its DSpark draft (a named scheduler: nothing measured) unless `draft` is false;
    (engine, its log lines)."""
    model, drafter, _ = demo
    args = build_parser().parse_args(["--dtype", "float32", "--no-warmup", "--prompt-cache-size", "0",
                                      *argv, *(["--spec-sched", "fixed"] if draft else ["--no-draft"])])
    logs = []
    sources = engine_setup.Sources(bundle_dir() / "target", ("the loaded draft",) if draft else ())
    engine = engine_setup.load_engine(args, model_flags.plan_model(args), logs.append, sources=sources,
                                      load=lambda *a, **k: model, load_draft=lambda *a, **k: drafter,
                                      max_batch=args.max_batch)
    return engine, logs


@pytest.fixture()
def free_memory(monkeypatch):
    def set_free(nbytes: int) -> None:
        monkeypatch.setattr(sizing, "available_memory", lambda: nbytes)
    return set_free


def context_lines(logs) -> list[str]:
    return [line for line in logs if line.startswith("context: ")]


def test_the_demo_pair_declares_qwen36s_context():
    assert own_context(bundle_dir() / "target") == 262_144


def test_with_room_the_default_is_the_models_own_context(demo_f32, free_memory):
    free_memory(64 * GIB)
    engine, logs = start(demo_f32)
    try:
        assert engine.max_context == own_context(bundle_dir() / "target") == 262_144
        [line] = context_lines(logs)
        assert "262144 tokens" in line and "the model's own" in line, line
    finally:
        engine.close()


@pytest.mark.parametrize("batch", [1, 3])
def test_short_of_memory_the_default_is_capped_so_the_batch_takes_half_the_free_memory(demo_f32, free_memory,
                                                                                      batch):
    model, drafter, _ = demo_f32
    per_token = bytes_per_token(model, drafter)
    free = 2 * batch * per_token * 50_000  # half of it holds `batch` sequences of ~50,000 tokens
    free_memory(free)
    engine, logs = start(demo_f32, "--max-batch", str(batch))
    try:
        context = engine.max_context
        assert 48_000 <= context <= 50_000 and context % 1024 == 0, context
        # `batch` sequences at that context (plus the fixed recurrent states) fit half the free memory
        assert batch * sizing.sequence_bytes(model, drafter, context) <= free / 2
        assert batch * sizing.sequence_bytes(model, drafter, context + 1024) > free / 2
        [line] = context_lines(logs)
        assert f"{context} tokens" in line and "capped by memory" in line and "262144" in line, line
    finally:
        engine.close()


@pytest.mark.parametrize("given, warned", [(3000, False), (300_000, True)])
def test_an_explicit_context_is_honoured_past_the_models_own_with_a_warning(demo_f32, free_memory, given, warned):
    free_memory(64 * GIB)
    engine, logs = start(demo_f32, "--max-context", str(given), draft=False)
    try:
        assert engine.max_context == given
        [line] = context_lines(logs)
        if warned:
            assert line.startswith(f"context: {given} tokens (--max-context)") and "warning" in line \
                and "262144" in line, line
        else:
            assert line == f"context: {given} tokens (--max-context)"
    finally:
        engine.close()


def test_a_33000_token_prompt_fits_the_demo_servers_default_context(demo_f32, free_memory):
    """A coding agent's first turn (Claude Code's system prompt and tools: ~32,700 tokens)
    is accepted and starts: the streamed reply's headers come once its prefill has begun.
    The prefill itself is not awaited (on the 2-core CPU it takes minutes); the client
    then leaves, which cancels it."""
    free_memory(64 * GIB)
    prompt = [(7 * i) % 1900 + 5 for i in range(33_000)]
    body = {"model": "monolith-demo", "prompt": prompt, "max_tokens": 1, "stream": True}
    with Server(lambda: start(demo_f32)[0], model_names=("monolith-demo",)) as server:
        server.wait_ready(120)
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"] == 262_144
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200, reply.read()


def test_the_caches_of_max_batch_sequences_must_fit_at_start(demo_f32, monkeypatch):
    """One sequence's cache is what the config says (KV rows of every attention layer for
    max_context plus the verify block's spare rows, the recurrent and conv states, the
    draft's context); max_batch of them that do not fit the free memory are refused at
    start, naming both flags."""
    from monolith.models.cache import SPARE_ROWS

    model, drafter, _ = demo_f32
    a, d = model.args, drafter.draft.args
    size = 4  # float32
    kv = sum(t == "full_attention" for t in a.layer_types) * 2 * a.num_key_value_heads * (1000 + SPARE_ROWS) \
        * a.head_dim * size
    conv = 2 * a.linear_num_key_heads * a.linear_key_head_dim + a.linear_num_value_heads * a.linear_value_head_dim
    gdn = sum(t == "linear_attention" for t in a.layer_types) * 4 * (
        (a.linear_conv_kernel_dim - 1) * conv
        + a.linear_num_value_heads * a.linear_value_head_dim * a.linear_key_head_dim)
    draft = d.num_layers * 2 * d.num_kv_heads * (1000 + d.block_size) * d.head_dim * size
    each = sizing.sequence_bytes(model, drafter, 1000)
    assert each == kv + gdn + draft
    logs = []
    monkeypatch.setattr(sizing, "available_memory", lambda: 4 * each + 1)
    assert sizing.batch_memory(model, drafter, 1000, 4, logs.append) == 4 * each
    with pytest.raises(sizing.SizingError, match=r"--max-batch 5 sequences of --max-context 1000 tokens need"):
        sizing.batch_memory(model, drafter, 1000, 5, logs.append)
