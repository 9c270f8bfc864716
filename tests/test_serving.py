"""The HTTP server (monolith.serving, python -m monolith.serve) and the engine behind it:
real uvicorn servers on 127.0.0.1 driven by the official `openai` client and httpx,
a tiny synthetic target in float32, and scripted engine decoders for tool calls,
speculative counters, slow prefills and full queues."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
import uvicorn

from monolith.models import load_model
from monolith.pack import build_pack
from monolith.runtime.calibrate import measure_break_even
from monolith.runtime.session import Session
from monolith.runtime.speculative import SpeculativeDecoder
from decoding import plain
from monolith.launch import load_drafter
from monolith.runtime.engine import Engine
from monolith.runtime.events import GenerationRequest, Outcome
from monolith.runtime.stats import SpecStats
from monolith.sampling import SamplingParams
from monolith.runtime.textstream import TextStream
from monolith.serving.app import ServerConfig, create_app
from monolith.serving.schemas import SamplingDefaults
from monolith.serving.tools import ToolCallParser, parse_tool_calls
from monolith.synth import write_pair, write_target
from monolith.tokenizer import IncrementalDetokenizer, load_tokenizer

MAX_CONTEXT = 1024
NAME = "tiny"
GREEDY = SamplingParams()


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    return build_pack(write_target(root / "ckpt"), root / "pack", role="target")


@pytest.fixture(scope="module")
def model(pack):
    return load_model(pack, dtype="float32")


@pytest.fixture(scope="module")
def tok(pack):
    return load_tokenizer(pack)


class Server:
    """A uvicorn server on a free port of 127.0.0.1, in a thread of this process."""

    def __init__(self, load, **config):
        config.setdefault("model_names", (NAME,))
        self.app = create_app(load, ServerConfig(**config))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def wait_ready(self, timeout=30):
        deadline = time.monotonic() + timeout
        while httpx.get(self.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.02)
        return self

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=60, **kw)

    def post(self, path, body, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, **kw)

    def metric(self, line_start: str, **kw) -> float:
        text = httpx.get(self.url + "/metrics", **kw).text
        for line in text.splitlines():
            if line.startswith(line_start + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(model, tok):
    with Server(lambda: Engine(model, tok, max_context=MAX_CONTEXT)) as s:
        yield s.wait_ready()


def scripted(tokens, spec=None, delay=0.0, per_token=0.0):
    """An engine decoder that 'generates' `tokens` and stops with a stop token."""

    def decoder(session, prompt, max_tokens, params, stop_ids, on_token, logprobs=None, cancelled=lambda: False):
        time.sleep(delay)
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        out = []
        for t in tokens[:limit]:
            if cancelled():
                return Outcome(out, "abort", len(prompt), 0, delay, 0.0, len(out))
            time.sleep(per_token)
            out.append(t)
            if not on_token(t, None):
                return Outcome(out, "abort", len(prompt), 0, delay, 0.0, len(out))
        done = limit == len(tokens)
        return Outcome(out, "stop" if done else "length", len(prompt), 0, delay, 0.01, len(out), stop_token=done,
                       speculative=spec)

    return decoder


def expected(model, tok, prompt_ids, max_tokens, params=GREEDY):
    result = plain(model, prompt_ids, max_tokens, params, set(tok.eos_token_ids) | set(model.args.eos_token_ids),
                      MAX_CONTEXT)
    return result, tok.decode(result.token_ids)


def chat_ids(tok, text):
    return tok.encode_chat([{"role": "user", "content": text}])


def assert_error(response: httpx.Response, status: int, param=None, code=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and "Traceback" not in response.text
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


# ------------------------------------------------------------------ chat and completions


def test_models_and_health(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME] and models.data[0].object == "model"
    assert models.data[0].owned_by and models.data[0].created > 0


def test_greedy_chat_equals_plain_decoding(server, model, tok):
    result, text = expected(model, tok, chat_ids(tok, "Hello there"), 24)
    r = server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello there"}],
                                                max_tokens=24, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == text
    assert choice.finish_reason == result.finish_reason == "length"
    assert r.usage.prompt_tokens == result.prompt_tokens
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == result.prompt_tokens + 24


def test_greedy_completion_string_and_token_list(server, model, tok):
    ids = tok.encode("The quick brown fox")
    result, text = expected(model, tok, ids, 16)
    client = server.client()
    by_text = client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=16, temperature=0)
    assert by_text.choices[0].text == text and by_text.object == "text_completion"
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 16
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == text and by_ids.choices[0].finish_reason == "length"


def test_finish_reason_stop_counts_the_stop_token(model, tok):
    eos = tok.eos_token_ids[0]
    with Server(lambda: Engine(model, tok, max_context=MAX_CONTEXT, decoder=scripted(tok.encode("Hi!")))) as s:
        s.wait_ready()
        r = s.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}])
        assert r.choices[0].message.content == "Hi!" and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == len(tok.encode("Hi!")) + 1  # the stop token is generated too
        assert eos in tok.eos_token_ids


def test_streamed_chat_equals_non_streamed_with_usage(server, model, tok):
    _, text = expected(model, tok, chat_ids(tok, "Stream me"), 20)
    stream = server.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Stream me"}], max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completion(server, model, tok):
    ids = tok.encode("Once upon a time")
    _, text = expected(model, tok, ids, 12)
    chunks = list(server.client().completions.create(model=NAME, prompt="Once upon a time", max_tokens=12,
                                                      temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_sse_framing(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    for line in lines[:-1]:
        assert json.loads(line[6:])["object"] == "chat.completion.chunk"


def stop_across_boundary(tok, token_ids):
    """A stop string made of the end of one token's text and the start of the next's,
    and where it first occurs in the text."""
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(t) for t in token_ids]
    text = "".join(pieces)
    pos = 0
    for a, b in zip(pieces, pieces[1:]):
        pos += len(a)
        if a.isprintable() and b.isprintable() and len(a.strip()) and len(b.strip()):
            stop = a[-1] + b[0]
            if text.find(stop) == pos - 1 and pos > 2:
                return stop, pos - 1
    pytest.fail("no printable token boundary in this output: pick a prompt whose reply has one")


def test_stop_string_across_tokens_never_appears(server, model, tok):
    messages = [{"role": "user", "content": "Tell me a story"}]
    result, text = expected(model, tok, tok.encode_chat(messages), 60)
    stop, at = stop_across_boundary(tok, result.token_ids)
    client = server.client()
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=60, temperature=0,
                                       stop=["NEVER-THERE", stop])
    assert r.choices[0].message.content == text[:at] and r.choices[0].finish_reason == "stop"
    streamed = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=60, temperature=0,
                                                   stop=stop, stream=True))
    deltas = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(deltas) == text[:at] and stop not in "".join(deltas)
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_text_stream_holds_back_stop_prefixes_and_partial_characters(tok):
    ids = tok.encode("héllo wörld")
    stream = TextStream(tok, stop=("wö",))
    pieces = [d.text for d in (stream.add(t) for t in ids) if d is not None]
    tail = stream.finish()
    assert "".join(pieces) + (tail.text if tail else "") == "héllo "
    assert stream.stopped and all("\ufffd" not in p for p in pieces)


def test_seed_reproduces_and_matches_in_process_sampling(server, model, tok):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    ids = tok.encode("Random words")
    _, text = expected(model, tok, ids, 20, params)
    client = server.client()
    runs = [client.completions.create(model=NAME, prompt="Random words", max_tokens=20, temperature=0.9, top_p=0.95,
                                      seed=1234, extra_body={"top_k": 50}).choices[0].text for _ in range(2)]
    assert runs == [text, text]
    other = {client.completions.create(model=NAME, prompt="Random words", max_tokens=20, temperature=0.9,
                                       seed=s).choices[0].text for s in (1, 2, 3)}
    assert len(other) > 1


def test_logprobs_from_the_logits(server, model, tok):
    import mlx.core as mx

    messages = [{"role": "user", "content": "Logprobs please"}]
    ids = tok.encode_chat(messages)
    cache = model.make_cache(MAX_CONTEXT)
    first = model.prefill(mx.array(ids, dtype=mx.int32), cache)
    want = (first - mx.logsumexp(first)).tolist()
    r = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                                logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == 5
    top0 = entries[0].top_logprobs
    assert len(top0) == 3 and [t.logprob for t in top0] == sorted((t.logprob for t in top0), reverse=True)
    best = sorted(range(len(want)), key=lambda i: -want[i])[:3]
    assert [round(t.logprob, 4) for t in top0] == [round(want[i], 4) for i in best]
    for e in entries:  # greedy: the chosen token is the most likely one
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.bytes == e.top_logprobs[0].bytes
    legacy = server.client().completions.create(model=NAME, prompt="abc", max_tokens=4, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


def test_prefix_cache_reports_cached_tokens(server, tok):
    client = server.client()
    ids = tok.encode("A prompt that is reused by the next requests")
    first = client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0)
    again = client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0)
    longer = client.completions.create(model=NAME, prompt=ids + tok.encode(" and more"), max_tokens=4, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids)
    assert longer.usage.prompt_tokens_details.cached_tokens == len(ids)


def test_thinking_switch_reaches_the_template(server, tok):
    messages = [{"role": "user", "content": "think?"}]
    off = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=1, temperature=0,
                                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=1, temperature=0)
    assert off.usage.prompt_tokens == len(tok.encode_chat(messages, enable_thinking=False))
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


# ------------------------------------------------------------------ tool calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
JSON_CALL = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
             '</tool_call>')
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def test_tool_call_parser():
    content, calls = parse_tool_calls(JSON_CALL, TOOLS)
    assert content == "Let me check." and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}
    content, calls = parse_tool_calls(XML_CALL + "\n" + XML_CALL.replace("San Francisco", "Oslo"), TOOLS)
    assert content is None and [json.loads(c.arguments) for c in calls] == [
        {"city": "San Francisco", "days": 3}, {"city": "Oslo", "days": 3}]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    bare, calls = parse_tool_calls("<function=f><parameter=x>\n[1, 2]\n</parameter></function>")
    assert bare is None and json.loads(calls[0].arguments) == {"x": [1, 2]}
    broken = "<tool_call>\n{not json}\n</tool_call> after"
    assert parse_tool_calls(broken, TOOLS) == (broken, [])
    assert parse_tool_calls("a < b and <tool_ca", TOOLS) == ("a < b and <tool_ca", [])


def test_tool_call_parser_streams_nothing_of_a_call_before_it_is_complete():
    text = JSON_CALL + " Done."
    parser = ToolCallParser(TOOLS)
    released, calls = [], []
    for i, ch in enumerate(text):
        content, new = parser.feed(ch)
        released.append(content)
        calls += new
        if new:
            assert i == len(JSON_CALL) - 1  # the call arrives the moment its block closes
        assert "<" not in "".join(released).replace("Let me check.", "")
    content, new = parser.finish()
    assert "".join(released) + content == "Let me check.\n Done." and len(calls) == 1 and not new


@pytest.mark.parametrize("text", [JSON_CALL, XML_CALL])
def test_tool_calls_over_http(model, tok, text):
    with Server(lambda: Engine(model, tok, max_context=MAX_CONTEXT, decoder=scripted(tok.encode(text)))) as s:
        client = s.wait_ready().client()
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        r = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert message.tool_calls[0].function.name == "get_weather" and message.tool_calls[0].type == "function"
        args = json.loads(message.tool_calls[0].function.arguments)
        assert args == ({"city": "Paris", "days": 2} if text == JSON_CALL else {"city": "San Francisco", "days": 3})
        assert message.content == ("Let me check." if text == JSON_CALL else None)

        chunks = list(client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert "<" not in content and "tool_call" not in content
        deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert len(deltas) == 1 and json.loads(deltas[0].function.arguments) == args
        assert deltas[0].index == 0 and deltas[0].id.startswith("call_")
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # tool_choice "none" (or no tools): the block is plain content
        r = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, tool_choice="none")
        assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls

        # the call and its result go back into the next prompt
        follow = messages + [
            {"role": "assistant", "content": None, "tool_calls": [message.tool_calls[0].model_dump()]},
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
        again = client.chat.completions.create(model=NAME, messages=follow, tools=TOOLS)
        assert again.usage.prompt_tokens > r.usage.prompt_tokens


# ------------------------------------------------------------------ speculative decoding


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target, draft = write_pair(root / "pair")
    return build_pack(target, root / "target.pack", role="target"), draft, root / "cache"


def test_speculative_server_matches_plain_greedy_and_counts_rounds(pair):
    target_pack, draft, cache = pair
    model = load_model(target_pack, dtype="float32")
    tok = load_tokenizer(target_pack)
    drafter = load_drafter(draft, model, dtype="float32", quantization="none", cache_dir=cache)
    decoder = SpeculativeDecoder(model, drafter, MAX_CONTEXT)
    with Server(lambda: Engine(model, tok, max_context=MAX_CONTEXT, decoder=decoder)) as s:
        client = s.wait_ready().client()
        messages = [{"role": "user", "content": "Hello there"}]
        result, text = expected(model, tok, tok.encode_chat(messages), 40)
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0)
        assert r.choices[0].message.content == text and r.usage.completion_tokens == 40
        streamed = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == text
        rounds = s.metric("spec_decode_num_drafts_total")
        assert rounds > 0 and s.metric("spec_decode_num_draft_tokens_total") >= rounds
        assert s.metric("spec_decode_num_accepted_tokens_total") == sum(
            s.metric(f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}')
            for i in range(decoder.gamma))
        assert_error(s.post("/v1/chat/completions", {"messages": messages, "logprobs": True}), 400, "logprobs")
        ids = tok.encode_chat(messages)  # a prompt that extends the last one resumes its cache
        longer = ids + tok.encode(" more words")
        r = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
        r2 = client.completions.create(model=NAME, prompt=longer, max_tokens=8, temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens == len(ids)
        assert r2.choices[0].text == expected(model, tok, longer, 8)[1]


def test_speculative_server_falls_back_to_plain_steps_while_drafting_does_not_pay(pair):
    from monolith.runtime.scheduler import Fallback

    target_pack, draft, cache = pair
    model = load_model(target_pack, dtype="float32")
    tok = load_tokenizer(target_pack)
    drafter = load_drafter(draft, model, dtype="float32", quantization="none", cache_dir=cache)
    decoder = SpeculativeDecoder(model, drafter, MAX_CONTEXT,
                                 break_even=measure_break_even(model, drafter, 7, SamplingParams()).steps)
    assert decoder.break_even > 1  # a round costs more than one plain step
    with Server(lambda: Engine(model, tok, max_context=MAX_CONTEXT, decoder=decoder)) as s:
        client = s.wait_ready().client()
        messages = [{"role": "user", "content": "Hello there"}]
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0)
        assert r.choices[0].message.content == expected(model, tok, tok.encode_chat(messages), 40)[1]
        # the synthetic draft accepts next to nothing: after the first round only probes draft
        assert 1 <= s.metric("spec_decode_num_drafts_total") <= 2 + 40 // Fallback.PROBE_EVERY
    # a session kept after fallback rounds: the draft context caught up with every committed
    # row, so the next turn, which extends prompt + output, resumes with the draft in step
    session, prompt, out = Session(), tok.encode_chat(messages), []
    decoder(session, prompt, 25, SamplingParams(), [], lambda t, _: out.append(t) or True)  # ends on plain rounds
    assert session.draft_snapshot.offset == session.cache.offset == len(prompt) + 24
    # ... in order: its K/V equal a context that observed all those rows at once
    committed = prompt + out[:-1]
    _, features = model.forward(mx.array(committed), model.make_cache(MAX_CONTEXT), taps=drafter.taps)
    reference = drafter.draft.make_context(MAX_CONTEXT)
    drafter.draft.append_context(reference, features)
    for ours, ref in zip(session.draft_snapshot.layers, reference.layers):
        for a, b in zip(ours.arrays(), ref.arrays()):
            a, b = np.array(a[:, :, :len(committed)]), np.array(b[:, :, :len(committed)])
            assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    # the next turn goes on with the fallback's state: drafting did not pay, so with a long
    # wait before the next probe its rounds are all plain (a new fallback drafts the first)
    kept = session.fallback
    assert kept is not None and kept.plain_next()
    kept.probe_every, kept.plain_in_a_row = Fallback.MAX_PROBE_EVERY, 0
    longer, again = prompt + out + tok.encode(" and more"), []
    outcome = decoder(session, longer, 12, SamplingParams(), [], lambda t, _: again.append(t) or True)
    assert outcome.cached_tokens == len(prompt) + 24
    assert again == plain(model, longer, 12, SamplingParams(), [], MAX_CONTEXT).token_ids
    assert session.fallback is kept and outcome.spec.drafts == 0
    # a prompt that does not extend the session starts afresh
    outcome = decoder(session, tok.encode("Another topic"), 12, SamplingParams(), [], lambda t, _: True)
    assert outcome.cached_tokens == 0 and outcome.spec.drafts >= 1 and session.fallback is not kept


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


def test_speculative_counters_reach_metrics(model, tok):
    spec = SpecStats(7, [7, 7, 7], [5, 3, 2])  # 3 drafts, 21 draft tokens, 10 accepted: (3, 3, 2, 1, 1, 0, 0) by position
    with Server(lambda: Engine(model, tok, max_context=MAX_CONTEXT, decoder=scripted([65, 66, 67], spec))) as s:
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
    endless = scripted(tok.encode(" word") * 20000, per_token=0.005)
    with Server(lambda: Engine(model, tok, max_context=60000, decoder=endless)) as s:
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
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.5)
    deadline = time.monotonic() + 10
    while _cancelled(s) < before + 1:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)
    assert s.client().completions.create(model=NAME, prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_cancel_stops_real_decoding_at_the_next_token(model, tok):
    engine = Engine(model, tok, max_context=MAX_CONTEXT)
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
        _, after = engine.generate(GenerationRequest(tuple(chat_ids(tok, "cancel me")), 3))
        assert after.usage.cached_tokens == after.usage.prompt_tokens  # the session survived the cancel
    finally:
        engine.close()


def test_keep_alive_comments_during_a_long_prefill(model, tok):
    slow = scripted(tok.encode("late"), delay=1.0)
    with Server(lambda: Engine(model, tok, max_context=MAX_CONTEXT, decoder=slow), keepalive_seconds=0.2) as s:
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
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required", "tools": TOOLS}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
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
                                          ({"prompt": [1, 99999]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                                          ({"prompt": 7}, "prompt"), ({"echo": True}, "echo"),
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
    with Server(lambda: Engine(model, tok, max_context=MAX_CONTEXT), max_request_bytes=1000) as s:
        s.wait_ready()
        assert_error(s.post("/v1/completions", {"prompt": "x" * 2000}), 413, code="request_too_large")
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:  # announce 1 GB, send nothing
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n{")
            reply = sock.recv(4096).decode()
        assert reply.startswith("HTTP/1.1 413")
        assert s.client().completions.create(model=NAME, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_api_key(model, tok):
    with Server(lambda: Engine(model, tok, max_context=MAX_CONTEXT), api_key="s3cret") as s:
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
    slow = scripted(tok.encode("slow answer"), per_token=0.3)
    with Server(lambda: Engine(model, tok, max_context=MAX_CONTEXT, decoder=slow, max_queue=1,
                               queue_timeout=1.0)) as s:
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
        return Engine(model, tok, max_context=MAX_CONTEXT)

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
    engine = Engine(model, tok, max_context=MAX_CONTEXT)
    try:
        ids = chat_ids(tok, "session")
        _, first = engine.generate(GenerationRequest(tuple(ids), 6))
        sequence = ids + list(first.token_ids)
        _, resumed = engine.generate(GenerationRequest(tuple(sequence + [65, 66]), 4))
        assert resumed.usage.cached_tokens == len(sequence) - 1  # the 6th token was never fed
        changed = list(sequence)
        changed[len(ids) + 2] = (changed[len(ids) + 2] + 1) % 300
        _, partial = engine.generate(GenerationRequest(tuple(changed), 4))
        assert partial.usage.cached_tokens == len(ids)  # diverges in the reply: resumes at the prompt's end
        changed[3] = (changed[3] + 1) % 300
        _, fresh = engine.generate(GenerationRequest(tuple(changed), 4))
        assert fresh.usage.cached_tokens == 0  # diverges inside the prompt: no exact point, a fresh prefill
        want, _ = expected(model, tok, changed, 4)
        assert list(fresh.token_ids) == want.token_ids
    finally:
        engine.close()


# ------------------------------------------------------------------ the command line


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "monolith.serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _wait_health(port, proc, timeout=60):
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
    logs = []
    # the default start (serve's fallback decides from the measured round cost), then one
    # that drafts whatever the cost (an explicit scheduler has no fallback)
    for extra in ((), ("--spec-sched", "fixed")):
        port = _free_port()
        proc = _serve("--port", str(port), "--dtype", "float32", *extra, env=env)
        try:
            _wait_health(port, proc)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            assert [m.id for m in client.models.list().data] == ["monolith-demo"]
            r = client.chat.completions.create(model="monolith-demo", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
            assert r.usage.completion_tokens == 3
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        finally:
            logs.append(_stop(proc))
    assert re.search(r"^spec_decode_num_drafts_total [1-9]", metrics, re.M)  # the demo draft is in use
    # the first start builds and checks the bundled pair's packs, the second finds them
    assert "built the demo target pack" in logs[0] and "built the demo draft pack" in logs[0]
    assert "built the demo" not in logs[1]
    assert "loaded the target" in logs[0] and "loading the draft" in logs[0]
    # serve's fallback, measured: the draft is used unless a round costs more plain steps
    # than the 8 tokens it can emit (MLX's Linux CPU wheel without an optimized BLAS)
    cost = float(re.search(r"a drafted round costs (\d+\.\d) plain steps", logs[0]).group(1))
    assert ("with draft" in logs[0]) == (cost <= 7.2) and ("(plain decoding)" in logs[0]) == (cost > 7.2)
    assert "with draft" in logs[1] and "a drafted round costs" not in logs[1]
    assert len(list((tmp_path / "cache" / "packs").glob("*/manifest.json"))) == 2


def test_serve_decodes_plainly_where_a_drafted_round_cannot_pay(monkeypatch, pair):
    from monolith import launch
    from monolith.runtime.calibrate import BreakEven

    target_pack, draft, cache = pair
    model = load_model(target_pack, dtype="float32")
    args = argparse.Namespace(draft_quantization="none", draft_pack=None, draft_revision=None, local_files_only=True,
                              dtype="float32", max_context=MAX_CONTEXT, prefill_chunk_size=512,
                              draft_block_size=None, spec_sched=None, spec_threshold=None)
    logs = []
    # 7 proposals: a round emits at most 8 tokens; with the margin it drafts up to 7.2
    for cost, drafts in ((7.2, True), (8.0, False)):
        monkeypatch.setattr(launch, "measure_break_even", lambda *a, c=cost, **k: BreakEven(c, (c, c, c)))
        decoder = launch.speculative_decoder(args, model, draft, logs.append)
        if drafts:
            assert decoder.break_even == cost
        else:
            assert decoder is None
    assert sum("a request drafts while its rounds emit at least that many tokens" in m for m in logs) == 1
    assert "drafting pays below 7.2 (a round emits at most 8 tokens): serving with plain decoding" in logs[-1]


def test_cli_flags(tmp_path, pack):
    port = _free_port()
    proc = _serve("--model", str(pack), "--port", str(port), "--dtype", "float32", "--served-model-name", "a", "b",
                  "--api-key", "k", "--max-context", "256", "--prefill-chunk-size", "16", "--no-warmup",
                  "--log-level", "warning", "--max-queue", "2", "--queue-timeout", "5")
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


@pytest.mark.parametrize("args,message", [
    (["--no-draft", "--draft-block-size", "3"], "only appl"),
    (["--spec-sched", "cost", "--model", "x"], "only appl"),
    (["--max-context", "1"], "--max-context"),
    (["--port", "99999"], "--port"),
    (["--max-queue", "0"], "--max-queue"),
    (["--bogus"], "unrecognized"),
])
def test_cli_usage_errors_exit_1(args, message):
    r = subprocess.run([sys.executable, "-m", "monolith.serve", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr


def test_cli_model_that_cannot_load_exits_1(tmp_path):
    port = _free_port()
    proc = _serve("--model", str(tmp_path / "missing"), "--port", str(port), "--local-files-only")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "error:" in out and "Traceback" not in out
    assert re.search(r"error: .*missing", out)
