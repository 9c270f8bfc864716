"""What holds for one model holds for each of two configured in one server (serving/
models.py; docs/serving.md, "Several models"): the demo pair as the default model and a
synthetic dense target with its DSpark draft as the second, both as serve builds them,
through one ModelPool, their requests interleaved.

- warm == cold (tests/histories.py): generated agent-style histories sent to the second
  model through the pool, each request preceded by the same prompt to the default model;
  each model's greedy replies equal a cold engine's of that model. The prompt cache is
  on, both models' states in one --prompt-cache-dir (each model must resume only its
  own); half way the second model is unloaded and the pool loads it again on the next
  request, which resumes from its disk states. Batched: four clients at once.
- batching: concurrent HTTP requests to both models, each model running several at
  once, each reply equal to its own model's plain greedy output.

The agent-client matrix runs against a server of two models, the clients naming the
second (tests/test_agent_clients.py's server)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from histories import Ask, Histories, WarmCold, serve_engine, synthetic_pair
from serving_rig import Server, expected

from monolith.serving.models import ModelPool, ModelSpec

DEFAULT, SECOND = "monolith-demo", "synth"
EVERY = "16"  # the prompt cache's save interval: cuts land inside intervals
CASES = 6  # one history of each kind per mode


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """A dense synthetic target and a DSpark draft for it, float32: (its checkpoint
    directory, (model, drafter, tokenizer)). Its ids are all below the demo's vocabulary,
    so any prompt of its can go to the demo too."""
    return synthetic_pair(tmp_path_factory.mktemp("second"), True, 7)


def two_models(demo_f32, synth, argv, on_load=lambda name, engine: engine) -> ModelPool:
    """A pool of the demo pair (the default) and the synthetic target, each engine made
    as serve makes it with `argv` (`on_load(name, engine)` sees each engine it loads)."""
    target, loaded = synth
    return ModelPool([ModelSpec((DEFAULT,), lambda: on_load(DEFAULT, serve_engine(demo_f32, *argv))),
                      ModelSpec((SECOND,), lambda: on_load(SECOND, serve_engine(loaded, *argv, target_dir=target)))],
                     check_every=3600.0)


def on_loop(pool: ModelPool, coroutine):
    """Run `coroutine` on the server's event loop (where the pool's state lives): its result."""
    return asyncio.run_coroutine_threadsafe(coroutine, pool.loop).result(120)


async def _release(lease) -> None:
    lease.release()


class PoolModel:
    """The pool's model `name` as WarmCold's warm engine: each request holds it through
    the pool as an API handler does (loading it when it is unloaded) and runs on its
    engine; `before(request)` runs first (the other model's turn). `cached` keeps each
    request's (the model's loads so far, its prompt tokens served from the prompt cache)."""

    def __init__(self, pool: ModelPool, name: str, tokenizer, before=lambda request: None):
        self.pool, self.name, self.tokenizer, self.before = pool, name, tokenizer, before
        self.cached: list[tuple[int, int]] = []

    def run_request(self, request):
        self.before(request)
        lease = on_loop(self.pool, self.pool.hold(self.name))
        try:
            text, finished = lease.served.engine.run_request(request)
        finally:
            on_loop(self.pool, _release(lease))
        self.cached.append((lease.slot.loads, finished.usage.cached_tokens))
        return text, finished


def cold_flags(argv) -> list[str]:
    """argv without the prompt cache's flags and --max-batch: the cold engine's."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--prompt-cache-save-every", "--prompt-cache-dir", "--max-batch"):
            skip = True
        else:
            out.append(arg)
    return [*out, "--prompt-cache-size", "0"]


MODES = {
    "drafting, prompt cache on disk, the second model unloaded half way":
        ("--spec-sched", "fixed", "--prompt-cache-save-every", EVERY, "--prompt-cache-dir", "DIR"),
    "plain, prompt cache on disk, 4 clients batched":
        ("--no-draft", "--prompt-cache-save-every", EVERY, "--prompt-cache-dir", "DIR", "--max-batch", "4"),
}


@pytest.mark.parametrize("mode", MODES)
def test_warm_equals_cold_for_both_of_two_models(demo_f32, synth, mode, tmp_path):
    argv = [str(tmp_path / "prompts") if a == "DIR" else a for a in MODES[mode]] + ["--prefill-chunk-size", "32"]
    clients = 4 if "--max-batch" in argv else 1
    target, loaded = synth
    pool = two_models(demo_f32, synth, argv)
    colds = {DEFAULT: serve_engine(demo_f32, *cold_flags(argv)),
             SECOND: serve_engine(loaded, *cold_flags(argv), target_dir=target)}
    with Server(pool, model_names=pool.names()) as server:
        server.wait_ready()
        default = WarmCold(PoolModel(pool, DEFAULT, demo_f32[2]), colds[DEFAULT], demo_f32[0])
        second = WarmCold(PoolModel(pool, SECOND, loaded[2],
                                    before=lambda request: default.ask(Ask("interleaved", prompt=list(request.prompt_ids)))),
                          colds[SECOND], loaded[0])
        cases = Histories(random.Random(41), loaded[2].encode_chat, int(EVERY)).cases(CASES)
        try:
            if clients == 1:
                second.run(cases[:CASES // 2])
                unload_now(pool, SECOND)
                second.run(cases[CASES // 2:])
                assert pool.by_name[SECOND].loads == 2
                reloaded = [cached for loads, cached in second.warm.cached if loads == 2]
                assert reloaded[0] > 0, "the reloaded model's first request resumed nothing from its disk states"
            else:
                second.run(cases, clients)
        finally:
            for engine in colds.values():
                engine.close()
    for check in (default, second):
        assert check.requests >= 2 * CASES
        assert not check.mismatches, check.mismatches[:3]


def unload_now(pool: ModelPool, name: str) -> None:
    """Unload `name` as a keep-alive of 0 does once its engine is idle (a request's
    keep_alive field sets its model's own)."""
    slot = pool.by_name[name]
    deadline = time.monotonic() + 60
    while slot.served.engine.busy:  # the reply reaches its client just before the engine lets go
        assert time.monotonic() < deadline, "the model never became idle"
        time.sleep(0.01)
    slot.keep_alive = 0.0
    assert on_loop(pool, pool.unload_idle()) == [name] and slot.served is None


def test_concurrent_requests_to_two_models_batch_and_each_equals_its_model_alone(demo_f32, synth):
    """Eight streams at once, four to each model, interleaved; each model's engine runs
    several at once (its first round waits until all four of its requests came), and
    every reply is its own model's plain greedy output."""
    loaded = synth[1]
    models = {DEFAULT: demo_f32, SECOND: loaded}
    batches = {DEFAULT: [], SECOND: []}
    arrived = {DEFAULT: threading.Semaphore(0), SECOND: threading.Semaphore(0)}

    def gated(name, engine):
        submit, step, seen = engine.submit, engine._batch.step, []

        def counted(*args, **kw):
            job = submit(*args, **kw)
            arrived[name].release()
            return job

        def first_waits():
            if not seen:
                for _ in range(4):
                    assert arrived[name].acquire(timeout=120), "the requests never came"
            seen.append(1)
            batches[name].append(len(engine._batch))
            return step()

        engine.submit, engine._batch.step = counted, first_waits
        return engine

    pool = two_models(demo_f32, synth, ["--spec-sched", "fixed", "--max-batch", "4"], on_load=gated)
    prompts = [models[name][2].encode_chat([{"role": "user", "content": text}])
               for name, text in zip([DEFAULT, SECOND] * 4, ["Hi.", "What is a list?", "Sort a dict.", "Say yes.",
                                                              "Why?", "Write a loop.", "Name a file.", "Go on."])]
    names = [DEFAULT, SECOND] * 4
    with Server(pool, model_names=pool.names()) as server:
        server.wait_ready()
        replies = [None] * len(prompts)

        def send(i):
            body = {"model": names[i], "prompt": prompts[i], "max_tokens": 12, "temperature": 0}
            replies[i] = server.post("/v1/completions", body)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    for name, prompt, reply in zip(names, prompts, replies):
        assert reply.status_code == 200, reply.text
        model, _, tok = models[name]
        assert reply.json()["model"] == name
        assert reply.json()["choices"][0]["text"] == expected(model, tok, prompt, 12)[1], name
    assert max(batches[DEFAULT]) > 1 and max(batches[SECOND]) > 1
