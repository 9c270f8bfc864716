"""The HTTP server (monolith.serving) and the engine behind it: chat and completions,
streaming, stop strings, logprobs, tool calls and speculative decoding, through the
official `openai` client and httpx."""

from __future__ import annotations

import json

import httpx
import mlx.core as mx
import numpy as np
import pytest
from decoding import plain
from serving_rig import MAX_CONTEXT, NAME, TOOLS, Scripted, Server, chat_ids, expected

from monolith.engine_setup import load_drafter
from monolith.models import load_model
from monolith.runtime.calibrate import measure_break_even
from monolith.runtime.decoder import Decoder
from monolith.runtime.generation import Generation, Tokens
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.prefill import prefill
from monolith.runtime.session import Session
from monolith.runtime.textstream import TextStream
from monolith.sampling import SamplingParams
from monolith.serving.tools.calls import ToolCallParser, parse_tool_calls
from monolith.tokenizer import IncrementalDetokenizer, load_tokenizer

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
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=Scripted(tok.encode("Hi!")))) as s:
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


def test_the_event_bridge_joins_the_deltas_that_queued_up():
    """Deltas the engine pushed while the stream was busy go out as one (text and
    logprobs in order); other events keep their place; an empty queue waits, with a
    timeout."""
    import asyncio

    from monolith.runtime.events import Delta, Finished, Started, TokenLogprob, Usage
    from monolith.serving.driving import EventBridge
    from monolith.serving.metrics import Metrics

    lp = [TokenLogprob(i, -float(i), ()) for i in range(4)]
    done = Finished("length", Usage(1, 4, 0), (0, 1, 2, 3))

    async def run():
        bridge = EventBridge(asyncio.get_running_loop(), Metrics(), 0.0)
        with pytest.raises(asyncio.TimeoutError):
            await bridge.get(0.01)
        for event in (Started(0.0), Delta("a", (lp[0],)), Delta("b", (lp[1],)), Delta("c", (lp[2],)), done):
            bridge.queue.put_nowait(event)
        first = [await bridge.get(1.0) for _ in range(3)]
        bridge.queue.put_nowait(Delta("d", (lp[3],)))
        return first + [await bridge.get(1.0)]

    started, joined, finished, alone = asyncio.run(run())
    assert isinstance(started, Started) and finished is done
    assert joined == Delta("abc", tuple(lp[:3])) and alone == Delta("d", (lp[3],))


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
    first = prefill(model, mx.array(ids, dtype=mx.int32), cache)
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
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1  # its last token gives the logits
    assert longer.usage.prompt_tokens_details.cached_tokens == len(ids)


def test_thinking_switch_reaches_the_template(server, tok):
    messages = [{"role": "user", "content": "think?"}]
    off = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=1, temperature=0,
                                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=1, temperature=0)
    assert off.usage.prompt_tokens == len(tok.encode_chat(messages, enable_thinking=False))
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


# ------------------------------------------------------------------ tool calls

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
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=Scripted(tok.encode(text)))) as s:
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
        assert {d.index for d in deltas} == {0} and deltas[0].id.startswith("call_")  # one call, in pieces
        assert deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
        assert "".join(d.function.arguments for d in deltas) == message.tool_calls[0].function.arguments
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


def test_speculative_server_matches_plain_greedy_and_counts_rounds(synth_pair):
    target_pack, draft, cache = synth_pair
    model = load_model(target_pack, dtype="float32")
    tok = load_tokenizer(target_pack)
    drafter = load_drafter(draft, model, dtype="float32", quantization="none", cache_dir=cache)
    decoder = Decoder(model, drafter, MAX_CONTEXT)
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=decoder)) as s:
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
        # logprobs with a draft: those of plain decoding (the target's verify rows)
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=2)
        plain_lps = []
        Decoder(model, None, MAX_CONTEXT)(Generation(tok.encode_chat(messages), 12, logprobs=2,
                                                     emitter=Tokens(lambda token, lp: plain_lps.append(lp) or True)))
        entries = r.choices[0].logprobs.content
        assert len(entries) == len(plain_lps) == 12
        assert [e.logprob for e in entries] == pytest.approx([lp.logprob for lp in plain_lps], abs=1e-4)
        assert [[t.logprob for t in e.top_logprobs] for e in entries] == [
            pytest.approx([v for _, v in lp.top], abs=1e-4) for lp in plain_lps]
        ids = tok.encode_chat(messages)  # a prompt that extends the last one resumes its cache
        longer = ids + tok.encode(" more words")
        r = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
        r2 = client.completions.create(model=NAME, prompt=longer, max_tokens=8, temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens == len(ids)
        assert r2.choices[0].text == expected(model, tok, longer, 8)[1]


def test_speculative_server_falls_back_to_plain_steps_while_drafting_does_not_pay(synth_pair):
    from monolith.runtime.fallback import Fallback

    target_pack, draft, cache = synth_pair
    model = load_model(target_pack, dtype="float32")
    tok = load_tokenizer(target_pack)
    drafter = load_drafter(draft, model, dtype="float32", quantization="none", cache_dir=cache)
    decoder = Decoder(model, drafter, MAX_CONTEXT,
                                 break_even=measure_break_even(model, drafter, 7, SamplingParams()).steps)
    assert decoder.break_even > 1  # a round costs more than one plain step
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=decoder)) as s:
        client = s.wait_ready().client()
        messages = [{"role": "user", "content": "Hello there"}]
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0)
        assert r.choices[0].message.content == expected(model, tok, tok.encode_chat(messages), 40)[1]
        # the synthetic draft accepts next to nothing: after the first round only probes draft
        assert 1 <= s.metric("spec_decode_num_drafts_total") <= 2 + 40 // Fallback.PROBE_EVERY
    # a session kept after fallback rounds: the draft context caught up with every committed
    # row, so the next turn, which extends prompt + output, resumes with the draft in step
    session, prompt, out = Session(), tok.encode_chat(messages), []
    # ends on plain rounds
    decoder(Generation(prompt, 25, session=session, emitter=Tokens(lambda t, _: out.append(t) or True)))
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
    outcome = decoder(Generation(longer, 12, session=session, emitter=Tokens(lambda t, _: again.append(t) or True)))
    assert outcome.cached_tokens == len(prompt) + 24
    assert again == plain(model, longer, 12, SamplingParams(), [], MAX_CONTEXT).token_ids
    assert session.fallback is kept and outcome.spec.drafts == 0
    # a prompt that does not extend the session starts afresh
    outcome = decoder(Generation(tok.encode("Another topic"), 12, session=session))
    assert outcome.cached_tokens == 0 and outcome.spec.drafts >= 1 and session.fallback is not kept


def reasoning_and_content(client, messages, **kw):
    """(reasoning_content, content, tool calls) of a reply, non-streamed and streamed."""
    m = client.chat.completions.create(model=NAME, messages=messages, **kw).choices[0].message
    whole = ((m.model_extra or {}).get("reasoning_content"), m.content, [c.function.name for c in m.tool_calls or []])
    chunks = [c for c in client.chat.completions.create(model=NAME, messages=messages, stream=True, **kw) if c.choices]
    streamed = ("".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks) or None,
                "".join(c.choices[0].delta.content or "" for c in chunks) or None,
                [tc.function.name for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if tc.function.name])
    return whole, streamed


@pytest.mark.parametrize(("text", "want"), [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", ("The user greets me.\n", "Hello!", [])),
    ("No thinking, just the answer.", (None, "No thinking, just the answer.", [])),
    ("<think>\nA call would be <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>\n</think>\n\n"
     "No call after all.", ("A call would be <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>\n",
                           "No call after all.", [])),
    ("<think>I will call it.</think>\n\n" + JSON_CALL, ("I will call it.", "Let me check.", ["get_weather"])),
])
def test_reasoning_goes_to_reasoning_content(model, tok, text, want):
    """Qwen's <think> block is message.reasoning_content (delta.reasoning_content when
    streamed), never content; tool calls are read from the content only."""
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=Scripted(tok.encode(text)))) as s:
        client = s.wait_ready().client()
        whole, streamed = reasoning_and_content(client, [{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert whole == want
    # streamed, the content before a tool call keeps its newline (as without reasoning)
    assert (streamed[0], streamed[1] and streamed[1].rstrip("\n"), streamed[2]) == want
