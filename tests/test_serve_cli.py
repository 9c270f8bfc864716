"""`python -m monolith.serve` as a process: the bundled demo pair, flags, usage errors,
a model that cannot load, and serve's decision whether drafting pays."""

# ruff: noqa: F811 - the fixtures imported below are test parameters
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from serving_rig import MAX_CONTEXT

from monolith.models import load_model
from monolith.serve import build_parser, server_config
from monolith.serving.images import ImageLimits

# ------------------------------------------------------------------ the command line


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "monolith.serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _wait_health(port, proc, timeout=600):
    # a bound on a state that must come, not a verdict on speed: a first start builds the
    # packs and measures the drafters, which took over a minute on 2 loaded cores
    deadline = time.monotonic() + timeout
    seen_503 = False
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        if r.status_code == 200:
            return seen_503
        seen_503 |= r.status_code == 503
        time.sleep(0.02)
    raise AssertionError("the server never became ready")


def _stop(proc) -> str:
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    return out


def test_cli_serves_the_demo_pair_and_reuses_it(tmp_path):
    env = {**os.environ, "MONOLITH_CACHE": str(tmp_path / "cache")}
    logs, loading = [], []
    # the default start (serve's fallback decides from the measured round cost), then one
    # that drafts whatever the cost (an explicit scheduler has no fallback)
    for extra in ((), ("--spec-sched", "fixed")):
        port = _free_port()
        proc = _serve("--port", str(port), "--dtype", "float32", *extra, env=env)
        try:
            loading.append(_wait_health(port, proc))
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            assert [m.id for m in client.models.list().data] == ["monolith-demo"]
            r = client.chat.completions.create(model="monolith-demo", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
            assert r.usage.completion_tokens == 3
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        finally:
            logs.append(_stop(proc))
    assert re.search(r"^spec_decode_num_drafts_total [1-9]", metrics, re.MULTILINE)  # the demo draft is in use
    # the first start builds and checks the bundled pair's packs, the second finds them
    assert "built the demo target pack" in logs[0] and "built the demo draft pack" in logs[0]
    assert "built the demo" not in logs[1]
    assert "loaded the target" in logs[0] and "loading the draft" in logs[0]
    # the default start measures the demo's DSpark draft and its target's MTP head and
    # drafts with the one that pays best, if any (none on MLX's Linux CPU wheel)
    [choice] = re.findall(r"drafters measured on .*", logs[0])
    assert "packs/demo/draft: " in choice and "mtp: " in choice and "plain decoding: 1.00x" in choice
    drafts = "best: " in choice
    assert ("with draft" in logs[0]) == drafts and ("(plain decoding)" in logs[0]) == (not drafts)
    # one line says how the start decodes, after the choice, and nothing before it claims otherwise
    [decided] = re.findall(r"(?<=INFO:     )decoding: .*", logs[0])
    assert decided.startswith("decoding: drafting with" if drafts else "decoding: plain (")
    assert logs[0].index(choice) < logs[0].index(decided) and "drafting with the target's MTP head" not in logs[0]
    assert "with draft" in logs[1] and "drafters measured" not in logs[1] and "the first of 2 drafters" in logs[1]
    assert "--spec-sched fixed measures nothing" in logs[1] and "serve and chat measure" not in logs[1]
    assert "decoding: drafting with " in logs[1] and "(--spec-sched fixed: always)" in logs[1]
    # the model's load polls /health until ready: its 503 answers are logged once
    assert [log.count('"GET /health HTTP/1.1" 503') for log in logs] == [int(seen) for seen in loading]
    assert len(list((tmp_path / "cache" / "packs").glob("*/manifest.json"))) == 2


def test_serve_decodes_plainly_where_a_drafted_round_cannot_pay(monkeypatch, synth_pair):
    from monolith import engine_setup
    from monolith.runtime.calibrate import BreakEven

    target_pack, draft, _ = synth_pair
    model = load_model(target_pack, dtype="float32")
    args = argparse.Namespace(draft_quantization="none", draft_pack=None, draft_revision=None, local_files_only=True,
                              verify_pack="first", dtype="float32", max_context=MAX_CONTEXT, prefill_chunk_size=512,
                              draft_block_size=None, spec_sched=None, spec_threshold=None)
    logs = []
    # 7 proposals: a round emits at most 8 tokens; with the margin it drafts up to 7.2
    for cost, drafts in ((7.2, True), (8.0, False)):
        monkeypatch.setattr(engine_setup, "measure_break_even", lambda *a, c=cost, **k: BreakEven(c, (c, c, c)))
        drafter = engine_setup.speculative_drafter(args, model, draft, logs.append)
        decoder = engine_setup.drafting_decoder(args, model, drafter, logs.append)[0]
        if drafts:
            assert decoder.break_even == cost
        else:
            assert decoder is None
    assert sum("a request drafts while its rounds emit at least that many tokens" in m for m in logs) == 1
    assert "drafting pays below 7.2 (a round emits at most 8 tokens): it cannot pay" in logs[-1]


def test_cli_flags(tmp_path, pack):
    port = _free_port()
    proc = _serve("--model", str(pack), "--port", str(port), "--dtype", "float32", "--served-model-name", "a", "b",
                  "--api-key", "k", "--max-context", "256", "--prefill-chunk-size", "16", "--no-warmup",
                  "--log-level", "warning", "--max-queue", "2", "--queue-timeout", "5", "--max-batch", "3")
    try:
        _wait_health(port, proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["a", "b"]
        assert client.models.list().data[0].max_model_len == 256
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="b", prompt=list(range(300)))
        assert client.completions.create(model="b", prompt="x", max_tokens=2).usage.completion_tokens == 2
    finally:
        _stop(proc)


def test_the_deprecated_prompt_cache_checkpoint_every_sets_what_prompt_cache_save_every_sets():
    parser = build_parser()
    new = parser.parse_args(["--prompt-cache-save-every", "48"])
    old = parser.parse_args(["--prompt-cache-checkpoint-every", "48"])
    assert vars(old) == vars(new) and new.prompt_cache_save_every == 48
    assert vars(parser.parse_args([])) != vars(new)
    shown = parser.format_help()
    assert "--prompt-cache-save-every" in shown and "--prompt-cache-checkpoint-every" not in shown


def test_image_flags_reach_the_server_config():
    plan = argparse.Namespace(name="m")
    args = build_parser().parse_args(["--allow-image-urls", "--max-image-bytes", "5M", "--max-images", "3"])
    assert server_config(args, plan).images == ImageLimits(max_bytes=5 * 2**20, max_images=3, allow_urls=True)
    assert server_config(build_parser().parse_args([]), plan).images == ImageLimits()


def test_max_output_tokens_reaches_the_server_config():
    plan = argparse.Namespace(name="m")
    assert server_config(build_parser().parse_args(["--max-output-tokens", "512"]), plan).max_output_tokens == 512
    assert server_config(build_parser().parse_args([]), plan).max_output_tokens is None  # the model's default


@pytest.mark.parametrize("args,message", [
    (["--no-draft", "--draft-block-size", "3"], "only appl"),
    (["--prompt-cache-save-every", "-1"], "--prompt-cache-save-every must be at least 0"),
    (["--spec-sched", "cost", "--model", "x"], "only appl"),
    (["--max-context", "1"], "--max-context"),
    (["--port", "99999"], "--port"),
    (["--max-queue", "0"], "--max-queue"),
    (["--max-batch", "0"], "--max-batch"),
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", "  "], "--api-key is empty"),
    (["--max-tokens-limit", "0"], "--max-tokens-limit"),
    (["--max-output-tokens", "0"], "--max-output-tokens"),
    (["--response-store-size", "0"], "--response-store-size"),
    (["--response-store-bytes", "0"], "--response-store-bytes"),
    (["--max-images", "0"], "--max-images"),
    (["--response-store-bytes", "lots"], "not a byte size"),
    (["--bogus"], "unrecognized"),
    (["--model", "x", "--model", "y", "--pack", "p"], "--pack names one model's"),
    (["--model", "x", "--model", "y", "--served-model-name", "a"], "1 names for 2 models"),
    (["--model", "x", "--model", "x"], "given twice"),
    (["--max-loaded-models", "0"], "--max-loaded-models"),
    (["--keep-alive", "soon"], "--keep-alive"),
])
def test_cli_usage_errors_exit_1(args, message):
    r = subprocess.run([sys.executable, "-m", "monolith.serve", *args], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr


def test_cli_response_store_that_cannot_be_made_exits_1(tmp_path):
    (tmp_path / "responses").write_text("a file where the stored responses' directory goes")
    r = subprocess.run([sys.executable, "-m", "monolith.serve", "--prompt-cache-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1 and "error: --prompt-cache-dir" in r.stderr and "Traceback" not in r.stderr


def test_cli_model_that_cannot_load_exits_1(tmp_path):
    port = _free_port()
    proc = _serve("--model", str(tmp_path / "missing"), "--port", str(port), "--local-files-only")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "error:" in out and "Traceback" not in out
    assert re.search(r"error: .*missing", out)


def test_cli_serves_two_models_and_unloads_the_idle_one(pack, other_pack):
    port = _free_port()
    proc = _serve("--model", str(pack), "--model", str(other_pack), "--served-model-name", "a", "b",
                  "--port", str(port), "--dtype", "float32", "--max-context", "256", "--no-warmup",
                  "--prompt-cache-size", "0", "--keep-alive", "0")
    try:
        _wait_health(port, proc)
        url = f"http://127.0.0.1:{port}"
        listed = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["a", "b"] and listed[1]["loaded"] is False
        r = httpx.post(url + "/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "b"
        deadline = time.monotonic() + 60
        while any(m["loaded"] for m in httpx.get(url + "/v1/models").json()["data"]):  # --keep-alive 0
            assert time.monotonic() < deadline, "an idle model was never unloaded"
            time.sleep(0.02)
        assert 'monolith_model_loaded{model="b"} 0.0' in httpx.get(url + "/metrics").text
    finally:
        out = _stop(proc)
    assert "2 models: a, b" in out and "memory budget" in out and "unloaded b" in out
