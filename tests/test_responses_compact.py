"""POST /v1/responses/compact through the official openai SDK: the compaction object
validates against the Open Responses schema; its window is the user's messages and one
sealed summary; a conversation continued from the window gets the answer the chat
endpoint gives for the same messages with the summary in plain text (greedy); a tampered
or foreign compaction item is a 400 naming it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openresponses_spec import check
from serving_rig import assert_error, demo_servers

from monolith.serving.responses.seal import SEALER, SUMMARY_HEAD, open_summary

NAME = "demo"
TURNS = [{"role": "user", "content": "My name is Ada and I like red."},
         {"role": "assistant", "content": "Noted, Ada."},
         {"role": "user", "content": "I also like green."}]


@pytest.fixture(scope="module")
def server(demo_f32):
    with demo_servers(demo_f32, NAME, 4096) as running:
        yield running["plain"]


def test_compaction_continues_like_the_chat_endpoint(server):
    client = server.client()
    raw = client.responses.with_raw_response.compact(model=NAME, input=TURNS, instructions="Be terse.")
    compacted, body = raw.parse(), json.loads(raw.text)  # the SDK's reading and the wire's
    check("CompactResource", body)
    assert [i.type for i in compacted.output] == [i["type"] for i in body["output"]]
    assert compacted.object == "response.compaction" and compacted.usage.output_tokens > 0
    *users, item = body["output"]
    assert [u["content"][0]["text"] for u in users] == [t["content"] for t in TURNS if t["role"] == "user"]
    assert item["type"] == "compaction" and item["encrypted_content"]
    summary = open_summary(item["encrypted_content"], "x")
    assert summary and "Summarize" not in item["encrypted_content"]

    window = body["output"] + [{"type": "message", "role": "user", "content": "What colors do I like?"}]
    reply = client.responses.create(model=NAME, input=window, instructions="Be terse.", max_output_tokens=24,
                                    temperature=0)
    messages = [{"role": "system", "content": "Be terse."}] + [
        {"role": "user", "content": u["content"][0]["text"]} for u in users] + [
        {"role": "user", "content": SUMMARY_HEAD + summary}, {"role": "user", "content": "What colors do I like?"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens

    again = client.responses.compact(model=NAME, input=window)  # the old summary is not kept as a user message
    texts = [i.content[0].text for i in again.output if i.type == "message"]
    assert texts == [t["content"] for t in TURNS if t["role"] == "user"] + ["What colors do I like?"]


def test_compaction_from_a_stored_response(server):
    client = server.client()
    first = client.responses.create(model=NAME, input="Remember the number 7.", max_output_tokens=16)
    compacted = client.responses.compact(model=NAME, previous_response_id=first.id, input="And 9.")
    texts = [i.content[0].text for i in compacted.output if i.type == "message"]
    assert texts == ["Remember the number 7.", "And 9."] and compacted.output[-1].type == "compaction"


def test_a_compaction_item_this_server_did_not_seal_is_refused(server):
    client = server.client()
    compacted = client.responses.compact(model=NAME, input=TURNS[:1])
    item = {"type": "compaction", "id": compacted.output[-1].id,
            "encrypted_content": compacted.output[-1].encrypted_content}
    token = item["encrypted_content"]
    for blob in (token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB"),  # altered
                 SEALER.seal("a reasoning text, not a compaction")):  # sealed here, but no compaction
        window = [{**item, "encrypted_content": blob}, {"type": "message", "role": "user", "content": "Go on."}]
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=NAME, input=window, max_output_tokens=4)
        assert e.value.body["param"] == "input[0].encrypted_content", e.value.body
    assert_error(httpx.post(server.url + "/v1/responses/compact", json={"model": NAME, "input": "x", "tools": []}),
                 400, param="tools")
