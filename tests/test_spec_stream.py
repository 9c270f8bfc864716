"""Speculation in the stream (`"monolith": {"spec": true}` on chat completions,
docs/serving.md): on a drafting server whose drafter is an oracle that proposes the
target's own greedy tokens with a wrong proposal at a known position, every token's kind
is known in advance (the oracle's plan; plain greedy decoding gives the tokens), and the
stats follow from the same plan. Without the field nothing changes; the official openai
SDK parses the extended chunks; a plain server marks every token plain."""

from __future__ import annotations

import json

import httpx
import pytest
from oracles import GreedyOracle, plain_greedy
from serving_rig import MAX_CONTEXT, NAME, TOOLS, Server

from monolith.runtime.decoder import Decoder
from monolith.runtime.engine import Drafting, Engine, Limits
from monolith.runtime.events import PLAIN, Delta, Finished, Usage
from monolith.runtime.generation import Emitter, Generation
from monolith.serving.openai.reply import ChatFormat
from monolith.tokenizer import IncrementalDetokenizer

MESSAGES = [{"role": "user", "content": "Hello there"}]
GAMMA, ERROR_AT, N = 4, 2, 18  # rounds accept 2 and correct the 3rd; the last one is short: a bonus
SPEC = {"monolith": {"spec": True}}


def plan(n: int) -> tuple[list[str], list[tuple[int, int]]]:
    """How each of n greedy tokens comes from the oracle's rounds (decoder.py's limits: a
    round's proposals leave room for the token after them), and each drafting round's
    (proposals, accepted)."""
    kinds, rounds = ["plain"], []  # the prefill's token
    while len(kinds) < n:
        g = min(GAMMA, n - len(kinds) - 1)
        a = min(g, ERROR_AT)
        if g == 0:
            kinds.append("plain")
            continue
        kinds += ["accepted"] * a + ["correction" if a < g else "bonus"]
        rounds.append((g, a))
    return kinds, rounds


def merged(pairs) -> list[tuple[str, str]]:
    out = []
    for text, how in pairs:
        if text and out and out[-1][1] == how:
            out[-1] = (out[-1][0] + text, how)
        elif text:
            out.append((text, how))
    return out


def token_texts(tok, ids) -> list[str]:
    """Each token's text as it completes (a character split over tokens goes with the
    token that completes it; what the end flushes goes with the last)."""
    detok = IncrementalDetokenizer(tok)
    texts = [detok.add(t) for t in ids]
    texts[-1] += detok.flush()
    return texts


def char_kinds(pieces) -> list[str]:
    return [how for text, how in pieces for _ in text]


@pytest.fixture(scope="module")
def reference(model, tok):
    prompt = tok.encode_chat(MESSAGES)
    return prompt, plain_greedy(model, prompt, N)


@pytest.fixture(scope="module")
def oracle_server(model, tok, reference):
    prompt, tokens = reference
    oracle = GreedyOracle(prompt, tokens, model.args.vocab_size, error_at=ERROR_AT)
    decoder = Decoder(model, oracle, MAX_CONTEXT, gamma=GAMMA)
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=decoder)) as s:
        yield s.wait_ready()


def stream(server, **body) -> list[dict]:
    """The chunks of a streamed chat request, as JSON."""
    payload = {"model": NAME, "messages": MESSAGES, "max_tokens": N, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=payload, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def pieces_of(chunks, part: str) -> list[tuple[str, str]]:
    """The (text, how) pieces of `part` across the stream, each chunk's checked against
    its delta's text."""
    key = "content" if part == "content" else "reasoning_content"
    out = []
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
        entries = (delta.get("monolith") or {}).get("spec", [])
        assert {e["part"] for e in entries} <= {"content", "reasoning"}
        mine = [(e["text"], e["how"]) for e in entries if e["part"] == part]
        assert "".join(t for t, _ in mine) == (delta.get(key) or "")
        assert all(t for t, _ in mine) and merged(mine) == mine  # neighbours of a kind are one piece
        out += mine
    return out


class Kinds(Emitter):
    """Every token with how it came."""

    def __init__(self):
        self.seen = []

    def token(self, token_id, logprob, kind=PLAIN):
        self.seen.append((token_id, kind))
        return True


def test_the_decoder_tells_each_token_s_kind_as_planned(model, reference):
    prompt, tokens = reference
    oracle = GreedyOracle(prompt, tokens, model.args.vocab_size, error_at=ERROR_AT)
    kinds = Kinds()
    Decoder(model, oracle, MAX_CONTEXT, gamma=GAMMA)(Generation(prompt, N, emitter=kinds))
    assert kinds.seen == list(zip(tokens, plan(N)[0]))


def test_each_token_is_marked_as_the_oracle_planned(oracle_server, tok, reference):
    _, tokens = reference
    chunks = stream(oracle_server, **SPEC, stream_options={"include_usage": True})
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == tok.decode(tokens)
    assert merged(pieces_of(chunks, "content")) == merged(zip(token_texts(tok, tokens), plan(N)[0]))
    assert pieces_of(chunks, "reasoning") == []
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and [c for c in chunks if "monolith" in c] == final
    rounds = plan(N)[1]
    accepted = sum(a for _, a in rounds)
    stats, usage = final[0]["monolith"]["stats"], chunks[-1]["usage"]
    assert (stats["rounds"], stats["draft_tokens"], stats["accepted_tokens"]) == (
        len(rounds), sum(g for g, _ in rounds), accepted)
    assert stats["accepted_per_position"] == [sum(a > j for _, a in rounds) for j in range(GAMMA)]
    assert stats["acceptance_length"] == pytest.approx((accepted + len(rounds)) / len(rounds))
    assert stats["decode_tok_s"] > 0 and stats["prefill_tok_s"] > 0
    assert (stats["prompt_tokens"], stats["cached_tokens"], stats["completion_tokens"]) == (
        usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"])


def test_a_stop_string_cuts_the_pieces_with_the_text(oracle_server, tok, reference):
    _, tokens = reference
    text = tok.decode(tokens)
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text)) if "\ufffd" not in text[i:i + 2])
    chunks = stream(oracle_server, **SPEC, stop=[stop])
    got = pieces_of(chunks, "content")
    assert "".join(t for t, _ in got) == text[:text.index(stop)]
    want = char_kinds(merged(zip(token_texts(tok, tokens), plan(N)[0])))
    assert char_kinds(got) == want[:len(text[:text.index(stop)])]


def normal(chunks, drop_spec=False) -> list[dict]:
    """Chunks without their id and time, consecutive content deltas folded (how the
    engine's deltas meet the event loop decides where one chunk ends)."""
    out = []
    for chunk in chunks:
        chunk = {k: v for k, v in chunk.items() if k not in ("id", "created") and not (drop_spec and k == "monolith")}
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else None
        if drop_spec and delta is not None:
            delta.pop("monolith", None)
        if out and delta is not None and set(delta) == {"content"} and out[-1]["choices"] \
                and set(out[-1]["choices"][0]["delta"]) == {"content"}:
            out[-1]["choices"][0]["delta"]["content"] += delta["content"]
        else:
            out.append(chunk)
    return out


def test_without_the_field_nothing_changes(oracle_server):
    plain, off = stream(oracle_server), stream(oracle_server, monolith={"spec": False})
    on = stream(oracle_server, **SPEC)
    assert "monolith" not in json.dumps(plain) + json.dumps(off)
    assert normal(plain) == normal(off) == normal(on, drop_spec=True)
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": N, "temperature": 0}
    replies = [oracle_server.post("/v1/chat/completions", {**body, **extra}).json()
               for extra in ({}, {"monolith": {"spec": False}}, SPEC)]
    for reply in replies:
        del reply["id"], reply["created"]
    stats = replies[2].pop("monolith")["stats"]
    assert replies[0] == replies[1] == replies[2]
    assert stats["completion_tokens"] == replies[0]["usage"]["completion_tokens"] and stats["rounds"] > 0


def test_the_openai_sdk_reads_the_extended_chunks(oracle_server, tok, reference):
    client = oracle_server.client()
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=N, temperature=0,
                                                 stream=True, extra_body=SPEC))
    entries = [e for c in chunks for e in (c.choices[0].delta.model_extra.get("monolith") or {}).get("spec", [])]
    assert "".join(e["text"] for e in entries) == tok.decode(reference[1])
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].model_extra["monolith"]["stats"]["rounds"]


def test_a_plain_server_marks_every_token_plain(server, model, tok):
    chunks = stream(server, **SPEC)
    got = pieces_of(chunks, "content")
    assert got and {how for _, how in got} == {"plain"}
    stats = [c["monolith"]["stats"] for c in chunks if "monolith" in c]
    assert stats[0]["rounds"] == stats[0]["draft_tokens"] == 0 and stats[0]["accepted_per_position"] == []


@pytest.mark.parametrize("value, param", [(1, "monolith"), ([], "monolith"), ({"spec": "yes"}, "monolith.spec"),
                                          ({"spec": True, "colour": 1}, "monolith.colour")])
def test_bad_values_are_refused_naming_the_field(server, value, param):
    r = server.post("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "monolith": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_reasoning_and_tool_calls_split_the_pieces_with_the_text(tok):
    """Deltas with known kinds through the reasoning split and the tool-call parser: the
    pieces of each part equal its text, and each character keeps the kind it came with
    (the visible texts are unique in the input, so where each came from is known)."""
    tokens = [("<th", "plain"), ("ink>\nrea", "accepted"), ("son</th", "correction"), ("ink>\n\ncon", "bonus"),
              ("tent <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n", "accepted"),
              ("</function>\n</tool_call>", "plain"), (" after", "accepted")]
    fmt = ChatFormat(NAME, None, False, TOOLS, spec=True)
    chunks = []
    for i in range(0, len(tokens), 2):  # two tokens a delta
        pairs = tokens[i:i + 2]
        chunks += fmt.stream_delta(Delta("".join(t for t, _ in pairs), spec=tuple(pairs)), False)
    chunks += fmt.stream_finish(Finished("stop", Usage(3, len(tokens), 0), ()), False)
    text, kinds = "".join(t for t, _ in tokens), char_kinds(tokens)

    def kinds_of(*visible):
        return [k for v in visible for k in kinds[text.index(v):text.index(v) + len(v)]]

    for part, visible in (("reasoning", ["reason"]), ("content", ["content ", " after"])):
        got = pieces_of(chunks, part)
        assert "".join(t for t, _ in got) == "".join(visible) and char_kinds(got) == kinds_of(*visible)
    calls = [c for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    assert calls and all("monolith" not in c["choices"][0]["delta"] for c in calls)  # a call's pieces: none


# ------------------------------------------------------------------ drafting on request (monolith.draft)


@pytest.fixture(scope="module")
def plain_server_with_a_drafter(model, tok, reference):
    """A server that decodes plainly but holds a drafter for requests that ask (what serve
    builds where no drafter pays: engine_setup, drafter_choice.on_request)."""
    prompt, tokens = reference
    oracle = GreedyOracle(prompt, tokens, model.args.vocab_size, error_at=ERROR_AT)
    spare = Decoder(model, oracle, MAX_CONTEXT, gamma=GAMMA)
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT),
                               drafting=Drafting(on_request=spare, on_request_name="oracle"))) as s:
        yield s.wait_ready()


def test_a_request_that_asks_to_draft_is_drafted_with_the_same_greedy_output(plain_server_with_a_drafter, tok,
                                                                             reference):
    server = plain_server_with_a_drafter
    [entry] = httpx.get(server.url + "/v1/models").json()["data"]
    assert entry["monolith"] == {"decoding": "plain", "draft": "oracle", "draft_on_request": True}
    plain = stream(server, **SPEC)
    assert {how for _, how in pieces_of(plain, "content")} == {"plain"}
    for _ in range(2):  # and again, after the plain request's saved states
        drafted = stream(server, monolith={"spec": True, "draft": True})
        assert "".join(t for t, _ in pieces_of(drafted, "content")) == tok.decode(reference[1])
        assert {"accepted", "correction"} <= {how for _, how in pieces_of(drafted, "content")}
        assert [c["monolith"]["stats"]["rounds"] for c in drafted if "monolith" in c][0] > 0
    assert normal(plain, drop_spec=True) == normal(drafted, drop_spec=True)
    assert "".join(t for t, _ in pieces_of(stream(server, **SPEC), "content")) == tok.decode(reference[1])


def test_a_server_without_a_drafter_refuses_draft_naming_the_field(server):
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["monolith"]["draft_on_request"] is False
    r = server.post("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "monolith": {"draft": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "monolith.draft"
    assert "no drafter" in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "monolith": {"draft": "yes"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "monolith.draft"
