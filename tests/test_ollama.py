"""Ollama's API (monolith/serving/ollama/), driven by the official clients: `ollama` for
Python (the test extras) and ollama-js (tests/clients/package.json; skipped, saying so,
where npm did not install it). On the tiny synthetic target: a chat and a stream whose
text equals the engine's own greedy decode, a tool turn with the result sent back, a
JSON-schema `format` whose output validates (jsonschema), /api/tags, /api/ps, /api/show,
/api/version, Ollama-shaped errors the clients print, and warm == cold: a conversation
resent with an edited reply gets from a server with a prompt cache what a server with
none answers. Then speculation (the demo pair: drafting == plain) and batching (each of
four requests at once is its own greedy decode) through the same API.

The tiny model is too weak to choose a tool, so the engine forces the call (test-only,
as tests/client_rig.py's proxy does for the agent clients): a request whose prompt asks
about the "secret note" and holds no tool result gets the grammar of one call to
get_weather; the turn after the result is the model's own."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import jsonschema
import ollama
import pytest
from client_rig import CLIENTS
from serving_rig import (
    MAX_CONTEXT,
    Recording,
    Scripted,
    Server,
    chat_ids,
    demo_servers,
    expected,
)
from vision_rig import png

from monolith.runtime.engine import Engine, Limits
from monolith.runtime.prompt_cache import PromptCache
from monolith.serve import build_parser, pulled
from monolith.serving.models import ModelPool, ModelSpec
from monolith.serving.structured import grammar
from monolith.serving.tools.specs import forced_calls

KEY = "ollama-test-key"
NAME = "tiny"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
FORCED = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}}}]
OLLAMA_JS = CLIENTS / "node_modules" / "ollama" / "package.json"
GREEDY = {"temperature": 0, "num_predict": 8}


class Forcing(Recording):
    """An engine that forces one get_weather call on the request asking about the secret
    note before its result came back (see the module docstring)."""

    def submit(self, request, sink, *args, **kw):
        text = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
        if "secret note" in text and "<tool_response>" not in text:
            request = replace(request, grammar=grammar(forced_calls(FORCED, single=True), self.tokenizer, False))
        return super().submit(request, sink, *args, **kw)


@pytest.fixture(scope="module")
def warm(model, tok):
    """The server under test: a prompt cache, the API key required."""
    cache = PromptCache(64 << 20, save_every=16)
    with Server(lambda: Forcing(model, tok, Limits(max_context=MAX_CONTEXT), prompt_cache=cache), model_names=(NAME,),
                api_key=KEY) as s:
        s.wait_ready()
        s.engine = s.app.state.monolith.engine
        yield s


@pytest.fixture(scope="module")
def cold(model, tok):
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)), model_names=(NAME,)) as s:
        yield s.wait_ready()


def client(server, key=KEY) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def said(model, tok, text, n=GREEDY["num_predict"]) -> str:
    """The engine's own greedy decode of a one-message chat (serving_rig.expected)."""
    return expected(model, tok, chat_ids(tok, text), n)[1]


def test_chat_and_stream_are_the_greedy_decode(warm, model, tok):
    c = client(warm)
    reply = c.chat(model=NAME, messages=[{"role": "user", "content": "Say hello."}], options=GREEDY, stream=False)
    assert reply.message.content == said(model, tok, "Say hello.")
    assert reply.done and reply.done_reason == "length" and reply.eval_count == GREEDY["num_predict"]
    assert reply.prompt_eval_count == len(chat_ids(tok, "Say hello."))
    assert reply.total_duration >= reply.prompt_eval_duration + reply.eval_duration > 0
    parts = list(c.chat(model=f"{NAME}:latest", messages=[{"role": "user", "content": "Say hi."}], options=GREEDY,
                        stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == said(model, tok, "Say hi.")
    assert parts[-1].eval_count == GREEDY["num_predict"] and parts[-1].done_reason == "length"
    generated = c.generate(model=NAME, prompt="Say hello.", options=GREEDY)
    assert generated.response == said(model, tok, "Say hello.")


def test_a_tool_turn_with_its_result_sent_back(warm, tok):
    c = client(warm)
    ask = {"role": "user", "content": "What is the weather in the secret note city?"}
    call = c.chat(model=NAME, messages=[ask], tools=TOOLS, options={"temperature": 0, "num_predict": 200})
    assert call.done_reason == "stop", call
    assert [(t.function.name, dict(t.function.arguments)) for t in call.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    result = {"role": "tool", "content": "11 degrees celsius", "tool_name": "get_weather"}
    after = c.chat(model=NAME, messages=[ask, call.message, result], tools=TOOLS, options=GREEDY)
    assert after.done
    prompt = tok.decode(warm.engine.submitted[-1].prompt_ids, skip_special_tokens=False)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt  # the call, as the template writes it
    assert "<tool_response>\n11 degrees celsius\n</tool_response>" in prompt


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_format_is_enforced(warm, stream):
    c = client(warm)
    out = c.chat(model=NAME, messages=[{"role": "user", "content": "Answer in JSON."}], format=SCHEMA,
                 options={"temperature": 0, "num_predict": 100}, stream=stream)
    parts = list(out) if stream else [out]
    assert parts[-1].done_reason == "stop"
    jsonschema.validate(json.loads("".join(p.message.content for p in parts)), SCHEMA)
    loose = c.generate(model=NAME, prompt="JSON please", format="json", options={"temperature": 0, "num_predict": 100})
    assert loose.done_reason == "stop" and isinstance(json.loads(loose.response), dict)


def test_models_are_listed_shown_and_versioned(warm):
    c = client(warm)
    pack = json.loads((warm.engine.tokenizer.path / "manifest.json").read_text())
    (tag,) = c.list().models
    assert tag.model == NAME and tag.digest == pack["pack_sha256"] and tag.details.family == pack["architecture"]
    (running,) = c.ps().models
    assert running.model == NAME and running.expires_at is not None and running.context_length == MAX_CONTEXT
    shown = c.show(NAME)
    assert shown.template == warm.engine.tokenizer.chat_template and "tools" in shown.capabilities
    assert shown.modelinfo[f"{pack['architecture']}.context_length"] == MAX_CONTEXT
    version = httpx.get(warm.url + "/api/version", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert set(version) == {"version"} and version["version"]


def test_keep_alive_zero_unloads_and_expiry_follows_keep_alive(cold):
    c = ollama.Client(host=cold.url)
    c.chat(model=NAME, messages=[{"role": "user", "content": "hi"}], options=GREEDY, keep_alive="1h")
    (running,) = c.ps().models
    assert 3500 < running.expires_at.timestamp() - time.time() <= 3600
    unloaded = c.chat(model=NAME, messages=[], keep_alive=0)
    assert unloaded.done and unloaded.done_reason == "unload"
    deadline = time.monotonic() + 10
    while c.ps().models and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.ps().models == []
    assert c.chat(model=NAME, messages=[{"role": "user", "content": "hi"}], options=GREEDY).done  # loaded again


@pytest.mark.parametrize("body, where", [
    ({"model": NAME, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "options": {"temperature": "hot"}},
     "options.temperature"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "options": {"repeat_penalty": 1.2}},
     "options.repeat_penalty"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "options": {"mystery": 1}}, "options.mystery"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
])
def test_a_bad_body_is_an_ollama_400_naming_the_field(warm, body, where):
    raw = httpx.post(warm.url + "/api/chat", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert raw.status_code == 400 and set(raw.json()) == {"error"} and raw.json()["error"].startswith(where), raw.text
    if "options" in body:  # what the Python client passes on unchecked (its own types check the rest)
        with pytest.raises(ollama.ResponseError) as e:
            client(warm).chat(**body)
        assert e.value.status_code == 400 and e.value.error.startswith(where), e.value.error


def test_other_routes_and_refusals_are_ollama_errors(warm):
    c = client(warm)
    with pytest.raises(ollama.ResponseError) as e:
        c.embed(model=NAME, input="text")
    assert e.value.status_code == 501 and "embeddings are not supported" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.pull("llama3.2")
    assert e.value.status_code == 404 and "only the models it was started with" in e.value.error
    assert [m.model for m in c.list().models] == [NAME]  # nothing was added
    with pytest.raises(ollama.ResponseError) as e:
        client(warm, key="wrong").list()
    assert e.value.status_code == 401 and isinstance(e.value.error, str)
    auth = {"Authorization": f"Bearer {KEY}"}
    for headers in ({"Origin": "https://evil.example"}, {"Host": "evil.example"}):  # access.py's checks
        r = httpx.post(warm.url + "/api/chat", json={"model": NAME, "messages": []}, headers={**auth, **headers})
        assert r.status_code == 403 and set(r.json()) == {"error"}, r.text
    for method, path, status in (("GET", "/api/nothing", 404), ("GET", "/api/chat", 405), ("DELETE", "/api/delete", 501)):
        r = httpx.request(method, warm.url + path, headers=auth)
        assert r.status_code == status and set(r.json()) == {"error"} and path in r.json()["error"], r.text
    pulled = [p.status for p in c.pull(NAME, stream=True)]
    assert pulled[0] == "pulling manifest" and pulled[-1] == "success"


def test_warm_equals_cold(warm, cold):
    """A second turn resent with the first reply edited ("Well: " + reply, what agents
    resend): the warm server (prompt cache, earlier requests) answers as the cold one."""
    turn1 = [{"role": "user", "content": "What does os.path.join do?"}]
    reply1 = client(warm).chat(model=NAME, messages=turn1, options=GREEDY).message.content
    turn2 = turn1 + [{"role": "assistant", "content": "Well: " + reply1},
                     {"role": "user", "content": "And what does os.path.split do?"}]
    want = ollama.Client(host=cold.url).chat(model=NAME, messages=turn2, options=GREEDY).message.content
    assert client(warm).chat(model=NAME, messages=turn2, options=GREEDY).message.content == want
    streamed = client(warm).chat(model=NAME, messages=turn2, options=GREEDY, stream=True)
    assert "".join(p.message.content for p in streamed) == want


def test_ollama_js(warm, tmp_path):
    if not OLLAMA_JS.exists() or shutil.which("node") is None:
        pytest.skip("ollama-js is not installed (tests/clients/install.sh installs it where npm exists)")
    run = subprocess.run(["node", str(CLIENTS / "ollama_turns.mjs"), warm.url, KEY, NAME, json.dumps(SCHEMA)],
                         capture_output=True, text=True, timeout=120, cwd=CLIENTS, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["chat"]["done"] and out["chat"]["message"]["content"] == \
        "".join(p["message"]["content"] for p in out["stream"])  # the same greedy reply, streamed
    assert out["stream"][-1]["done"] and out["stream"][-1]["eval_count"] == GREEDY["num_predict"]
    assert out["call"]["message"]["tool_calls"][0]["function"] == {"index": 0, "name": "get_weather",
                                                                   "arguments": {"city": "Paris"}}
    assert out["after"]["done"]
    prompt = warm.engine.tokenizer.decode(warm.engine.submitted[-2].prompt_ids, skip_special_tokens=False)
    assert "<tool_response>\n11 degrees celsius\n</tool_response>" in prompt  # the result reached the model
    jsonschema.validate(json.loads(out["format"]["message"]["content"]), SCHEMA)
    assert [m["model"] for m in out["tags"]["models"]] == [NAME] and out["ps"]["models"][0]["expires_at"]
    assert out["show"]["template"] and out["version"]["version"]
    assert out["wrongType"] == {"name": "ResponseError", "message": "messages[0].content must be a string, got 5",
                                "status": 400}
    assert out["unknownRoute"]["status"] == 501 and "embeddings are not supported" in out["unknownRoute"]["message"]


def test_think_switches_the_template_and_reasoning_comes_as_thinking(model, tok):
    """`think` is the template's enable_thinking; a reply's think block comes back as
    `thinking`, streamed or not, on /api/chat and /api/generate."""
    scripted = Scripted(tok.encode("<think>\nweighing it\n</think>\n\nHello there"))
    with Server(lambda: Recording(model, tok, Limits(max_context=MAX_CONTEXT), decoder=scripted),
                model_names=(NAME,)) as s:
        s.wait_ready()
        c, engine = ollama.Client(host=s.url), s.app.state.monolith.engine
        ask = [{"role": "user", "content": "hi"}]
        for think in (False, True):
            reply = c.chat(model=NAME, messages=ask, think=think)
            prompt = tok.decode(engine.submitted[-1].prompt_ids, skip_special_tokens=False)
            assert prompt == tok.apply_chat_template(ask, None, enable_thinking=think)
            assert (reply.message.thinking.strip(), reply.message.content) == ("weighing it", "Hello there")
        parts = list(c.chat(model=NAME, messages=ask, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == reply.message.thinking
        assert "".join(p.message.content for p in parts) == "Hello there"
        generated = c.generate(model=NAME, prompt="hi", system="Be brief.")
        assert (generated.thinking, generated.response) == (reply.message.thinking, "Hello there")
        prompt = tok.decode(engine.submitted[-1].prompt_ids, skip_special_tokens=False)
        assert prompt == tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "hi"}], None)


def test_images_reach_the_engine(vision_server):
    """A message's base64 images (Ollama's `images`) are the prompt's images, in order: the
    ones OpenAI's chat gets from the same bytes as data: URLs."""
    c = ollama.Client(host=vision_server.url)
    images = [png(1), png(2)]
    reply = c.chat(model=NAME, messages=[{"role": "user", "content": "Describe these.", "images": images}],
                   options=GREEDY)
    assert reply.done
    digests = [image.digest for image in vision_server.engine.submitted[-1].images]
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(i).decode()}}
             for i in images]
    vision_server.client().chat.completions.create(model=NAME, max_tokens=1, messages=[
        {"role": "user", "content": parts + [{"type": "text", "text": "Describe these."}]}])
    assert digests == [image.digest for image in vision_server.engine.submitted[-1].images]
    assert len(set(digests)) == 2
    generated = c.generate(model=NAME, prompt="Describe it.", images=[images[0]], options=GREEDY)
    assert generated.done and len(vision_server.engine.submitted[-1].images) == 1


def test_pull_adds_a_model_only_when_the_server_allows_it(model, tok):
    """With --allow-pull (the pool's `pull`) a name not configured is added, loaded and
    served; its progress comes as Ollama's status lines."""
    pool = ModelPool([ModelSpec((NAME,), lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)))])
    pool.pull = lambda name: ModelSpec((name,), lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT)))
    with Server(pool) as s:
        c = ollama.Client(host=s.wait_ready().url)
        statuses = [p.status for p in c.pull("other", stream=True)]
        assert statuses[0] == "pulling manifest" and "resolving, packing and loading other" in statuses
        assert statuses[-1] == "success"
        assert [m.model for m in c.list().models] == [NAME, "other"]
        assert c.chat(model="other", messages=[{"role": "user", "content": "hi"}], options=GREEDY).done
        assert c.pull("other").status == "success"  # again: already there


def test_allow_pull_plans_the_name_as_a_model_of_its_own(tmp_path):
    """serve's --allow-pull: a pulled name is --model NAME with the server's other flags, no
    draft (its flags checked as plan_model checks them)."""
    args = build_parser().parse_args(["--allow-pull", "--draft-block-size", "4", "--max-context", "2048"])
    (model_args, plan), size = pulled(args, str(tmp_path), lambda *a: a)
    assert model_args.model == str(tmp_path) and model_args.no_draft and model_args.draft is None
    assert plan.target == str(tmp_path) and model_args.max_context == 2048 and size() == 0
    assert build_parser().parse_args([]).allow_pull is False


def test_speculation_changes_nothing(demo_f32):
    """On the demo pair, greedy: the drafting server's Ollama replies are the plain one's,
    streamed and not."""
    ask = [{"role": "user", "content": "Write a haiku about caches."}]
    options = {"temperature": 0, "num_predict": 24}
    with demo_servers(demo_f32, "demo") as servers:
        replies = {}
        for kind, server in servers.items():
            c = ollama.Client(host=server.url)
            whole = c.chat(model="demo", messages=ask, options=options, think=False).message.content
            parts = c.chat(model="demo", messages=ask, options=options, think=False, stream=True)
            assert "".join(p.message.content for p in parts) == whole
            replies[kind] = whole
        assert replies["plain"] == replies["speculative"] and replies["plain"]


def test_batched_requests_are_each_the_greedy_decode(model, tok):
    """Four Ollama chats at once on a server that batches four: each is its own greedy
    decode."""
    asks = ["Say hello.", "Name a colour.", "Count to three.", "What is a cache?"]
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_batch=4)), model_names=(NAME,)) as s:
        c = ollama.Client(host=s.wait_ready().url)
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda text: c.chat(model=NAME, messages=[{"role": "user", "content": text}],
                                                        options=GREEDY).message.content, asks))
    assert replies == [said(model, tok, text) for text in asks]
