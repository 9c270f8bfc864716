"""What the HTTP server tests share: a tiny synthetic target in float32, real uvicorn
servers on 127.0.0.1 (`Server`; `vision_server`, whose engine takes images and records
the requests it is given), a scripted engine decoder, and the expected plain outputs."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import httpx
import mlx.core as mx
import openai
import pytest
import uvicorn
from decoding import plain

from monolith.models.image_inputs import ImageSettings
from monolith.models.vision import Vision, load_vision_tower
from monolith.pack import build_pack
from monolith.runtime.batch import Forward
from monolith.runtime.decoder import Decoder
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.events import Outcome
from monolith.sampling import SamplingParams
from monolith.serving.app import ServerConfig, create_app
from monolith.synth import write_pair

MAX_CONTEXT = 1024
NAME = "tiny"
GREEDY = SamplingParams()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}}]


# ------------------------------------------------------------------ fixtures


class Server:
    """A uvicorn server on a free port of 127.0.0.1, in a thread of this process."""

    def __init__(self, load, http="auto", **config):
        config.setdefault("model_names", (NAME,))
        self.app = create_app(load, ServerConfig(**config))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    http=http))
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
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT))) as s:
        yield s.wait_ready()


class Recording(Engine):
    """An Engine that keeps the GenerationRequests submitted to it (`submitted`)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.submitted = []

    def submit(self, request, sink, *args, **kw):
        self.submitted.append(request)
        return super().submit(request, sink, *args, **kw)


@pytest.fixture(scope="module")
def vision(synth_dir):
    """The models.vision.Vision of the tiny target's synthetic checkpoint, with image
    settings of its patch size that keep an image within 64 tokens."""
    ckpt = synth_dir("target")
    config = json.loads((ckpt / "config.json").read_text())
    settings = ImageSettings(patch_size=config["vision_config"]["patch_size"], min_pixels=64, max_pixels=64 * 64)
    return Vision(config, settings, lambda: load_vision_tower(ckpt))


@pytest.fixture(scope="module")
def vision_server(model, tok, vision):
    """A server whose engine takes images (a Recording engine: `server.engine.submitted`)."""
    with Server(lambda: Recording(model, tok, Limits(max_context=MAX_CONTEXT), vision=vision)) as s:
        s.wait_ready()
        s.engine = s.app.state.monolith.engine
        yield s


class Scripted(Decoder):
    """A decoder that 'generates' `tokens` and stops with a stop token. It speaks the
    engine's decoder interface (decoder.Decoder: `steps`, run in the engine's
    Batch; no logprobs): one round per token, each round a forward of this object instead of a model
    (it sleeps `per_token`), after `delay` seconds of 'prefill'. It resumes with `cached`
    prompt tokens; `fail(call)` (call 1, 2, ...) gives the error a call raises once it has
    resumed, or None."""

    logprobs = False

    def __init__(self, tokens, spec=None, delay=0.0, per_token=0.0, cached=0, fail=lambda call: None):
        self.tokens, self.spec, self.delay, self.per_token, self.cached = list(tokens), spec, delay, per_token, cached
        self.fail, self.calls = fail, 0

    def forward(self, tokens, cache, taps=(), logits="all"):
        time.sleep(self.per_token)

    def round(self, token: int) -> Forward:
        return Forward(self, mx.array([token], dtype=mx.int32), None)

    def steps(self, generation):
        prompt, max_tokens, emitter = generation.prompt, generation.max_tokens, generation.emitter
        self.calls += 1
        emitter.resumed(self.cached)
        error = self.fail(self.calls)
        if error is not None:  # after resuming: the response has started
            raise error
        time.sleep(self.delay)
        tokens, delay = self.tokens, self.delay
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        out = []
        for t in tokens[:limit]:
            if emitter.cancelled():
                return Outcome(out, "abort", len(prompt), self.cached, delay, 0.0, len(out))
            yield self.round(t)
            out.append(t)
            if not emitter.token(t, None):
                return Outcome(out, "abort", len(prompt), self.cached, delay, 0.0, len(out))
        done = limit == len(tokens)
        return Outcome(out, "stop" if done else "length", len(prompt), self.cached, delay, 0.01, len(out),
                       stop_token=done, speculative=self.spec)


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


@pytest.fixture(scope="module")
def synth_pair(tmp_path_factory):
    """(the default synthetic target's pack, its draft's checkpoint, a cache directory)."""
    root = tmp_path_factory.mktemp("pair")
    target, draft = write_pair(root / "pair")
    return build_pack(target, root / "target.pack", role="target"), draft, root / "cache"


@contextmanager
def demo_servers(pair, name: str = "demo", max_context: int = MAX_CONTEXT):
    """{"plain": Server, "speculative": Server} on (model, drafter, tokenizer), e.g. the
    demo pair (conftest's demo_f32), serving the model as `name`."""
    model, drafter, tok = pair
    plain = Server(lambda: Engine(model, tok, Limits(max_context=max_context)), model_names=(name,))
    spec = Server(lambda: Engine(model, tok, Limits(max_context=max_context),
                                 decoder=Decoder(model, drafter, max_context)), model_names=(name,))
    with plain as p, spec as s:
        yield {"plain": p.wait_ready(), "speculative": s.wait_ready()}
