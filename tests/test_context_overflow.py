"""A prompt longer than the context is refused in each API's own words, through the
official SDKs: Anthropic's `prompt is too long: N tokens > M maximum` on /v1/messages
(Claude Code compacts only when its regex finds both numbers there), OpenAI's
"This model's maximum context length is M tokens..." with code context_length_exceeded
on chat and completions, and the Responses API's "Your input exceeds the context window
of this model..." with that code and param input. N is the prompt's real token count,
M the real limit. Before tokenizing, a prompt whose byte length alone proves it cannot
fit is refused with the same words and the lower bound ("at least N")."""

from __future__ import annotations

import re

import anthropic
import openai
import pytest
from serving_rig import NAME, Server

from monolith.runtime.engine import Engine, Limits

CONTEXT = 64
TEXT = "hello there, how are you today? " * 12  # more than CONTEXT tokens, far fewer than the bound
CLAUDE_CODE = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", re.I)  # its token-gap parser
ANTHROPIC = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")
OPENAI_CHAT = re.compile(r"This model's maximum context length is (\d+) tokens\. However, your messages resulted in "
                         r"(\d+) tokens\. Please reduce the length of the messages\.")
RESPONSES = "Your input exceeds the context window of this model. Please adjust your input and try again."


@pytest.fixture(scope="module")
def server(model, tok):
    with Server(lambda: Engine(model, tok, Limits(max_context=CONTEXT))) as s:
        yield s.wait_ready()


def messages_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)


def prompt_tokens(tok, text: str) -> int:
    """What the chat template makes of one user message: the prompt's real length."""
    return len(tok.encode_chat([{"role": "user", "content": text}]))


def long_in_bytes(tok) -> str:
    """A text whose byte length alone shows it cannot fit CONTEXT tokens."""
    return "x" * (tok.max_token_bytes * CONTEXT * 2)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_overflow_reads_as_anthropics_and_claude_codes_parser_finds_both_numbers(server, tok, stream):
    n = prompt_tokens(tok, TEXT)
    assert n > CONTEXT
    with pytest.raises(anthropic.BadRequestError) as e:
        messages_client(server).messages.create(model=NAME, max_tokens=8, stream=stream,
                                                messages=[{"role": "user", "content": TEXT}])
    assert e.value.status_code == 400
    error = e.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert ANTHROPIC.fullmatch(error["message"]), error
    found = CLAUDE_CODE.search(str(e.value))  # Claude Code reads the SDK error's text
    assert found and "prompt is too long" in str(e.value).lower()
    assert (int(found[1]), int(found[2])) == (n, CONTEXT - 1)  # the most prompt tokens that leave one to generate


def test_messages_and_count_tokens_refuse_a_prompt_long_in_bytes_with_the_lower_bound(server, tok):
    text = long_in_bytes(tok)
    client = messages_client(server)
    for call in (lambda: client.messages.create(model=NAME, max_tokens=8, messages=[{"role": "user",
                                                                                       "content": text}]),
                 lambda: client.messages.count_tokens(model=NAME, messages=[{"role": "user", "content": text}])):
        with pytest.raises(anthropic.BadRequestError) as e:
            call()
        message = e.value.body["error"]["message"]
        found = re.fullmatch(r"prompt is too long: at least (\d+) tokens > (\d+) maximum", message)
        assert found, message
        assert CONTEXT <= int(found[1]) <= len(tok.encode(text, add_special_tokens=False))
        assert int(found[2]) == CONTEXT - 1
        assert CLAUDE_CODE.search(str(e.value))


def test_chat_overflow_reads_as_openais(server, tok):
    n = prompt_tokens(tok, TEXT)
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=NAME, max_tokens=8, messages=[{"role": "user",
                                                                                     "content": TEXT}])
    assert (e.value.code, e.value.param, e.value.body["type"]) == ("context_length_exceeded", "messages",
                                                                    "invalid_request_error")
    found = OPENAI_CHAT.fullmatch(e.value.body["message"])
    assert found, e.value.body
    assert (int(found[1]), int(found[2])) == (CONTEXT, n)


def test_chat_refuses_a_prompt_long_in_bytes_with_the_lower_bound(server, tok):
    text = long_in_bytes(tok)
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=NAME, max_tokens=8, messages=[{"role": "user",
                                                                                     "content": text}])
    assert e.value.code == "context_length_exceeded"
    found = re.fullmatch(r"This model's maximum context length is (\d+) tokens\. However, your messages resulted in "
                         r"at least (\d+) tokens\. Please reduce the length of the messages\.", e.value.body["message"])
    assert found and int(found[1]) == CONTEXT and CONTEXT <= int(found[2]) <= len(tok.encode(text)), e.value.body


@pytest.mark.parametrize("n", [CONTEXT, 100])
def test_completions_overflow_reads_as_openais_with_the_one_token_the_completion_needs(server, n):
    """A prompt of exactly the context leaves no room for the one generated token: OpenAI's
    completions wording counts the prompt and that token."""
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=NAME, max_tokens=8, prompt=list(range(5, 5 + n)))
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "prompt")
    assert e.value.body["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens, however you requested {n + 1} tokens "
        f"({n} in your prompt; 1 for the completion). Please reduce your prompt; or completion length.")


def test_chat_of_exactly_the_context_counts_the_one_token_to_generate(model, tok):
    """The messages alone fit; with the one token to generate they do not (OpenAI's words
    for a request of the messages plus a completion)."""
    n = prompt_tokens(tok, TEXT)
    with Server(lambda: Engine(model, tok, Limits(max_context=n))) as s:
        s.wait_ready()
        with pytest.raises(openai.BadRequestError) as e:
            s.client().chat.completions.create(model=NAME, max_tokens=8, messages=[{"role": "user",
                                                                                    "content": TEXT}])
    assert e.value.code == "context_length_exceeded"
    assert e.value.body["message"] == (
        f"This model's maximum context length is {n} tokens. However, you requested {n + 1} tokens ({n} in the "
        "messages, 1 in the completion). Please reduce the length of the messages or completion.")


@pytest.mark.parametrize("stream", [False, True])
def test_responses_overflow_reads_as_the_responses_apis(server, tok, stream):
    n = prompt_tokens(tok, TEXT)
    with pytest.raises(openai.BadRequestError) as e:
        server.client().responses.create(model=NAME, input=TEXT, max_output_tokens=16, stream=stream)
    assert (e.value.code, e.value.param, e.value.body["type"]) == ("context_length_exceeded", "input",
                                                                    "invalid_request_error")
    message = e.value.body["message"]
    assert message.startswith(RESPONSES), message
    assert message[len(RESPONSES):] == f" The input is {n} tokens; this model's context window is {CONTEXT} tokens."
