"""Continuous batching (runtime/batch.py, the engine's batch): every greedy request served
in a batch gives, token for token, what it gives served alone, plain and speculative,
whatever joins, leaves, stops or is cancelled around it; the prompt cache serves every
sequence; the queue limits hold with several running. (One batch from inside:
tests/test_batch_step.py; the shared helpers: tests/batch_rig.py.)"""

from __future__ import annotations

import threading

import pytest
from batch_rig import MAX_CONTEXT, Collect, alone, decoder, prompts, together

from monolith.runtime.engine import Engine, Limits
from monolith.runtime.events import GenerationRequest
from monolith.runtime.jobs import QueueFull
from monolith.runtime.prompt_cache import PromptCache
from monolith.runtime.session import Session
from monolith.sampling import SamplingParams


@pytest.fixture(scope="module")
def demo(demo_f32):
    return demo_f32


@pytest.mark.parametrize("kind", ["plain", "speculative"])
def test_batched_equals_alone_for_mixed_prompt_lengths(demo, kind):
    model, drafter, tok = demo
    dec = decoder(kind, model, drafter)
    ps = prompts(tok)
    lengths = [24, 40, 16, 33, 20, 28]
    want = [alone(model, tok, dec, p, n)[0] for p, n in zip(ps, lengths)]
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_batch=4), decoder=dec)
    try:
        seen = []
        real_step = engine._batch.step

        def step():
            seen.append(len(engine._batch))
            return real_step()

        engine._batch.step = step
        sinks = [Collect() for _ in ps]
        got = together(engine, [GenerationRequest(p, max_tokens=n) for p, n in zip(ps, lengths)], sinks)
    finally:
        engine.close()
    assert [f.token_ids for f in got] == want
    order = [s.order for s in sinks]
    assert order == sorted(order)  # started in the order they came: first in, first served
    assert max(seen) == 4  # six requests, four at a time: two joined as others left
    assert all(f.finish_reason == "length" for f in got)


@pytest.mark.parametrize("kind", ["plain", "speculative"])
def test_sampled_requests_with_seeds_keep_their_draws_in_a_batch(demo, kind):
    """Each request draws from its own key chain, so a seeded sampled request in a batch
    draws what it draws alone."""
    model, drafter, tok = demo
    dec = decoder(kind, model, drafter)
    ps = prompts(tok)[:3]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s) for s in (1, 2, 3)]
    want = [alone(model, tok, dec, p, 20, q)[0] for p, q in zip(ps, params)]
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_batch=3), decoder=dec)
    try:
        got = together(engine, [GenerationRequest(p, max_tokens=20, params=q) for p, q in zip(ps, params)])
    finally:
        engine.close()
    assert [f.token_ids for f in got] == want


@pytest.mark.parametrize("kind", ["plain", "speculative"])
def test_joining_leaving_and_cancelling_mid_run(demo, kind):
    """A runs; B joins after A's 5th token (a prompt of several chunks, prefilled one chunk
    a round while A streams);
    C joins after B's 3rd and is cancelled after its 4th; D waits for a slot (max_batch
    3) and joins when C leaves. A, B and D equal alone; C's output is a prefix of its own."""
    model, drafter, tok = demo
    dec = decoder(kind, model, drafter)
    pa, pb, pc, pd = (prompts(tok)[i] for i in (0, 4, 2, 3))
    want = {name: alone(model, tok, dec, p, n)[0] for name, p, n in
            (("a", pa, 40), ("b", pb, 30), ("c", pc, 30), ("d", pd, 12))}
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_batch=3), decoder=dec)
    jobs, sinks = {}, {}

    def submit(name, prompt, n, on_delta=None):
        sinks[name] = Collect(on_delta)
        jobs[name] = engine.submit(GenerationRequest(prompt, max_tokens=n), sinks[name])

    a_seen = {}  # A's deltas when B was submitted and when B's first token came

    def a_delta(sink):
        if sink.deltas == 5:
            a_seen["b submitted"] = sink.deltas
            submit("b", pb, 30, b_delta)

    def b_delta(sink):
        if sink.deltas == 1:
            a_seen["b first"] = sinks["a"].deltas
        if sink.deltas == 3:
            submit("c", pc, 30, c_delta)
            submit("d", pd, 12)

    def c_delta(sink):
        if sink.deltas == 4:
            jobs["c"].cancel()

    try:
        submit("a", pa, 40, a_delta)
        for name in "abcd":
            while name not in jobs:
                jobs["a"].done.wait(0.05)
            assert jobs[name].done.wait(300)
    finally:
        engine.close()
    for name in "abd":
        assert sinks[name].finished.token_ids == want[name], name
    chunks = -(-len(pb) // 32)
    assert chunks >= 4 and a_seen["b first"] - a_seen["b submitted"] >= chunks - 1  # A streamed through B's prefill
    c = sinks["c"].finished
    assert c.finish_reason == "cancelled" and 4 <= len(c.token_ids) < 30
    assert c.token_ids == want["c"][:len(c.token_ids)]


def test_a_stop_token_inside_an_accepted_block_ends_only_its_sequence(demo):
    """The speculative request's stop token is one its rounds accept inside a block: the
    output ends there, as alone, and the sequences around it go on."""
    model, drafter, tok = demo
    dec = decoder("speculative", model, drafter)
    ps = prompts(tok)[:3]
    free = [alone(model, tok, dec, p, 30)[0] for p in ps]
    # a token of the first request's own output, past its first rounds, that it writes there first
    at = next(i for i in range(8, len(free[0])) if free[0][i] not in free[0][:i])
    stop = free[0][at]
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_batch=3), decoder=dec)
    engine.stop_ids = frozenset({stop})
    try:
        got = together(engine, [GenerationRequest(p, max_tokens=30) for p in ps])
    finally:
        engine.close()
    cut = [list(f[:f.index(stop)]) if stop in f else list(f) for f in free]
    assert [list(f.token_ids) for f in got] == cut
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) == at
    spec = got[0].speculative
    assert spec is not None and sum(spec.accepted_per_round) > 0  # it stopped inside rounds that accepted proposals


def test_a_rounds_tokens_reach_the_sink_as_one_delta(demo):
    """Each request of a batch gets one Delta per round (the prefill's token, then each
    speculative round's accepted tokens and bonus together), not one per token; the text
    is the same."""
    model, drafter, tok = demo
    dec = decoder("speculative", model, drafter)
    ps = prompts(tok)[:3]
    want = [alone(model, tok, dec, p, 40)[0] for p in ps]
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_batch=3), decoder=dec)
    try:
        sinks = [Collect() for _ in ps]
        got = together(engine, [GenerationRequest(p, max_tokens=40) for p in ps], sinks)
    finally:
        engine.close()
    assert [f.token_ids for f in got] == want
    for sink, finished in zip(sinks, got):
        assert "".join(sink.text) == tok.decode(list(finished.token_ids))
        rounds = finished.speculative.rounds
        assert sum(finished.speculative.accepted_per_round) > 0
        assert 0 < sink.deltas <= rounds + 1 < len(finished.token_ids)


@pytest.mark.parametrize("kind", ["plain", "speculative"])
def test_prompt_cache_serves_every_sequence_of_a_batch(demo, kind):
    """A shared system prompt is prefilled once; three requests extending it, served
    together on three sessions, all load it from the prompt cache and equal alone."""
    model, drafter, tok = demo
    dec = decoder(kind, model, drafter)
    system = tok.encode("You are a helpful assistant. " * 6)
    questions = [tok.encode(q) for q in (" What is 2+2?", " Name a colour.", " Say hello.")]
    want = [alone(model, tok, dec, tuple(system + q), 16)[0] for q in questions]
    cache = PromptCache(64 << 20, save_every=16)
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_batch=3), decoder=dec, prompt_cache=cache)
    try:
        engine.run_request(GenerationRequest(tuple(system), max_tokens=1))
        got = together(engine, [GenerationRequest(tuple(system + q), max_tokens=16) for q in questions])
    finally:
        engine.close()
    assert [f.token_ids for f in got] == want
    cached = sorted(f.usage.cached_tokens for f in got)
    assert cached[0] >= 16 and cached[-1] <= len(system)  # at least one saved state of the system prompt each


def test_queue_limits_with_a_full_batch(demo):
    """max_batch 2 and max_queue 1: two run, one waits, the next is refused; cancelling a
    running one lets the waiting one start."""
    model, _, tok = demo
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_queue=1, max_batch=2),
                    decoder=decoder("plain", model, None))
    started = threading.Event()
    try:
        ps = prompts(tok)
        running = []
        for p in ps[:2]:  # one at a time: the queue holds one
            running.append(engine.submit(GenerationRequest(p, max_tokens=400), Collect()))
            while engine.running < len(running):
                running[0].done.wait(0.02)
        waiting = engine.submit(GenerationRequest(ps[2], max_tokens=4), Collect(lambda s: started.set()))
        assert engine.waiting == 1
        with pytest.raises(QueueFull):
            engine.submit(GenerationRequest(ps[3], max_tokens=4), Collect())
        assert not started.is_set()
        running[0].cancel()
        assert waiting.done.wait(300) and started.is_set()
        running[1].cancel()
        assert running[1].done.wait(300)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["plain", "speculative"])
def test_concurrent_streaming_chat_clients_over_http(demo, kind):
    """Four streaming chat completions at once through the openai client: each reply
    equals the reply served alone (a max_batch 1 server), and /metrics saw them run
    together."""
    from concurrent.futures import ThreadPoolExecutor

    from serving_rig import Server

    model, drafter, tok = demo
    questions = ["Tell me a story about a dragon.", "What is 12 times 12?", "Write a haiku about rain.",
                 "List three fruits."]

    def ask(server, question):
        stream = server.client().chat.completions.create(
            model="demo", messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0,
            stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def serve(batch):
        return Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_batch=batch),
                                     decoder=decoder(kind, model, drafter)), model_names=("demo",))

    with serve(1) as one:
        one.wait_ready()
        want = [ask(one, q) for q in questions]
    with serve(4) as four:
        four.wait_ready()
        most = [0.0]
        done = threading.Event()

        def watch():
            while not done.is_set():
                most[0] = max(most[0], four.metric("monolith_num_requests_running"))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda q: ask(four, q), questions))
        finally:
            done.set()
            watcher.join()
    assert got == want
    assert most[0] >= 2


def test_grammar_requests_in_a_batch_equal_alone(demo):
    """Structured requests (a JSON schema) batched with free ones, speculative: the
    grammar-guided drafts and masked verify rows of each sequence are its own."""
    import json

    import llguidance

    from monolith.runtime.grammar import Grammar

    model, drafter, tok = demo
    dec = decoder("speculative", model, drafter)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False,
              "x-guidance": {"whitespace_pattern": r"(?: )?"}}
    grammar = Grammar(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
    ps = prompts(tok)[:4]
    requests = [GenerationRequest(p, max_tokens=60, grammar=grammar if i % 2 == 0 else None)
                for i, p in enumerate(ps)]

    def run(batch, reqs):
        engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_batch=batch), decoder=dec)
        try:
            if batch == 1:
                return [engine.run_request(r, Session())[1] for r in reqs]
            return together(engine, reqs)
        finally:
            engine.close()

    want, got = run(1, requests), run(4, requests)
    assert [f.token_ids for f in got] == [f.token_ids for f in want]
    assert got[0].finish_reason == got[2].finish_reason == "stop"
    assert all(0 <= json.loads(tok.decode(list(got[i].token_ids)))["age"] <= 120 for i in (0, 2))
