"""Plain decoding (monolith.runtime.decoder.Decoder without a drafter) and `python -m monolith.generate`: against a
fake bigram model, subprocess argument errors, and one test with the real model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from decoding import plain

from monolith.generate import main
from monolith.runtime.events import ContextLengthError, Outcome
from monolith.runtime.prefill import chunk_ends
from monolith.sampling import SamplingParams, key_chain, sample
from monolith.tokenizer import (
    load_tokenizer,
)

EOS = 402  # <|im_end|> in the synthetic tokenizer; generation_config adds 400 (<|endoftext|>)
VOCAB = 512  # the tiny synthetic target's vocab_size (the tokenizer has 410 tokens)


# ------------------------------------------------------------------ a fake model with the real interface


@dataclass
class FakeArgs:
    vocab_size: int
    eos_token_ids: tuple
    max_position_embeddings: int = 32768  # the model's own context: the default --max-context


class FakeCache:
    """Only an offset: a snapshot is the offset, restoring rewinds to it."""

    def __init__(self, max_context):
        self.max_context = max_context
        self.offset = 0
        self.layers = []  # no KV rows, no states: it takes no memory

    def snapshot(self):
        return self.offset

    def restore(self, offset):
        self.offset = offset

    def arrays(self):
        return []


class FakeModel:
    """Bigram model: the logits after token t are row t of a fixed random table.
    Records every call so tests can check what the decode loop did."""

    def __init__(self, vocab=VOCAB, seed=0, eos=EOS, forced=None):
        table = np.random.default_rng(seed).standard_normal((vocab, vocab)).astype(np.float32) * 3
        for prev, nxt in (forced or {}).items():  # greedy decoding follows these edges
            table[prev, nxt] = 100.0
        self.table_np = table
        self.table = mx.array(table)
        self.args = FakeArgs(vocab, (eos,))
        self.dtype, self.dense_summary = mx.float32, "dense F32"
        self.caches: list[FakeCache] = []
        self.prefills: list[list[int]] = []  # the prefill chunks, in order
        self.steps = 0

    def make_cache(self, max_context):
        self.caches.append(FakeCache(max_context))
        return self.caches[-1]

    def __call__(self, tokens, cache, taps=None):
        return self.forward(tokens, cache, taps)

    def forward(self, tokens, cache, taps=None, logits="all"):
        assert tokens.ndim == 1 and tokens.dtype == mx.int32
        if logits != "all":  # a prefill chunk
            self.prefills.append(np.array(tokens).tolist())
        cache.offset += tokens.shape[0]
        assert cache.offset <= cache.max_context, "cache overflow"
        rows = self.table[tokens]
        return (None if logits == "none" else rows[-1:] if logits == "last" else rows), None

    def greedy_chain(self, last, n):
        out = []
        for _ in range(n):
            last = int(self.table_np[last].argmax())
            out.append(last)
        return out


@pytest.fixture(scope="module")
def pack_dir(tiny_pack):
    return tiny_pack


@pytest.fixture(scope="module")
def tok(pack_dir):
    return load_tokenizer(pack_dir)


# ------------------------------------------------------------------ decode loop


def test_greedy_follows_the_argmax_chain():
    model = FakeModel()
    seen = []
    result = plain(model, [5, 6, 7], 12, SamplingParams(), {EOS}, 64, on_token=seen.append)
    want = model.greedy_chain(7, 12)
    assert EOS not in want
    assert isinstance(result, Outcome)
    assert result.token_ids == want == seen
    assert result.finish_reason == "length" and result.prompt_tokens == 3
    assert model.prefills == [[5, 6], [7]]  # a restore point one token before the end: the same prompt resumes there
    assert result.prefill_seconds > 0 and result.decode_seconds > 0
    assert result.prefill_tok_s > 0 and result.decode_tok_s > 0 and result.decode_steps == 11


def test_stop_token_ends_generation_and_is_not_output():
    model = FakeModel(forced={2: 9, 9: EOS})
    seen = []
    result = plain(model, [1, 2], 100, SamplingParams(), [EOS], 128, on_token=seen.append)
    assert result.token_ids == seen == [9] and result.finish_reason == "stop"
    assert result.decode_steps == 1


def test_stop_right_after_the_prompt_gives_no_tokens():
    model = FakeModel(forced={9: EOS})
    seen = []
    result = plain(model, [1, 9], 10, SamplingParams(), [EOS], 16, on_token=seen.append)
    assert result.token_ids == [] == seen and result.finish_reason == "stop"
    assert result.decode_tok_s == 0.0


def test_stop_mid_generation():
    model = FakeModel()
    chain = model.greedy_chain(7, 5)
    stop = chain[3]
    result = plain(model, [7], 50, SamplingParams(), [stop, EOS], 64)
    assert result.token_ids == chain[: chain.index(stop)] and result.finish_reason == "stop"


def test_context_full_finishes_with_length():
    model = FakeModel()
    result = plain(model, [1, 2, 3, 4], 100, SamplingParams(), [EOS], 7)
    assert len(result.token_ids) == 3  # prompt + output == max_context
    assert result.finish_reason == "length"
    assert model.caches[0].offset <= 7 and model.caches[0].max_context == 7
    one = plain(FakeModel(), [1, 2, 3, 4], 100, SamplingParams(), [EOS], 5)
    assert len(one.token_ids) == 1 and one.finish_reason == "length"


def test_prompt_too_long_fails_before_any_work():
    model = FakeModel()
    with pytest.raises(ContextLengthError, match=r"prompt is 8 tokens but max_context is 8") as e:
        plain(model, list(range(8)), 10, SamplingParams(), [EOS], 8)
    assert (e.value.prompt_tokens, e.value.max_context) == (8, 8)
    assert model.caches == [] and model.prefills == []


def test_prefill_chunk_size_reaches_the_model():
    model = FakeModel()
    plain(model, list(range(10)), 2, SamplingParams(), [EOS], 64, prefill_chunk_size=3)
    # the decoder prefills chunk by chunk (a cancel takes effect between chunks)
    assert model.prefills == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


@pytest.mark.parametrize(
    "prompt, max_tokens, chunk, match",
    [
        ([], 4, 512, "empty"),
        ([1, VOCAB], 4, 512, f"token id {VOCAB} is out of range for a vocabulary of {VOCAB}"),
        ([-1], 4, 512, "token id -1"),
        ([1], 0, 512, "max_tokens"),
        ([1], 4, 0, "prefill_chunk_size"),
    ],
)
def test_bad_arguments(prompt, max_tokens, chunk, match):
    model = FakeModel()
    with pytest.raises(ValueError, match=match):
        plain(model, prompt, max_tokens, SamplingParams(), [EOS], 64, prefill_chunk_size=chunk)
    assert model.caches == []


def test_sampling_equals_a_hand_rolled_loop_with_the_same_key_chain():
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=21)
    model = FakeModel()
    result = plain(model, [4, 2], 15, params, [], 64)
    keys, token, want = key_chain(21), 2, []
    for _ in range(15):
        token = sample(model.table[token], params, next(keys)).item()
        want.append(token)
    assert result.token_ids == want
    again = plain(FakeModel(), [4, 2], 15, params, [], 64)
    other = plain(FakeModel(), [4, 2], 15, SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=22), [], 64)
    assert again.token_ids == want != other.token_ids


# ------------------------------------------------------------------ CLI, in process with the fake model


def run_cli(capsys, argv, model=None):
    model = model or FakeModel()
    loaded = []

    def load(pack, dtype, verify):
        loaded.append((Path(pack), dtype))
        return model

    code = main(argv, load=load)
    out, err = capsys.readouterr()
    return code, out, err, loaded


def test_cli_json_with_prompt_ids(capsys, pack_dir, tok):
    model = FakeModel()
    code, out, err, loaded = run_cli(capsys, ["--model", str(pack_dir), "--prompt-ids", "5, 6,7", "--max-tokens", "9",
                                              "--json", "--dtype", "float32"], model)
    assert code == 0, err
    assert loaded == [(Path(pack_dir), "float32")]
    doc = json.loads(out)
    want = model.greedy_chain(7, 9)
    assert doc["token_ids"] == want and doc["text"] == tok.decode(want)
    assert doc["finish_reason"] == "length" and doc["prompt_tokens"] == 3
    stats = doc["stats"]
    assert set(stats) == {"prefill_tok_s", "decode_tok_s", "prefill_seconds", "decode_seconds",
                          "rounds", "accepted_per_round", "per_position_acceptance"}
    assert stats["rounds"] is stats["accepted_per_round"] is stats["per_position_acceptance"] is None
    assert stats["prefill_tok_s"] > 0 and stats["decode_seconds"] > 0
    assert model.prefills == [[5, 6], [7]] and model.caches[-1].max_context == 32768  # the model's own


def test_cli_streams_text_and_prints_stats(capsys, pack_dir, tok):
    model = FakeModel()
    code, out, err, _ = run_cli(capsys, ["--model", str(pack_dir), "--chat", "Hello there", "--max-tokens", "20",
                                         "--prefill-chunk-size", "4", "--max-context", "100"], model)
    assert code == 0, err
    prompt = tok.encode_chat([{"role": "user", "content": "Hello there"}])
    ends = [0] + chunk_ends(0, len(prompt), 4, [len(prompt) - 1])  # chunks of 4, and the last token alone
    assert model.prefills == [prompt[a:b] for a, b in zip(ends, ends[1:])]
    want = model.greedy_chain(prompt[-1], 20)
    assert out == tok.decode(want) + "\n"
    stats, *blas = err.splitlines()  # then, on Linux, the BLAS line (monolith/blas.py)
    assert f"prompt: {len(prompt)} tokens" in stats and "generated: 20 tokens" in stats and "tok/s" in stats
    assert [line[:6] for line in blas] == (["BLAS: "] if sys.platform.startswith("linux") else [])


def test_cli_raw_prompt_sampled_with_seed(capsys, pack_dir, tok):
    argv = ["--model", str(pack_dir), "--prompt", "The cat", "--max-tokens", "12", "--json",
            "--temperature", "0.9", "--top-p", "0.95", "--top-k", "40", "--min-p", "0.01", "--seed", "5"]
    outs = [json.loads(run_cli(capsys, argv)[1]) for _ in range(2)]
    other = json.loads(run_cli(capsys, argv[:-1] + ["6"])[1])
    assert outs[0]["token_ids"] == outs[1]["token_ids"] != other["token_ids"]
    assert outs[0]["prompt_tokens"] == len(tok.encode("The cat"))


def test_cli_stops_at_any_eos_id(capsys, pack_dir):
    model = FakeModel(eos=400, forced={9: 400})  # 400 is an eos id of generation_config only
    code, out, _, _ = run_cli(capsys, ["--model", str(pack_dir), "--prompt-ids", "9", "--json"], model)
    assert code == 0 and json.loads(out)["finish_reason"] == "stop" and json.loads(out)["token_ids"] == []


def test_cli_model_errors_are_one_line_and_our_bugs_show_their_traceback(capsys, pack_dir, tmp_path):
    def unreadable(pack, dtype, verify):
        raise ValueError("shard model-00001 is truncated\nat offset 12")

    def buggy(pack, dtype, verify):
        return None.ndim  # an AttributeError of ours

    code = main(["--model", str(pack_dir), "--prompt-ids", "1"], load=unreadable)
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err == "error: shard model-00001 is truncated at offset 12\n"
    code = main(["--model", str(pack_dir), "--prompt-ids", "1"], load=buggy)
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.startswith("Traceback (most recent call last):")
    assert "return None.ndim" in err and err.splitlines()[-1].startswith("error: internal error (a bug in monolith")
    # a shard damaged after its pack was verified: MLX's RuntimeError, reported as a damaged pack
    damaged = tmp_path / "damaged.pack"
    shutil.copytree(pack_dir, damaged)
    shard = next(damaged.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    proc = cli("--model", str(damaged), "--prompt-ids", "1", "--verify-pack", "never")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr  # after a line: "pack not checked"
    error = proc.stderr.splitlines()[-1]
    assert error.startswith(f"error: {shard}: cannot be read") and "the pack is damaged" in error
    code, out, err, _ = run_cli(capsys, ["--model", str(pack_dir), "--prompt-ids", "1,512"])
    assert code == 1 and err.startswith("error: prompt token id 512 is out of range") and err.count("\n") == 1


# ------------------------------------------------------------------ CLI argument errors, as a subprocess


def cli(*args, env=None):
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "monolith.generate", *args], capture_output=True, text=True,
                          env=full_env, timeout=120, check=False)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "hi"], "the following arguments are required: --model"),
        (["--model", "m"], "one of the arguments --prompt --prompt-ids --chat is required"),
        (["--model", "m", "--prompt", "a", "--chat", "b"], "not allowed with argument"),
        (["--model", "m", "--prompt", "a", "--draft", "d", "--draft-block-size", "0"],
         "--draft-block-size must be at least 1"),
        (["--model", "m", "--prompt", "a", "--draft", "d", "--spec-threshold", "0.2"],
         "--spec-threshold only applies with --spec-sched threshold"),
        (["--model", "m", "--prompt", "a", "--spec-sched", "cost", "--draft-block-size", "4"],
         "--draft-block-size, --spec-sched only apply with a draft (--draft)"),
        (["--model", "m", "--prompt", "a", "--draft-quantization", "none"],
         "--draft-quantization only applies with a draft (--draft)"),
        (["--model", "m", "--prompt", "a", "--spec-sched", "bogus"], "invalid choice: 'bogus'"),
        (["--model", "m", "--prompt", "a", "--temperature", "-1"], "temperature must be"),
        (["--model", "m", "--prompt", "a", "--top-p", "0"], "top_p must be"),
        (["--model", "m", "--prompt", "a", "--top-k", "x"], "invalid int value"),
        (["--model", "m", "--prompt", "a", "--min-p", "1"], "min_p must be"),
        (["--model", "m", "--prompt", "a", "--seed", "-3"], "seed must be"),
        (["--model", "m", "--prompt", "a", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--model", "m", "--prompt", "a", "--dtype", "float16"], "invalid choice: 'float16'"),
        (["--model", "m", "--prompt-ids", "1,x,3"], "--prompt-ids must be comma-separated token ids"),
        (["--model", "m", "--prompt-ids", "1,-2"], "--prompt-ids must be comma-separated token ids"),
        (["--model", "/nonexistent/model/dir", "--prompt", "a"], "/nonexistent/model/dir"),
    ],
)
def test_cli_argument_errors(args, message):
    proc = cli(*args)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_prompt_too_long_and_corrupt_pack(pack_dir, tmp_path):
    proc = cli("--model", str(pack_dir), "--prompt-ids", "1,2,3", "--max-context", "3")
    assert proc.returncode == 1 and proc.stderr == (
        "error: prompt is 3 tokens but max_context is 3: the prompt plus at least one generated token must fit\n"
    )
    chat = cli("--model", str(pack_dir), "--chat", "hello " * 50, "--max-context", "20")
    assert chat.returncode == 1 and "but max_context is 20" in chat.stderr
    bad = tmp_path / "bad.pack"
    shutil.copytree(pack_dir, bad)
    (bad / "tokenizer.json").write_text("{")
    proc = cli("--model", str(bad), "--prompt", "hi")
    assert proc.returncode == 1 and "tokenizer.json" in proc.stderr and proc.stderr.count("\n") == 1
    (bad / "manifest.json").write_text("{")
    proc = cli("--model", str(bad), "--prompt", "hi")
    assert proc.returncode == 1 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_cli_help_exits_zero():
    proc = cli("--help")
    assert proc.returncode == 0 and "--prompt-ids" in proc.stdout and "--spec-sched" in proc.stdout


# ------------------------------------------------------------------ integration with the real model


def test_cli_with_the_real_model_on_a_synth_pack(tmp_path):
    from monolith import models
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "monolith.synth", "target", "--out", str(target)], check=True,
                   capture_output=True)
    env = {"MONOLITH_CACHE": str(tmp_path / "cache")}
    prompt = [401, 316, 265, 198, 71, 72, 402, 198, 401]
    base = ["--model", str(target), "--prompt-ids", ",".join(map(str, prompt)), "--json", "--dtype", "float32",
            "--max-tokens", "10"]

    def run(*extra):
        proc = cli(*base, *extra, env=env)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    greedy = run()
    assert greedy["prompt_tokens"] == len(prompt) and greedy["token_ids"]
    assert run()["token_ids"] == greedy["token_ids"]

    # the same greedy tokens from a hand-rolled loop over the model (one full forward, then one token at a time)
    from monolith.pack import resolve_pack

    pack = resolve_pack(str(target), role="target", cache_dir=tmp_path / "cache2")
    model = models.load_model(pack, dtype="float32")
    stops = set(load_tokenizer(pack).eos_token_ids)
    cache = model.make_cache(64)
    logits, _ = model(mx.array(prompt, dtype=mx.int32), cache)
    want = []
    while len(want) < 10:
        token = int(mx.argmax(logits[-1]).item())
        if token in stops:
            break
        want.append(token)
        logits, _ = model(mx.array([token], dtype=mx.int32), cache)
    assert greedy["token_ids"] == want
    assert greedy["finish_reason"] == ("length" if len(want) == 10 else "stop")

    full = run("--max-context", str(len(prompt) + 3))  # the real cache at its limit
    assert full["token_ids"] == want[:3] and full["finish_reason"] == ("length" if len(want) >= 3 else "stop")

    sampled = run("--temperature", "1.0", "--seed", "3")
    assert run("--temperature", "1.0", "--seed", "3")["token_ids"] == sampled["token_ids"]
    assert run("--temperature", "1.0", "--seed", "4")["token_ids"] != sampled["token_ids"]
