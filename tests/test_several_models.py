"""A server of several models (serving/models.py; docs/serving.md, "Several models"): two
distinct tiny synthetic targets served by name, the second loaded when a request names
it; unloaded when idle past the keep-alive (its memory freed) and loaded again on the
next request; never unloaded under a request (raced deterministically: the unloader's
pass is called while a request is held at a known point); --max-loaded-models and the
memory budget (least recently used idle model first); the 404 of an unknown name on
every API; /v1/models and /metrics. No verdict here depends on timing: waits are
bounded polls of a state that must come."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import httpx
import mlx.core as mx
import pytest
from serving_rig import MAX_CONTEXT, Scripted, Server, assert_error, expected

from monolith.models import load_model
from monolith.runtime.engine import Engine, Limits
from monolith.serving.models import ModelPool, ModelSpec
from monolith.tokenizer import load_tokenizer

PROMPT = [1, 2, 3, 4]


def loader(pack, decoder=None, gate: threading.Event | None = None):
    """A load function that makes a fresh Engine of `pack` each time (its own weights),
    after `gate` is set when one is given."""
    def load():
        if gate is not None:
            assert gate.wait(60)
        decoding = decoder() if decoder is not None else None
        return Engine(load_model(pack, dtype="float32"), load_tokenizer(pack), Limits(max_context=MAX_CONTEXT),
                      decoder=decoding)
    return load


def pool_of(*loads, **kw) -> ModelPool:
    kw.setdefault("check_every", 3600.0)  # the tests call the unloader's pass themselves unless they say
    return ModelPool([ModelSpec((name,), load) for name, load in loads], **kw)


def on_loop(pool: ModelPool, coroutine):
    """Run `coroutine` on the server's event loop (where the pool's state lives): its result."""
    return asyncio.run_coroutine_threadsafe(coroutine, pool.loop).result(60)


async def _call(fn):
    return fn()


def loaded(server) -> dict[str, bool]:
    return {m["id"]: m["loaded"] for m in httpx.get(server.url + "/v1/models").json()["data"]}


def idle(pool: ModelPool, name: str) -> None:
    """Wait until the engine of `name` has ended its requests (a reply reaches its client
    just before the engine lets go of the request)."""
    wait_until(lambda: not pool.by_name[name].served.engine.busy)


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the state never came"
        time.sleep(0.01)


def complete(server, model: str | None, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return server.post("/v1/completions", body)


@pytest.fixture(scope="module")
def models(pack, other_pack):
    """{name: (model, tokenizer)} of the two targets, for the expected outputs."""
    return {name: (load_model(p, dtype="float32"), load_tokenizer(p)) for name, p in (("a", pack), ("b", other_pack))}


def test_two_models_by_name_loaded_on_demand_with_their_state_and_metrics(pack, other_pack, models):
    pool = pool_of(("a", loader(pack)), ("b", loader(other_pack)))
    with Server(pool, model_names=pool.names()) as s:
        s.wait_ready()
        assert loaded(s) == {"a": True, "b": False}
        texts = {}
        for name in ("a", "b", None):
            r = complete(s, name)
            assert r.status_code == 200, r.text
            texts[name] = r.json()["choices"][0]["text"]
            assert r.json()["model"] == (name or "a")
        for name, (model, tok) in models.items():
            assert texts[name] == expected(model, tok, PROMPT, 4)[1]
        assert texts[None] == texts["a"] and texts["a"] != texts["b"]  # two distinct targets
        listed = httpx.get(s.url + "/v1/models").json()["data"]
        assert [(m["id"], m["loaded"], m["status"], m["max_model_len"]) for m in listed] == [
            ("a", True, "loaded", MAX_CONTEXT), ("b", True, "loaded", MAX_CONTEXT)]
        for name in ("a", "b"):
            assert s.metric(f'monolith_model_loaded{{model="{name}"}}') == 1
            assert s.metric(f'monolith_model_load_seconds{{model="{name}"}}') > 0
            assert s.metric(f'monolith_kv_cache_bytes{{model="{name}"}}') > 0  # its session kept the sequence
        assert s.metric('monolith_request_finished_total{finish_reason="length"}') == 3


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "x"}]}),
    ("/v1/responses", {"input": "x", "max_output_tokens": 16}),
    ("/v1/responses/input_tokens", {"input": "x"}),
])
def test_a_name_never_configured_is_a_404_on_every_api(two_models, path, body):
    r = two_models.post(path, {**body, "model": "nope"})
    assert r.status_code == 404, r.text
    assert "nope" in r.text and "a, b" in r.text


@pytest.fixture(scope="module")
def two_models(pack, other_pack):
    pool = pool_of(("a", loader(pack)), ("b", loader(other_pack)))
    with Server(pool, model_names=pool.names()) as s:
        yield s.wait_ready()


def test_an_idle_model_unloads_after_its_keep_alive_frees_its_memory_and_loads_again(pack, other_pack, models):
    pool = pool_of(("a", loader(pack)), ("b", loader(other_pack)), keep_alive=0, check_every=0.01)
    with Server(pool, model_names=pool.names()) as s:
        s.wait_ready()
        wait_until(lambda: loaded(s) == {"a": False, "b": False})  # idle past a keep-alive of 0
        gc.collect()
        empty = mx.get_active_memory()
        want = expected(*models["b"], PROMPT, 4)[1]
        assert complete(s, "b").json()["choices"][0]["text"] == want
        b = pool.by_name["b"]
        grown = b.footprint  # what loading it took, measured by the pool
        assert grown > 0
        wait_until(lambda: not loaded(s)["b"])
        gc.collect()
        assert mx.get_active_memory() <= empty + grown // 4, "unloading did not free the model's memory"
        assert complete(s, "b").json()["choices"][0]["text"] == want  # loaded again
        assert b.loads == 2
        assert httpx.get(s.url + "/health").status_code == 200  # the server is well with nothing loaded


def test_a_requests_keep_alive_is_its_models_own(pack, other_pack):
    pool = pool_of(("a", loader(pack)), ("b", loader(other_pack)))  # the server's: forever
    with Server(pool, model_names=pool.names()) as s:
        s.wait_ready()
        assert complete(s, "b", keep_alive="0s").status_code == 200
        idle(pool, "b")
        assert on_loop(pool, pool.unload_idle()) == ["b"]
        assert complete(s, "b", keep_alive=-1).status_code == 200
        assert complete(s, "a", keep_alive=3600).status_code == 200
        idle(pool, "a")
        idle(pool, "b")
        assert on_loop(pool, pool.unload_idle()) == []
        assert_error(complete(s, "b", keep_alive="soon"), 400, param="keep_alive")
        assert_error(complete(s, "b", keep_alive=True), 400, param="keep_alive")


def test_a_model_is_never_unloaded_under_a_running_request(pack, tok, model):
    """The unloader's pass runs while a streamed request is held inside its generation
    (its handler has returned: the engine holds it), and while a request holds the
    model before submitting (its lease): both times the model stays; once they end it
    goes."""
    gated = Gated(tok.encode("one two three"))
    pool = pool_of(("a", lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=gated)),
                   ("b", loader(pack)), keep_alive=0)
    with Server(pool, model_names=pool.names()) as s:
        s.wait_ready()
        replies = []
        stream = threading.Thread(target=lambda: replies.append(complete(s, "a", max_tokens=3, stream=True)))
        stream.start()
        assert gated.entered.wait(60)  # the request runs: its second round waits on the gate
        assert on_loop(pool, pool.unload_idle()) == [] and loaded(s)["a"]
        gated.gate.set()
        stream.join(60)
        assert replies[0].status_code == 200 and "[DONE]" in replies[0].text
        idle(pool, "a")
        lease = on_loop(pool, pool.hold("b"))  # a request between taking its model and submitting
        assert on_loop(pool, pool.unload_idle()) == ["a"]
        assert loaded(s) == {"a": False, "b": True}
        on_loop(pool, _call(lease.release))
        assert on_loop(pool, pool.unload_idle()) == ["b"]


def test_a_request_racing_the_unload_is_served_whichever_comes_first(pack, other_pack):
    pool = pool_of(("a", loader(pack)), ("b", loader(other_pack)), keep_alive=0)
    with Server(pool, model_names=pool.names()) as s:
        s.wait_ready()
        for _ in range(3):
            unloading = asyncio.run_coroutine_threadsafe(pool.unload_idle(), pool.loop)
            assert complete(s, "a").status_code == 200
            unloading.result(60)


def test_requests_for_a_loading_model_wait_for_it(pack, other_pack):
    gate = threading.Event()
    pool = pool_of(("a", loader(pack)), ("b", loader(other_pack, gate=gate)))
    with Server(pool, model_names=pool.names()) as s:
        s.wait_ready()
        replies = []
        waiting = [threading.Thread(target=lambda: replies.append(complete(s, "b"))) for _ in range(2)]
        for thread in waiting:
            thread.start()
        wait_until(lambda: pool.by_name["b"].leases == 2)  # both wait on its load
        assert httpx.get(s.url + "/v1/models").json()["data"][1]["status"] == "loading"
        gate.set()
        for thread in waiting:
            thread.join(60)
        assert [r.status_code for r in replies] == [200, 200] and pool.by_name["b"].loads == 1


def test_max_loaded_models_unloads_the_least_recently_used_idle_one(pack, other_pack):
    pool = pool_of(("a", loader(pack)), ("b", loader(other_pack)), max_loaded=1)
    with Server(pool, model_names=pool.names()) as s:
        s.wait_ready()
        assert complete(s, "b").status_code == 200
        assert loaded(s) == {"a": False, "b": True}
        assert complete(s, "a").status_code == 200
        assert loaded(s) == {"a": True, "b": False}


class Gated(Scripted):
    """A scripted decoder whose second round waits for `gate` (`entered` says it is there)."""

    def __init__(self, tokens):
        super().__init__(tokens)
        self.entered, self.gate, self.rounds = threading.Event(), threading.Event(), 0

    def forward(self, tokens, cache, taps=(), logits="all"):
        self.rounds += 1
        if self.rounds == 2:
            self.entered.set()
            assert self.gate.wait(60)


def test_the_memory_budget_unloads_the_least_recently_used_idle_one(pack, other_pack):
    """A budget that holds one model's measured footprint but not two: loading the other
    unloads the idle one first, each time (the second's size: its pack's bytes, as serve
    gives it before its first load)."""
    def size() -> int:
        return sum(f.stat().st_size for f in other_pack.rglob("*.safetensors"))

    pool = ModelPool([ModelSpec(("a",), loader(pack)), ModelSpec(("b",), loader(other_pack), size)],
                     check_every=3600.0)
    with Server(pool, model_names=pool.names()) as s:
        s.wait_ready()
        a = pool.by_name["a"]
        assert a.footprint > 0 and size() > 0
        pool.budget = a.footprint + size() - 1
        assert complete(s, "b").status_code == 200
        assert loaded(s) == {"a": False, "b": True}
        assert complete(s, "a").status_code == 200
        assert loaded(s) == {"a": True, "b": False}
        pool.budget = a.footprint + pool.by_name["b"].footprint  # both fit: nothing unloaded
        assert complete(s, "b").status_code == 200
        assert loaded(s) == {"a": True, "b": True}


def test_a_stop_during_a_load_returns_at_once_and_the_load_closes_what_it_made(pack):
    """Stopped while its model loads (Ctrl-C during a start), the server stops without
    waiting for the load; the load, let go after the stop, closes the model it made
    (nothing else would). serve then exits without
    waiting for the load's thread (an interpreter exit under its MLX work aborted:
    "terminate called without an active exception")."""
    from monolith.serving.models import model_work_in_progress

    gate, made = threading.Event(), []
    held = loader(pack, gate=gate)
    pool = pool_of(("a", lambda: made.append(held()) or made[-1]))
    server = Server(pool, model_names=pool.names())
    with server:
        assert httpx.get(server.url + "/health").status_code == 503  # still loading
        assert model_work_in_progress()
    assert not server.thread.is_alive() and pool.closing  # the stop returned with the load held
    gate.set()
    wait_until(lambda: not model_work_in_progress())
    assert len(made) == 1 and not made[0]._thread.is_alive()  # the model it loaded, closed
    assert pool.by_name["a"].served is None
