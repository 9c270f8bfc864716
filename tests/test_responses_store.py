"""The Responses API's response store and the endpoints on stored responses, through the
official openai client (retrieve, input_items.list, delete, cancel) and raw httpx: the
store's count and byte bounds, its directory surviving a restart (previous_response_id
afterwards equals sending the conversation whole), corrupt and truncated files skipped,
and the items and pages checked against the SDK's own types."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseItem
from serving_rig import Scripted, Server, assert_error
from starlette.datastructures import QueryParams
from starlette.routing import Match

from monolith.runtime.engine import Engine, Limits
from monolith.runtime.events import Outcome
from monolith.serving.responses.routes import StoredResponses
from monolith.serving.responses.store import ResponseStore, Stored, encode, input_items

NAME = "demo"
COMMON = {"model": NAME, "instructions": "You are terse.", "max_output_tokens": 12, "temperature": 0}
ITEMS = pydantic.TypeAdapter(ResponseItem)


def serve(demo, directory=None, **config):
    model, _, tok = demo
    return Server(lambda: Engine(model, tok, Limits(max_context=1024)), model_names=(NAME,),
                  response_store_dir=None if directory is None else str(directory), **config)


@pytest.fixture(scope="module")
def server(demo_f32, tmp_path_factory):
    with serve(demo_f32, tmp_path_factory.mktemp("store") / "responses") as s:
        yield s.wait_ready()


def stored(body_id: str, text: str = "x") -> tuple[dict, list[dict], list[dict]]:
    return ({"id": body_id, "object": "response", "status": "completed", "output": []},
            [{"role": "user", "content": text}], input_items(text))


# ------------------------------------------------------------------ the store itself


def test_bounds_drop_the_least_recently_used(tmp_path):
    size = len(encode(Stored(*stored("resp_a"))))  # every entry "resp_?" with input "x" has this size
    store = ResponseStore(size=3, max_bytes=3 * size + 10, directory=tmp_path)
    for name in "abc":
        store.put(*stored(f"resp_{name}"))
    store.get("resp_a", "previous_response_id")  # now the most recently used
    store.put(*stored("resp_d"))  # over the count: b goes
    assert list(store.entries) == ["resp_c", "resp_a", "resp_d"] and store.nbytes == 3 * size
    e_entry = stored("resp_e", "y" * (size // 2))
    store.put(*e_entry)  # over the bytes as well: c and a go
    assert list(store.entries) == ["resp_d", "resp_e"]
    with pytest.raises(Exception) as e:
        store.get("resp_b", "previous_response_id")
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    store.put(*stored("resp_huge", "z" * 4 * size))  # larger than the bound alone: not stored, nothing dropped
    assert list(store.entries) == ["resp_d", "resp_e"]
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resp_d.json", "resp_e.json"]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) == store.nbytes  # the disk, bounded the same

    again = ResponseStore(size=1, max_bytes=10**6, directory=tmp_path)  # a smaller bound at start
    assert list(again.entries) == ["resp_e"] and again.get("resp_e", "x") == e_entry
    again.close()
    assert [p.name for p in tmp_path.iterdir()] == ["resp_e.json"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "garbage"])
def test_a_damaged_file_is_skipped_and_removed(tmp_path, caplog, damage):
    store = ResponseStore(directory=tmp_path)
    store.put(*stored("resp_ok"))
    store.put(*stored("resp_bad", "the text"))
    store.close()
    path = tmp_path / "resp_bad.json"
    data = path.read_bytes()
    path.write_bytes({"flip": data.replace(b"the text", b"thE text"), "truncate": data[:-5],
                      "foreign": data.replace(b'"resp_bad"', b'"resp_xxx"', 1), "garbage": b"\x00" * 40}[damage])
    (tmp_path / ".tmp-dead.json").write_bytes(b"half")  # a write that died before its rename
    (tmp_path / "notes.json").write_bytes(b"{}")  # not a response file: left alone
    again = ResponseStore(directory=tmp_path)
    assert ".tmp-dead.json" not in {p.name for p in tmp_path.iterdir()}
    with caplog.at_level(logging.WARNING, "monolith.serve"), pytest.raises(Exception) as e:
        again.get("resp_bad", "previous_response_id")
    assert e.value.status == 404 and "resp_bad.json" in caplog.text
    assert again.get("resp_ok", "previous_response_id").body["id"] == "resp_ok"
    again.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json", "resp_ok.json"]


def test_encrypted_reasoning_is_listed_only_when_included():
    store = ResponseStore()
    reasoning = {"type": "reasoning", "summary": [], "encrypted_content": "sealed"}
    store.put({"id": "resp_r"}, [], input_items([reasoning, {"role": "user", "content": "x"}]))

    def listed(query: str) -> list[dict]:
        request = SimpleNamespace(path_params={"response_id": "resp_r"}, query_params=QueryParams(query), method="GET")
        page = asyncio.run(StoredResponses(store).input_items(request))
        return [ITEMS.validate_python(item).model_dump(exclude_none=True) for item in page["data"]]

    assert "encrypted_content" not in listed("order=asc")[0]
    assert listed("order=asc&include[]=reasoning.encrypted_content")[0]["encrypted_content"] == "sealed"


# ------------------------------------------------------------------ the endpoints


def test_retrieve_input_items_and_delete(server):
    client = server.client()
    conversation = [{"role": "developer", "content": "Answer in English."},
                    {"role": "user", "content": [{"type": "input_text", "text": "Hello,"},
                                                 {"type": "input_text", "text": " who are you?"}]},
                    {"type": "message", "role": "assistant", "content": "I am a model."},
                    {"role": "user", "content": "And what can you do?"}]
    reply = client.responses.create(input=conversation, **COMMON)
    assert client.responses.retrieve(reply.id) == reply

    raw = httpx.get(f"{server.url}/v1/responses/{reply.id}/input_items", params={"order": "asc"}).json()
    assert set(raw) == {"object", "data", "first_id", "last_id", "has_more"} and raw["object"] == "list"
    assert raw["has_more"] is False and (raw["first_id"], raw["last_id"]) == (raw["data"][0]["id"],
                                                                              raw["data"][-1]["id"])
    items = [ITEMS.validate_python(item) for item in raw["data"]]  # the SDK's own types, strictly
    assert [(i.role, "".join(c.text for c in i.content)) for i in items] == [
        (m["role"], m["content"] if isinstance(m["content"], str) else "Hello, who are you?") for m in conversation]
    assert len({i.id for i in items}) == 4

    listed = client.responses.input_items.list(reply.id)  # default: newest first, 20
    assert [i.id for i in listed.data] == [i.id for i in items][::-1]
    pages = client.responses.input_items.list(reply.id, limit=1, order="asc")
    assert pages.has_more and [i.id for i in pages] == [i.id for i in items]  # auto-paginated by `after`
    after = client.responses.input_items.list(reply.id, after=items[1].id, order="asc", limit=1,
                                              include=["reasoning.encrypted_content"])
    assert [i.id for i in after.data] == [items[2].id] and after.has_more

    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_nope"}, "after"), ({"include": "everything"}, "include"),
                          ({"before": items[0].id}, "before")):
        assert_error(httpx.get(f"{server.url}/v1/responses/{reply.id}/input_items", params=params), 400, param)

    string = client.responses.create(input="Hi", store=True, **COMMON)
    only = client.responses.input_items.list(string.id).data
    assert len(only) == 1 and only[0].role == "user" and only[0].content[0].text == "Hi"

    deleted = httpx.delete(f"{server.url}/v1/responses/{reply.id}")
    assert deleted.json() == {"id": reply.id, "object": "response", "deleted": True}
    assert client.responses.delete(string.id) is None  # the SDK's own call
    for gone in (reply.id, string.id, "resp_nope"):
        for call in (client.responses.retrieve, client.responses.delete, client.responses.input_items.list,
                     client.responses.cancel):
            with pytest.raises(openai.NotFoundError) as e:
                call(gone)
            assert e.value.body["param"] == "response_id" and e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="x", previous_response_id=reply.id, **COMMON)


def test_a_finished_response_cannot_be_cancelled(server):
    client = server.client()
    reply = client.responses.create(input="Hi", **COMMON)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(reply.id)
    assert e.value.body["param"] == "response_id" and "in progress" in e.value.body["message"]
    assert client.responses.retrieve(reply.id) == reply


def test_the_endpoint_names_are_not_response_ids(server):
    for method in ("GET", "DELETE"):
        for name in ("compact", "input_tokens"):
            assert_error(httpx.request(method, f"{server.url}/v1/responses/{name}"), 405, code="method_not_allowed")
    for name in ("compact", "input_tokens"):  # POST /v1/responses/NAME reaches no handler of stored responses
        scope = {"type": "http", "method": "POST", "path": f"/v1/responses/{name}", "root_path": ""}
        full = [r.path for r in server.app.routes if r.matches(scope)[0] == Match.FULL]
        assert all(path == f"/v1/responses/{name}" for path in full), full


# ------------------------------------------------------------------ a restart


def test_the_store_survives_a_restart(demo_f32, tmp_path, caplog):
    directory = tmp_path / "responses"
    with serve(demo_f32, directory) as first_server:
        client = first_server.wait_ready().client()
        first = client.responses.create(input="Hello, who are you?", **COMMON)
        other = client.responses.create(input="Name a color.", **COMMON)
    (directory / f"{other.id}.json").write_bytes((directory / f"{other.id}.json").read_bytes()[:-3])

    with serve(demo_f32, directory) as again:
        client = again.wait_ready().client()
        assert client.responses.retrieve(first.id) == first
        assert [i.content[0].text for i in client.responses.input_items.list(first.id)] == ["Hello, who are you?"]
        second = client.responses.create(input="And what can you do?", previous_response_id=first.id, **COMMON)
        whole = client.responses.create(input=[{"role": "user", "content": "Hello, who are you?"}, *first.output,
                                               {"role": "user", "content": "And what can you do?"}], **COMMON)
        assert second.output_text == whole.output_text and second.usage.input_tokens == whole.usage.input_tokens
        with caplog.at_level(logging.WARNING, "monolith.serve"), pytest.raises(openai.NotFoundError):
            client.responses.retrieve(other.id)  # truncated: never served
        assert "truncated" in caplog.text
    assert not (directory / f"{other.id}.json").exists()


# ------------------------------------------------------------------ cancel


class UntilCancelled(Scripted):
    """A decoder that writes its tokens, then waits for the cancel that ends it (in
    rounds of 10 ms that write nothing)."""

    def __init__(self, tokens):
        super().__init__(tokens, per_token=0.01)

    def steps(self, generation):
        emitter = generation.emitter
        emitter.resumed(0)
        out = []
        for t in self.tokens:
            out.append(t)
            emitter.token(t, None)
        while not emitter.cancelled():
            yield self.round(out[-1])
        return Outcome(out, "abort", len(generation.prompt), 0, 0.0, 0.0, len(out))


@pytest.fixture(scope="module")
def hanging(demo_f32):
    model, _, tok = demo_f32
    with Server(lambda: Engine(model, tok, Limits(max_context=1024), decoder=UntilCancelled(tok.encode("Hello there"))),
                model_names=(NAME,)) as s:
        yield s.wait_ready()


def test_cancel_a_streamed_response(hanging):
    client = hanging.client()
    with client.responses.create(input="Hi", stream=True, **COMMON) as stream:
        events = iter(stream)
        created = next(events)
        while next(events).type != "response.output_text.delta":
            pass
        cancelled = client.responses.cancel(created.response.id)  # from another connection
        rest = list(events)
    assert isinstance(cancelled, Response) and cancelled.status == "cancelled"
    assert cancelled.output_text == "Hello there" and rest[-1].response == cancelled
    assert client.responses.retrieve(cancelled.id) == cancelled
    again = client.responses.cancel(cancelled.id)  # cancelled already: the same object
    assert again == cancelled


def test_cancel_responses_that_are_not_streamed_running_and_queued(hanging):
    client, state = hanging.client(), hanging.app.state.monolith
    replies = {}

    def create(name):
        replies[name] = client.responses.create(input="Hi", **COMMON)

    threads = []
    for name, count in (("running", 1), ("queued", 2)):  # the engine runs one request at a time
        threads.append(threading.Thread(target=create, args=(name,)))
        threads[-1].start()
        while len(state.responses.running) < count:  # their ids are known to the server only, until they end
            time.sleep(0.01)
    running_id, queued_id = state.responses.running
    assert client.responses.retrieve(queued_id).status == "in_progress"
    queued = client.responses.cancel(queued_id)
    running = client.responses.cancel(running_id)
    for thread in threads:
        thread.join(60)
    assert (queued.status, queued.output, replies["queued"]) == ("cancelled", [], queued)
    # the streamed test's cancel freed the engine's only slot: this one ran
    assert (running.status, running.output_text, replies["running"]) == ("cancelled", "Hello there", running)
    assert client.responses.retrieve(queued_id) == queued and not state.responses.running
