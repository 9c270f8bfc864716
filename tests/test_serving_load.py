"""The server under load and bad input: metrics, concurrent clients, disconnects and
cancellation, 400s that name the field, body limits, the API key, a full queue, the
engine session's exact-prefix resume."""

from __future__ import annotations

import json
import platform
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import openai
import pytest
from serving_rig import MAX_CONTEXT, NAME, TOOLS, Scripted, Server, assert_error, chat_ids, expected

from monolith.runtime import memory_trim
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.events import GenerationRequest
from monolith.runtime.stats import SpecStats
from monolith.sampling import SamplingParams
from monolith.serving.requests import SamplingDefaults

# ------------------------------------------------------------------ metrics, concurrency, cancellation


def test_metrics_move(server):
    before = {k: server.metric(k) for k in ("monolith_prompt_tokens_total", "monolith_generation_tokens_total",
                                            'monolith_requests_total{endpoint="chat",status="200"}')}
    r = server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "count me"}],
                                                max_tokens=7, temperature=0)
    assert server.metric('monolith_requests_total{endpoint="chat",status="200"}') == before[
        'monolith_requests_total{endpoint="chat",status="200"}'] + 1
    prompt_tokens = before["monolith_prompt_tokens_total"] + r.usage.prompt_tokens
    assert server.metric("monolith_prompt_tokens_total") == prompt_tokens
    assert server.metric("monolith_generation_tokens_total") == before["monolith_generation_tokens_total"] + 7
    text = httpx.get(server.url + "/metrics").text
    for name in ("monolith_time_to_first_token_seconds_count", "monolith_e2e_request_latency_seconds_count",
                 "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "monolith_num_requests_waiting"):
        assert name in text



def test_memory_metrics_account_for_the_process(server):
    """The memory series read MLX's allocator and the kernel's RSS: the server runs in
    this process, so they agree with what this process sees itself."""
    rss_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
    served = server.metric("process_resident_memory_bytes")
    assert abs(served - rss_kib * 1024) < 64 * 2**20
    active = server.metric("monolith_mlx_active_bytes")
    assert 2**20 < active <= mx.get_peak_memory()  # the weights at least
    assert abs(active - mx.get_active_memory()) < 16 * 2**20
    assert server.metric("monolith_mlx_peak_bytes") >= active
    assert server.metric("monolith_mlx_cache_bytes") >= 0


def _rss() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))


def test_heap_trim_is_there_with_glibc_and_on_macos():
    assert memory_trim.trim() == (platform.libc_ver()[0] == "glibc" or sys.platform == "darwin")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc's arenas")
def test_heap_trim_hands_back_what_a_thread_freed():
    """The RSS growth bench/fuzz.py saw: memory a worker thread freed stays in its arena
    (pinned by a few live blocks) until memory_trim.trim()."""
    kept = []

    def churn():
        blocks = [bytes(4096) for _ in range(40_000)]  # 160 MiB of malloc'd blocks in this thread's arena
        kept.extend(blocks[::200])  # a live block every 800 KiB: the arena cannot shrink from its top
        del blocks

    worker = threading.Thread(target=churn)
    worker.start()
    worker.join()
    held = _rss()
    assert memory_trim.trim()
    assert held - _rss() > 64 * 2**20
    assert len(kept) == 200


def test_engine_trims_the_heap_when_it_goes_idle(model, tok, monkeypatch):
    trims = []
    monkeypatch.setattr(memory_trim, "trim", lambda: trims.append(1) or True)
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=Scripted(tok.encode("ab")))
    try:
        for prompt in ("x", "y"):
            engine.run_request(GenerationRequest(prompt_ids=tuple(tok.encode(prompt)), max_tokens=2))
        deadline = time.monotonic() + 10
        while len(trims) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(trims) == 2  # once after each request, none while waiting
    finally:
        engine.close()


def test_a_large_request_body_trims_the_heap_after_it(server, monkeypatch):
    """Bodies the HTTP layer refuses never reach the engine: the app trims after any
    body of a MiB or more (the fuzz run's multi-MiB prompts), and not after small ones."""
    trims = []
    monkeypatch.setattr(memory_trim, "trim", lambda: trims.append(1) or True)
    big = {"model": NAME, "prompt": "word " * 300_000, "max_tokens": "many"}  # 1.5 MiB, then a 400
    assert_error(server.post("/v1/completions", big), 400, "max_tokens")
    assert len(trims) == 1
    assert_error(server.post("/v1/completions", {**big, "prompt": "word"}), 400, "max_tokens")
    assert len(trims) == 1

def test_speculative_counters_reach_metrics(model, tok):
    spec = SpecStats(7, [7, 7, 7], [5, 3, 2])  # 3 drafts, 21 draft tokens, 10 accepted: (3, 3, 2, 1, 1, 0, 0) by position
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT),
                               decoder=Scripted([65, 66, 67], spec))) as s:
        s.wait_ready().client().completions.create(model=NAME, prompt="x")
        s.client().completions.create(model=NAME, prompt="y")
        assert s.metric("spec_decode_num_drafts_total") == 6
        assert s.metric("spec_decode_num_draft_tokens_total") == 42
        assert s.metric("spec_decode_num_accepted_tokens_total") == 20
        assert s.metric('spec_decode_num_accepted_tokens_per_pos_total{position="0"}') == 6
        assert s.metric('spec_decode_num_accepted_tokens_per_pos_total{position="3"}') == 2


def test_concurrent_clients_get_complete_correct_answers(server, model, tok):
    prompts = [f"Client number {i} asks" for i in range(6)]
    want = [expected(model, tok, chat_ids(tok, p), 16)[1] for p in prompts]
    client = server.client()

    def ask(i):
        if i % 2:
            chunks = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompts[i]}],
                                                    max_tokens=16, temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompts[i]}],
                                           max_tokens=16, temperature=0)
        return r.choices[0].message.content

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(ask, range(len(prompts))))
    assert got == want


@pytest.fixture(scope="module")
def long_server(model, tok):
    """Replies long enough to interrupt: 20000 tokens at 200 per second."""
    endless = Scripted(tok.encode(" word") * 20000, per_token=0.005)
    with Server(lambda: Engine(model, tok, Limits(max_context=60000), decoder=endless)) as s:
        yield s.wait_ready()


def _cancelled(s):
    return s.metric('monolith_request_finished_total{finish_reason="cancelled"}')


def test_disconnect_mid_stream_frees_the_engine(long_server):
    s = long_server
    before = _cancelled(s)
    started = time.monotonic()
    with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                      json={"prompt": "go on", "max_tokens": 50000, "temperature": 0, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break  # leaving the block closes the connection mid-stream
    r = s.client().completions.create(model=NAME, prompt="next please", max_tokens=5, temperature=0)
    assert (" word" * 5).startswith(r.choices[0].text) and r.usage.completion_tokens == 5
    assert time.monotonic() - started < 20
    deadline = time.monotonic() + 10
    while _cancelled(s) < before + 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_disconnect_while_waiting_for_a_non_streamed_answer(long_server):
    s = long_server
    before = _cancelled(s)
    body = json.dumps({"prompt": "go on", "max_tokens": 50000, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.5)
    deadline = time.monotonic() + 10
    while _cancelled(s) < before + 1:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)
    assert s.client().completions.create(model=NAME, prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_cancel_stops_real_decoding_at_the_next_token(model, tok):
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT))
    try:
        seen = []

        def sink(event):
            seen.append(event)
            if len(seen) == 3:
                job.cancel()

        job = engine.submit(GenerationRequest(tuple(chat_ids(tok, "cancel me")), 500, SamplingParams(0.0)), sink)
        assert job.done.wait(30)
        finished = seen[-1]
        assert finished.finish_reason == "cancelled" and 1 <= finished.usage.completion_tokens <= 10
        _, after = engine.run_request(GenerationRequest(tuple(chat_ids(tok, "cancel me")), 3))
        assert after.usage.cached_tokens == after.usage.prompt_tokens - 1  # the session survived the cancel
    finally:
        engine.close()


def test_keep_alive_comments_during_a_long_prefill(model, tok):
    slow = Scripted(tok.encode("late"), delay=1.0)
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=slow), keepalive_seconds=0.2) as s:
        s.wait_ready()
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={"prompt": "x", "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
    assert sum(line.startswith(": keep-alive") for line in lines) >= 3
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert text == "late" and lines[-1] == "data: [DONE]"


# ------------------------------------------------------------------ bad input


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.0}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"n": 2}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"frobnicate": True}, "frobnicate"),
    ({"response_format": {"type": "regex"}}, "response_format.type"),
    ({"tool_choice": "any", "tools": TOOLS}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("change,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_fields_are_400_naming_the_field(server, change, param):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **change}
    if not change:  # the case without messages
        del body["messages"]
    error = assert_error(server.post("/v1/chat/completions", body), 400, param=param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("change,param", [({"prompt": ""}, "prompt"), ({"prompt": [1, -2]}, "prompt"),
                                          ({"prompt": [1, 99999]}, "prompt"), ({"prompt": ["a", 5]}, "prompt[0]"),
                                          ({"prompt": 7}, "prompt"), ({"echo": 1}, "echo"),
                                          ({"best_of": 3}, "best_of"), ({"logprobs": 50}, "logprobs"),
                                          ({"suffix": "end"}, "suffix")])
def test_bad_completion_fields_are_400(server, change, param):
    assert_error(server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, **change}), 400, param=param)


def test_malformed_and_oversized_bodies_and_unknown_things(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', timeout=10)
    assert "JSON" in assert_error(r, 400)["message"]
    assert_error(httpx.post(server.url + "/v1/chat/completions", content=b"[1, 2]", timeout=10), 400)
    assert_error(httpx.post(server.url + "/v1/chat/completions", content=b"\xff\xfe", timeout=10), 400)
    unknown = {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
    assert_error(server.post("/v1/chat/completions", unknown), 404, param="model", code="model_not_found")
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.url + "/v1/chat/completions"), 405)
    long_prompt = list(range(5, 5 + 300)) * 4  # 1200 tokens > the 1024 context
    assert_error(server.post("/v1/completions", {"prompt": long_prompt}), 400, param="prompt",
                 code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model=NAME, n=3, messages=[{"role": "user", "content": "x"}])
    # the server still answers normally
    assert server.client().completions.create(model=NAME, prompt="fine", max_tokens=2).usage.completion_tokens == 2


def test_body_over_the_limit_is_refused_unread(model, tok):
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)), max_request_bytes=1000) as s:
        s.wait_ready()
        assert_error(s.post("/v1/completions", {"prompt": "x" * 2000}), 413, code="request_too_large")
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:  # announce 1 GB, send nothing
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000000\r\n\r\n{")
            reply = sock.recv(4096).decode()
        assert reply.startswith("HTTP/1.1 413")
        assert s.client().completions.create(model=NAME, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_api_key(model, tok):
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)), api_key="s3cret") as s:
        s.wait_ready()
        assert httpx.get(s.url + "/health").status_code == 200  # no key needed
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            assert_error(httpx.get(s.url + "/v1/models", headers=headers), 401, code="invalid_api_key")
            assert_error(s.post("/v1/completions", {"prompt": "x"}, headers=headers), 401)
        assert_error(httpx.get(s.url + "/metrics"), 401)
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="nope").models.list()
        r = s.client(api_key="s3cret").completions.create(model=NAME, prompt="x", max_tokens=1)
        assert r.usage.completion_tokens == 1
        assert httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_full_queue_429_and_queue_timeout_503(model, tok):
    slow = Scripted(tok.encode("slow answer"), per_token=0.3)
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_queue=1, queue_timeout=1.0),
                               decoder=slow)) as s:
        s.wait_ready()
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(s.post, "/v1/completions", {"prompt": "a"})
            time.sleep(0.3)
            waiting = pool.submit(s.post, "/v1/completions", {"prompt": "b"})
            time.sleep(0.3)
            assert_error(s.post("/v1/completions", {"prompt": "c"}), 429, code="queue_full")
            with pytest.raises(openai.RateLimitError):
                s.client().completions.create(model=NAME, prompt="d")
            assert running.result().status_code == 200
            assert_error(waiting.result(), 503, code="queue_timeout")
        assert s.post("/v1/completions", {"prompt": "e"}).json()["choices"][0]["text"] == "slow answer"


def test_health_is_503_until_the_model_is_loaded(model, tok):
    release = threading.Event()

    def load():
        assert release.wait(30)
        return Engine(model, tok, Limits(max_context=MAX_CONTEXT))

    with Server(load) as s:
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert_error(s.post("/v1/completions", {"prompt": "x"}), 503, code="model_loading")
        release.set()
        s.wait_ready(10)
        assert s.client().completions.create(model=NAME, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_sampling_defaults_come_from_generation_config():
    d = SamplingDefaults.from_generation_config({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95})
    assert (d.temperature, d.top_k, d.top_p, d.min_p) == (0.6, 20, 0.95, 0.0)
    assert SamplingDefaults.from_generation_config({"do_sample": False}).temperature == 0
    assert SamplingDefaults.from_generation_config(None) == SamplingDefaults()


def test_engine_session_resumes_only_from_exact_prefixes(model, tok):
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT))
    try:
        ids = chat_ids(tok, "session")
        _, first = engine.run_request(GenerationRequest(tuple(ids), 6))
        sequence = ids + list(first.token_ids)
        _, resumed = engine.run_request(GenerationRequest(tuple(sequence + [65, 66]), 4))
        assert resumed.usage.cached_tokens == len(sequence) - 1  # the 6th token was never fed
        changed = list(sequence)
        changed[len(ids) + 2] = (changed[len(ids) + 2] + 1) % 300
        _, partial = engine.run_request(GenerationRequest(tuple(changed), 4))
        assert partial.usage.cached_tokens == len(ids)  # diverges in the reply: resumes at the prompt's end
        changed[3] = (changed[3] + 1) % 300
        _, fresh = engine.run_request(GenerationRequest(tuple(changed), 4))
        assert fresh.usage.cached_tokens == 0  # diverges inside the prompt: no exact point, a fresh prefill
        want, _ = expected(model, tok, changed, 4)
        assert list(fresh.token_ids) == want.token_ids
    finally:
        engine.close()
