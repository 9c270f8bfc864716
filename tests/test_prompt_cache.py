"""The prompt cache on the bundled demo pair (float32, greedy), plain and speculative (the
trained DSpark draft): a warm run that resumes from the cache gives what a cold run on a
fresh Session without a prompt cache gives, token for token (oracles.assert_same_greedy:
float rounding may part them only at a near-tie), and resumes exactly where the
saving contract says (`Contract`: states saved at the multiples of N, the message
ends, the prompt's end and the request's end). Also: a cancelled prefill leaves only
complete, exact saved states; saved states copy their KV rows; the /metrics series and
usage.prompt_tokens_details.cached_tokens agree with the cache's own numbers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from cache_rig import held_bytes, nodes
from oracles import GREEDY, assert_same_greedy
from serving_rig import Server

from monolith.models.cache import HybridCache, KVCache
from monolith.runtime.decoder import Decoder
from monolith.runtime.generation import Generation, Tokens
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.prefill import prefill
from monolith.runtime.prompt_cache import PromptCache
from monolith.runtime.session import Session

MAX_CONTEXT = 512
CHUNK = 64
NEW = 12  # output tokens per request
BIG = 2**30  # a budget nothing here fills
STATE_ATOL = 1e-5  # |warm - cold| of cache arrays: a resumed prefill runs other chunks than a cold one
MEASURED: dict = {}
SYSTEM = ("You are a careful Python reviewer. Answer with short code, name every function you touch, "
          "and never change behaviour you were not asked to change.")
ASKS = ["Write a function that returns the n-th Fibonacci number iteratively.",
        "Write a class that parses an INI file into a dict of sections and keys.",
        "Now make it memoize the results in a dict shared between calls.",
        "Now add a method that writes the sections back, sorted by name."]


@pytest.fixture(scope="module")
def loaded(demo_f32):
    return demo_f32


@pytest.fixture(scope="module", params=["plain", "speculative"])
def decoder(request, loaded):
    model, drafter, _ = loaded
    if request.param == "plain":
        return Decoder(model, None, MAX_CONTEXT, CHUNK)
    return Decoder(model, drafter, MAX_CONTEXT, CHUNK)


def run(decoder, session, prompt, boundaries=(), n=NEW, cancelled=lambda: False):
    """One greedy request without stop tokens, as the engine's worker calls a decoder."""
    return decoder(Generation(prompt, n, GREEDY, boundaries=boundaries, session=session,
                              emitter=Tokens(cancelled=cancelled)))


class Contract:
    """The saved states the prompt cache promises to hold (nothing evicted): of each
    request's prompt, the prefixes ending at the multiples of `every`, at its message
    ends, one token before its end and at its end; and the request's whole sequence (prompt + output but the last
    token, which is never fed). A request resumes from the longest one it starts with
    that leaves a token to prefill."""

    def __init__(self, every: int):
        self.every, self.held = every, set()

    def add(self, prompt, boundaries, output):
        ends = {p for p in range(1, len(prompt) + 1)
                if (self.every and p % self.every == 0) or p in boundaries or p in (len(prompt) - 1, len(prompt))}
        self.held |= {tuple(prompt[:p]) for p in ends}
        self.held.add(tuple(prompt) + tuple(output[:-1]))

    def cached(self, prompt) -> int:
        return max((len(c) for c in self.held if len(c) < len(prompt) and tuple(prompt[:len(c)]) == c), default=0)


class Conversations:
    """Requests on one warm Session (sharing `cache`) checked against cold runs and the
    Contract."""

    def __init__(self, loaded, decoder, cache: PromptCache):
        self.model, _, self.tok = loaded
        self.decoder, self.cache = decoder, cache
        self.session = Session(cache)
        self.contract = Contract(cache.save_every)

    def ask(self, messages, session=None, exact=True):
        prompt = self.tok.encode_chat(messages)
        boundaries = self.tok.message_ends(prompt)
        expected = self.contract.cached(prompt)
        session = session or self.session
        warm = run(self.decoder, session, prompt, boundaries)
        cold_session = Session()
        cold = run(self.decoder, cold_session, prompt, boundaries)
        assert cold.cached_tokens == 0 and len(cold.token_ids) == NEW
        assert_same_greedy(self.model, prompt, warm.token_ids, cold.token_ids)
        assert_same_state(session, cold_session)
        if exact:
            assert warm.cached_tokens == expected, (warm.cached_tokens, expected, boundaries)
        else:  # an evicted saved state may leave less, never more
            assert warm.cached_tokens <= expected
        self.contract.add(prompt, boundaries, warm.token_ids)
        return prompt, boundaries, warm

    def reply(self, outcome) -> dict:
        return {"role": "assistant", "content": self.tok.decode(outcome.token_ids, skip_special_tokens=True)}


def assert_same_state(warm: Session, cold: Session):
    """The sequence both runs left holds the same target KV rows, GDN states and draft
    context rows, up to float rounding."""
    n = cold.cache.offset
    assert warm.cache.offset == n and warm.tokens[:n] == cold.tokens[:n]
    pairs = list(zip(warm.cache.row_layers, cold.cache.row_layers))
    if cold.draft_snapshot is not None:
        assert warm.draft_snapshot.offset == cold.draft_snapshot.offset == n
        pairs += zip(warm.draft_snapshot.row_layers, cold.draft_snapshot.row_layers)
    arrays = [(a.keys[:, :, :n], b.keys[:, :, :n]) for a, b in pairs]
    arrays += [(a.values[:, :, :n], b.values[:, :, :n]) for a, b in pairs]
    arrays += [pair for g, w in zip(warm.cache.snapshot().states, cold.cache.snapshot().states) for pair in zip(g, w)]
    for got, want in arrays:
        got, want = np.array(got), np.array(want)
        MEASURED["max state difference"] = max(MEASURED.get("max state difference", 0.0),
                                               float(np.abs(got - want).max()))
        assert np.allclose(got, want, atol=STATE_ATOL, rtol=1e-5)


def system(text=SYSTEM):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


# ------------------------------------------------------------------ cold == warm


def test_a_resumed_conversation_on_a_new_session(loaded, decoder):
    talk = Conversations(loaded, decoder, PromptCache(BIG, save_every=0))
    first = [system(), user(ASKS[0])]
    prompt1, _, out1 = talk.ask(first)
    assert out1.cached_tokens == 0
    # turn 2 on a session that never saw turn 1: only the prompt cache can resume it
    _, _, out2 = talk.ask(first + [talk.reply(out1), user(ASKS[2])], session=Session(talk.cache))
    assert out2.cached_tokens >= len(prompt1)
    # a client that re-renders the reply (as a template dropping the reasoning does) parts right after turn 1's prompt
    edited = {"role": "assistant", "content": "def fib(n):"}
    _, _, out3 = talk.ask(first + [edited, user(ASKS[2])], session=Session(talk.cache))
    assert out3.cached_tokens == len(prompt1)


def test_a_divergence_mid_message_resumes_at_the_message_end(loaded, decoder):
    talk = Conversations(loaded, decoder, PromptCache(BIG, save_every=0))
    prompt1, boundaries1, _ = talk.ask([system(), user(ASKS[1] + " Keep comments.")])
    prompt2, _, out2 = talk.ask([system(), user(ASKS[1] + " Drop comments.")], session=Session(talk.cache))
    shared = next(i for i, (a, b) in enumerate(zip(prompt1, prompt2)) if a != b)
    assert boundaries1[0] < shared - 5  # the second prompt shares part of the user message
    assert out2.cached_tokens == boundaries1[0]  # the system message's end


def test_a_divergence_inside_an_interval_resumes_at_its_saved_state(loaded, decoder):
    every = 16
    talk = Conversations(loaded, decoder, PromptCache(BIG, save_every=every))
    prompt1, boundaries1, _ = talk.ask([system(), user(ASKS[1] + " Keep comments and type hints.")])
    prompt2, _, out2 = talk.ask([system(), user(ASKS[1] + " Keep comments, drop type hints.")])
    shared = next(i for i, (a, b) in enumerate(zip(prompt1, prompt2)) if a != b)
    assert shared % every and shared // every * every > boundaries1[0]  # an interval's saved state lies deepest
    assert out2.cached_tokens == shared // every * every


def test_interleaved_conversations_on_one_session(loaded, decoder):
    talk = Conversations(loaded, decoder, PromptCache(BIG, save_every=32))
    a = [system(), user(ASKS[0])]
    b = [system(), user(ASKS[1])]
    pa1, ends, oa1 = talk.ask(a)
    _, _, ob1 = talk.ask(b)
    assert ob1.cached_tokens >= ends[0]  # the shared system prompt
    _, _, oa2 = talk.ask(a + [talk.reply(oa1), user(ASKS[2])])
    assert oa2.cached_tokens >= len(pa1)  # A1's end, though B1 ran in between
    _, _, ob2 = talk.ask(b + [talk.reply(ob1), user(ASKS[3])])
    assert ob2.cached_tokens > 0
    stats = talk.cache.stats
    assert (stats.hits, stats.misses, stats.evictions) == (3, 1, 0)


def test_eviction_under_a_small_budget(loaded, decoder):
    probe = PromptCache(BIG, save_every=32)
    Conversations(loaded, decoder, probe).ask([system(), user(ASKS[0])])
    per_state = probe.nbytes // probe.saved_states
    budget = 3 * per_state  # a few saved states fit, not a conversation's
    talk = Conversations(loaded, decoder, PromptCache(budget, save_every=32))
    a, b = [system(), user(ASKS[0])], [system(), user(ASKS[1])]
    outs = {}
    for name, messages in [("a1", a), ("b1", b), ("a2", a), ("b2", b)]:
        if name[1] == "2":
            messages = messages + [talk.reply(outs[name[0] + "1"]), user(ASKS[2 if name[0] == "a" else 3])]
        outs[name] = talk.ask(messages, exact=False)[2]
        assert 0 < talk.cache.nbytes <= budget and talk.cache.nbytes == held_bytes(talk.cache)
    assert talk.cache.stats.evictions > 0


def test_a_saved_state_of_another_sequence_drops_the_live_points_it_overwrites(loaded, decoder):
    """The live session holds X; a saved state of Y (which parts from X at d) is loaded and
    Y goes on past X's length; then Z = Y up to past X's end, then other tokens. X's
    restore points past d would look valid for Z's tokens (the session's tokens are Y's
    now) but hold X's recurrent states: Z must resume elsewhere and give the cold output."""
    model, _, tok = loaded
    rng = np.random.default_rng(7)
    vocab = [int(t) for t in rng.integers(10, 1500, size=400)]
    y1 = vocab[:100]
    x = y1[:10] + vocab[100:160]
    y2 = y1 + vocab[160:190]
    z = y2[:len(x) + 4] + vocab[190:210]
    cache = PromptCache(BIG, 0)
    other, live = Session(cache), Session(cache)
    run(decoder, other, y1)  # the tree holds Y1's end
    run(decoder, live, x)  # the live session holds X
    assert run(decoder, live, y2).cached_tokens >= len(y1)  # from the tree
    warm, cold = run(decoder, live, z), run(decoder, Session(), z)
    assert warm.cached_tokens < len(x)  # no X point survived
    assert_same_greedy(model, z, warm.token_ids, cold.token_ids)


# ------------------------------------------------------------------ cancellation


def test_a_cancelled_prefill_leaves_only_complete_exact_saved_states(loaded):
    model, _, tok = loaded
    chunk, every = 16, 32
    decoder = Decoder(model, None, MAX_CONTEXT, chunk)
    prompt = tok.encode_chat([system(), user(ASKS[1] + " " + ASKS[3])])
    boundaries = tok.message_ends(prompt)
    stop_at = boundaries[0] + 20  # past the system message and an interval, well before the prompt's end
    assert stop_at + chunk < len(prompt)

    def cancelled_prefill():
        cache = PromptCache(BIG, save_every=every)
        session = Session(cache)
        out = run(decoder, session, prompt, boundaries, cancelled=lambda: session.cache.offset >= stop_at)
        assert out.finish_reason == "abort" and out.token_ids == []
        assert stop_at <= session.cache.offset < len(prompt)
        return cache, session, session.cache.offset

    cache, session, done = cancelled_prefill()
    nodes = saved_nodes(cache)
    # the interval's multiples, the message ends, and where it stopped (a retry resumes there)
    assert sorted(n.end for n in nodes) == [p for p in range(1, done + 1)
                                            if p % every == 0 or p in boundaries or p == done]
    for node in nodes:
        assert node.prefix() == prompt[:node.end]
        assert_holds_a_cold_prefill(model, cache, node, chunk)
    # a later request resumes correctly: on a new session from the deepest saved state, on the
    # cancelled one from where its prefill stopped
    cold = run(decoder, Session(), prompt, boundaries)
    warm = run(decoder, Session(cache), prompt, boundaries)
    assert warm.cached_tokens == max(n.end for n in nodes)
    assert_same_greedy(model, prompt, warm.token_ids, cold.token_ids)
    cache, session, done = cancelled_prefill()
    warm = run(decoder, session, prompt, boundaries)
    assert warm.cached_tokens == done
    assert_same_greedy(model, prompt, warm.token_ids, cold.token_ids)


def test_a_cancelled_speculative_prefill_stops_between_chunks(loaded):
    """A client gone during a long prefill with a draft stops it at the next chunk: no
    token, and the session (cache and draft context) resumes from where it stopped."""
    model, drafter, tok = loaded
    chunk = 16
    decoder = Decoder(model, drafter, MAX_CONTEXT, chunk)
    prompt = tok.encode_chat([system(), user(ASKS[1] + " " + ASKS[3])])
    boundaries = tok.message_ends(prompt)
    stop_at = boundaries[0] + 20
    assert stop_at + chunk < len(prompt)
    cache = PromptCache(BIG, 32)
    session = Session(cache)
    out = run(decoder, session, prompt, boundaries, cancelled=lambda: session.cache.offset >= stop_at)
    done = session.cache.offset
    assert out.finish_reason == "abort" and out.token_ids == [] and stop_at <= done < stop_at + chunk
    assert max(n.end for n in saved_nodes(cache)) <= done
    warm, cold = run(decoder, session, prompt, boundaries), run(decoder, Session(), prompt, boundaries)
    assert warm.cached_tokens == done
    assert_same_greedy(model, prompt, warm.token_ids, cold.token_ids)
    assert warm.speculative.accepted_per_round == cold.speculative.accepted_per_round  # the draft's context too


def saved_nodes(cache: PromptCache):
    return [node for node in nodes(cache) if node.state is not None]


def assert_holds_a_cold_prefill(model, cache: PromptCache, node, chunk: int):
    """Loaded into a fresh cache, saved state `node` holds the KV rows [0, end) and the GDN
    states of a cold prefill of its tokens."""
    loaded = model.make_cache(MAX_CONTEXT)
    cache.load(node, loaded, None)
    assert loaded.offset == node.end
    cold = model.make_cache(MAX_CONTEXT)
    prefill(model, mx.array(node.prefix(), dtype=mx.int32), cold, chunk_size=chunk)
    mx.eval(cold.arrays())
    for got, want in zip(loaded.row_layers, cold.row_layers):
        for g, w in [(got.keys, want.keys), (got.values, want.values)]:
            assert np.allclose(np.array(g[:, :, :node.end]), np.array(w[:, :, :node.end]), atol=1e-5, rtol=1e-5)
    for got, want in zip(loaded.snapshot().states, cold.snapshot().states):
        for g, w in zip(got, want):
            assert np.allclose(np.array(g), np.array(w), atol=1e-5, rtol=1e-5), node.end


# ------------------------------------------------------------------ memory


def test_a_saved_state_copies_its_rows_so_later_updates_stay_in_place():
    live = KVCache(4, 128, 32768, mx.float32)  # 64 MiB of keys, 64 MiB of values
    cache = HybridCache([live], 32760)
    rows = mx.ones((1, 4, 100, 128))
    live.update(rows, rows, 0)
    cache.advance(100)
    mx.eval(live.arrays())

    def update_peak() -> int:
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        one = mx.ones((1, 4, 1, 128))
        live.update(one, one, 100)
        mx.eval(live.arrays())
        return mx.get_peak_memory() - base

    buffer = live.keys.nbytes
    view = (live.keys[:, :, :100], live.values[:, :, :100])  # what holding views would do
    mx.eval(view)
    assert update_peak() >= buffer  # the measurement sees a whole-buffer copy
    del view
    prompt_cache = PromptCache(BIG)
    assert prompt_cache.insert(list(range(100)), cache, cache.snapshot(), None) is not None
    assert update_peak() < buffer // 16


# ------------------------------------------------------------------ reporting


class Recording(Decoder):
    """Plain decoding that keeps every request's Outcome."""

    def __init__(self, *args):
        super().__init__(*args)
        self.outcomes = []

    def steps(self, generation):
        outcome = yield from super().steps(generation)
        self.outcomes.append(outcome)
        return outcome


def test_metrics_and_usage_report_the_cache(loaded):
    model, _, tok = loaded
    cache = PromptCache(BIG, save_every=32)
    decoder = Recording(model, None, MAX_CONTEXT, CHUNK)
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=decoder, prompt_cache=cache),
                model_names=("demo",)) as server:
        client = server.wait_ready().client()
        a, b = [system(), user(ASKS[0])], [system(), user(ASKS[1])]
        cached, replies = [], []
        for turn, messages in enumerate([a, b, a, b]):
            if turn >= 2:  # the next turn of a, then of b
                messages = messages + [{"role": "assistant", "content": replies[turn - 2]}, user(ASKS[turn])]
            r = client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            replies.append(r.choices[0].message.content)
        assert cached == [o.cached_tokens for o in decoder.outcomes]
        assert cached[0] == 0 and min(cached[1:]) > 0
        stats = cache.stats
        assert (stats.hits, stats.misses) == (3, 1)
        metric = server.metric
        assert metric("monolith_prompt_cache_hits_total") == stats.hits
        assert metric("monolith_prompt_cache_misses_total") == stats.misses
        assert metric("monolith_prompt_cache_evictions_total") == stats.evictions == 0
        assert metric("monolith_prompt_cache_saved_states") == cache.saved_states > 0
        assert metric("monolith_prompt_cache_bytes") == cache.nbytes == held_bytes(cache)
        assert metric("monolith_prompt_cache_budget_bytes") == BIG
        assert metric("monolith_prompt_cache_disk_hits_total") == stats.disk_hits == 0  # no --prompt-cache-dir
        assert metric("monolith_prompt_cache_disk_files") == metric("monolith_prompt_cache_disk_bytes") == 0
