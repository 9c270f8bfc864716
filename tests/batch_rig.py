"""The batching tests' rig (tests/test_batching.py, tests/test_batch_step.py): prompts of
mixed lengths, each test's decoder, a sink that collects a request's events, a request
served alone by an engine that runs one at a time, and requests served together."""

from __future__ import annotations

import itertools

from monolith.runtime.decoder import Decoder
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.events import Delta, Finished, GenerationRequest, Started
from monolith.runtime.session import Session
from monolith.sampling import SamplingParams

MAX_CONTEXT = 512
TEXTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest",
    "1, 2, 3, 4,",
    "A long prompt: " + "the rain in Spain falls mainly on the plain; " * 12,
    "Q: What is the capital of France?\nA:",
]


def decoder(kind, model, drafter):
    if kind == "plain":
        return Decoder(model, None, MAX_CONTEXT, prefill_chunk_size=32)
    return Decoder(model, drafter, MAX_CONTEXT, prefill_chunk_size=32)


def prompts(tok):
    return [tuple(tok.encode(t)) for t in TEXTS]


class Collect:
    """A request's sink: its tokens' text and its Finished (and the order it started in)."""

    started = itertools.count()

    def __init__(self, on_delta=None):
        self.text, self.finished, self.deltas, self.order = [], None, 0, None
        self.on_delta = on_delta

    def __call__(self, event):
        if isinstance(event, Started):
            self.order = next(self.started)
        elif isinstance(event, Delta):
            self.text.append(event.text)
            self.deltas += 1
            if self.on_delta is not None:
                self.on_delta(self)
        elif isinstance(event, Finished):
            self.finished = event


GREEDY = SamplingParams()


def alone(model, tok, dec, prompt, max_tokens, params=GREEDY):
    """The request served by an engine that runs one at a time, on a fresh session."""
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_batch=1), decoder=dec)
    try:
        _, finished = engine.run_request(GenerationRequest(prompt, max_tokens=max_tokens, params=params), Session())
        return finished.token_ids, finished
    finally:
        engine.close()


def together(engine, requests, sinks=None):
    """Submit every request at once; wait for all; their Finished events."""
    sinks = sinks or [Collect() for _ in requests]
    jobs = [engine.submit(r, s) for r, s in zip(requests, sinks)]
    for job in jobs:
        assert job.done.wait(300)
    return [s.finished for s in sinks]
