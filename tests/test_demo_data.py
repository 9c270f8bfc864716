"""The demo pair's chat transcripts (packs/demo/assistant_data.py, tools_data.py): they
render through the pair's own chat template as Hugging Face's renderer renders it, every
assistant turn ends with the template's end-of-turn token, reasoning blocks are short and
closed, the tool calls in them are what the server's own parser reads as whole calls whose
arguments the tool's schema accepts (jsonschema), and no held-out function reaches the
training transcripts."""

from __future__ import annotations

import json

import jsonschema
import pytest
from demo_stages import DEMO, import_stage

from monolith.serving.reasoning import ReasoningSplitter
from monolith.serving.tools.calls import parse_tool_calls
from monolith.tokenizer import load_tokenizer

END = "<|im_end|>"


@pytest.fixture(scope="module")
def data():
    return import_stage("assistant_data")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO / "target")


@pytest.fixture(scope="module")
def transcripts(data):
    return data.build(seed=0, count=300) + data.build(seed=0, held=True, count=100)


def rendered(data, tokenizer, t) -> str:
    prompt, reply = data.render(tokenizer, t)
    return prompt + reply


def assistant_turns(text: str) -> list[str]:
    """The text of each assistant turn of a rendered transcript, its end token included."""
    return [part.removeprefix("assistant\n") for part in text.split("<|im_start|>")[1:]
            if part.startswith("assistant\n")]


def server_reads(turn: str, tools) -> tuple[str | None, list]:
    """(content, calls) of an assistant turn as the server reads a reply: reasoning split
    off first (a block the reply opens itself), calls parsed from the rest."""
    splitter = ReasoningSplitter()
    _, content = splitter.feed(turn.removesuffix(END + "\n"))
    return parse_tool_calls(content + splitter.finish()[1], tools)


def test_the_transcripts_render_as_hugging_face_renders_the_template(data, tokenizer, transcripts):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(DEMO / "target")
    assert {t["kind"] for t in transcripts} == {"stdlib", "source", "smalltalk", "tool_call", "tool_answer", "no_tool"}
    for t in transcripts[::8]:
        prompt, reply = data.render(tokenizer, t)
        want = reference.apply_chat_template(t["messages"][:-1], tools=t["tools"], tokenize=False,
                                             add_generation_prompt=True, **t["kwargs"])
        whole = reference.apply_chat_template(t["messages"], tools=t["tools"], tokenize=False)
        assert prompt == want
        if not t["kwargs"]:
            assert prompt + reply == whole


def test_every_assistant_turn_ends_with_the_end_of_turn_token(data, tokenizer, transcripts):
    end_id = tokenizer.token_to_id(END)
    assert end_id in tokenizer.eos_token_ids
    for t in transcripts:
        text = rendered(data, tokenizer, t)
        turns = assistant_turns(text)
        assert len(turns) == sum(m["role"] == "assistant" for m in t["messages"])
        assert all(turn.endswith(END + "\n") and turn.count(END) == 1 for turn in turns), turns
        _, reply = data.render(tokenizer, t)
        ids = tokenizer.encode(reply, add_special_tokens=False)
        assert ids.count(end_id) == 1 and tokenizer.decode(ids[ids.index(end_id) + 1:]) == "\n"


def test_reasoning_is_short_and_closed(data, tokenizer, transcripts):
    thinking = [t for t in transcripts if t["messages"][-1].get("reasoning_content")]
    off = [t for t in transcripts if t["kwargs"].get("enable_thinking") is False]
    assert len(thinking) > len(transcripts) // 20 and len(off) > len(transcripts) // 10
    for t in thinking:
        _, reply = data.render(tokenizer, t)
        assert reply.startswith("<think>\n") and reply.count("</think>") == 1
        inside = reply[len("<think>\n"):reply.index("</think>")]
        assert len(tokenizer.encode(inside, add_special_tokens=False)) < 64
    for t in off:
        prompt, _ = data.render(tokenizer, t)
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_tool_calls_parse_into_arguments_the_tool_schema_accepts(data, tokenizer, transcripts):
    seen = set()
    for t in transcripts:
        text = rendered(data, tokenizer, t)
        for turn in assistant_turns(text):
            content, calls = server_reads(turn, t["tools"])
            if t["kind"] in ("stdlib", "no_tool", "smalltalk", "source"):
                assert not calls and "<tool_call>" not in turn
                continue
            for call in calls:
                assert call.whole and content is None
                schema = next(x["function"]["parameters"] for x in t["tools"] if x["function"]["name"] == call.name)
                jsonschema.validate(json.loads(call.arguments), schema, cls=jsonschema.Draft202012Validator)
                seen.add(call.name)
        if t["kind"] in ("tool_call", "tool_answer"):
            replies = [m for m in t["messages"] if m["role"] == "assistant"]
            turn = next(i for i, m in enumerate(replies) if m.get("tool_calls"))
            expected = replies[turn]["tool_calls"][0]["function"]
            _, calls = server_reads(assistant_turns(text)[turn], t["tools"])
            assert [(c.name, json.loads(c.arguments)) for c in calls] == [(expected["name"], expected["arguments"])]
    assert len(seen) >= 12  # many names: the call is read off the tools block


def test_no_held_out_function_reaches_the_training_transcripts(data):
    train, held = data.functions()
    assert held and not {f.qualname for f in held} & {f.qualname for f in train}
    built = data.build(seed=0, count=1500)
    text = "\n".join(json.dumps([t["messages"], t["tools"]]) for t in built)
    asked = "\n".join(json.dumps([t["messages"], t["tools"]]) for t in built if t["kind"] != "source")
    leaked = [f.qualname for f in held if f.qualname in asked or f.sentence in text]  # (code may mention a name)
    assert leaked == []
    held_text = "\n".join(json.dumps(t["messages"]) for t in data.build(seed=0, held=True, count=200))
    assert sum(f.qualname in held_text for f in held) > len(held) // 2  # the held-out ones are what it asks about


def test_the_transcripts_are_the_same_for_a_seed(data):
    assert data.build(seed=3, count=50) == data.build(seed=3, count=50)
    assert data.build(seed=3, count=50) != data.build(seed=4, count=50)


def test_agent_shaped_transcripts_are_there_and_fit_a_training_row(data, tokenizer, transcripts):
    """Coding agents' shapes: long system messages of rules, an earlier exchange before
    the request, files described rather than named, a read served by a shell's `cat`; and
    a transcript, from its start, fits one chat row of training (train.CHAT_LEN) nearly
    always."""
    chat_len = import_stage("train").CHAT_LEN
    train = [t for t in transcripts if t["kind"] != "source"][:300]
    agent = [t for t in train if t["messages"][0]["role"] == "system" and len(t["messages"][0]["content"]) > 400]
    after = [t for t in train if t["start"] > (t["messages"][0]["role"] == "system")]
    assert len(agent) > len(train) // 20 and len(after) > len(train) // 5
    assert all(t["messages"][t["start"]]["role"] == "user" for t in transcripts)
    calls = [m["tool_calls"][0]["function"] for t in transcripts for m in t["messages"] if m.get("tool_calls")]
    assert any(str(next(iter(c["arguments"].values()))).startswith("cat ") for c in calls)
    requests = [t["messages"][t["start"]]["content"] for t in transcripts if t["kind"].startswith("tool")]
    assert any(r.startswith(("Read the ", "Check the ", "Please open the ")) for r in requests)
    lengths = [len(tokenizer.encode(rendered(data, tokenizer, t), add_special_tokens=False)) for t in train]
    assert sum(n > chat_len for n in lengths) <= len(lengths) // 100, max(lengths)


def test_files_described_in_held_out_requests_are_never_described_in_training(data):
    """The adjectives of described files ("the secret note") are split like the functions:
    a held-out one never reaches a training request (the agent-client tests' task asks
    for "the secret note", a held-out adjective)."""
    tools = import_stage("tools_data")
    held = tools.held_part(tools.FILE_ADJECTIVES, True)
    assert "secret" in held
    requests = " ".join(m["content"] for t in data.build(seed=0, count=1500) for m in t["messages"]
                        if m["role"] == "user")
    assert not [a for a in held if f"the {a} " in requests]
