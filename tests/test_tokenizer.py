"""The tokenizer (monolith.tokenizer): ids and special tokens, chat templates rendered as
transformers renders them (sources, globals, the jinja2 sandbox), missing or corrupt
files, and incremental detokenization."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from monolith.tokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    TokenizerError,
    load_tokenizer,
)

EOS = 402  # <|im_end|> in the synthetic tokenizer; generation_config adds 400 (<|endoftext|>)
VOCAB = 512  # the tiny synthetic target's vocab_size (the tokenizer has 410 tokens)


@pytest.fixture(scope="module")
def pack_dir(tiny_pack):
    return tiny_pack


@pytest.fixture(scope="module")
def tok(pack_dir):
    return load_tokenizer(pack_dir)


# ------------------------------------------------------------------ tokenizer


def test_tokenizer_ids_and_special_tokens(tok):
    assert tok.eos_token_ids == (402, 400)  # generation_config first, then config / tokenizer_config
    assert tok.special_tokens["eos_token"] == "<|im_end|>" and tok.special_tokens["bos_token"] is None
    text = "def f(x):\n    return x  # naïve 日本語 🙂"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>hi") [0] == tok.token_to_id("<|im_start|>") == 401
    assert tok.decode([401, *tok.encode("hi"), 402]) == "hi"
    assert tok.decode([401, *tok.encode("hi")], skip_special_tokens=False) == "<|im_start|>hi"
    assert tok.decode([450, *tok.encode("a"), 511]) == "a"  # ids past the tokenizer (vocab padding)


def test_chat_template_matches_transformers(tok, pack_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(pack_dir))
    function = {"name": "get", "description": "é — ü", "parameters": {"type": "object"}}
    tools = [{"type": "function", "function": function}]
    conversations = [
        [{"role": "user", "content": "Hello there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": [{"type": "text", "text": "and 3+3?"}]}],
        [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": "",
          "tool_calls": [{"function": {"name": "get", "arguments": {"city": "Zürich"}}}]},
         {"role": "tool", "content": "sunny"}],
    ]
    for messages in conversations:
        for kwargs in ({}, {"tools": tools}, {"enable_thinking": False}):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            assert tok.apply_chat_template(messages, **kwargs) == want
            assert tok.encode_chat(messages, **kwargs) == hf.encode(want, add_special_tokens=False)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def write_tokenizer_dir(tmp_path, pack_dir, template=None, template_file=None, **config_updates) -> Path:
    d = tmp_path / "tok"
    d.mkdir(parents=True)
    shutil.copy(Path(pack_dir) / "tokenizer.json", d)
    config = json.loads((Path(pack_dir) / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    config.update(config_updates)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (d / "chat_template.jinja").write_text(template_file)
    return d


def test_chat_template_sources(tmp_path, pack_dir):
    msgs = [{"role": "user", "content": "x"}]
    both = load_tokenizer(write_tokenizer_dir(tmp_path / "a", pack_dir, "config", "file"))
    assert both.apply_chat_template(msgs) == "file"  # chat_template.jinja wins, as in transformers
    templates = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    named = load_tokenizer(write_tokenizer_dir(tmp_path / "b", pack_dir, templates))
    assert named.apply_chat_template(msgs) == "d"
    none = load_tokenizer(write_tokenizer_dir(tmp_path / "c", pack_dir))
    assert none.eos_token_ids == (402,)  # no generation_config / config.json here
    with pytest.raises(TokenizerError, match="no chat template"):
        none.apply_chat_template(msgs)


def test_chat_template_globals_and_sandbox(tmp_path, pack_dir):
    template = (
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('role bad is not allowed') }}{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson }}|{% endfor %}"
        "{{ eos_token }}{{ strftime_now('%Y') | length }}{{ add_generation_prompt }}{{ extra }}"
    )
    tok = load_tokenizer(write_tokenizer_dir(tmp_path, pack_dir, template))
    msgs = [{"role": "user", "content": "ü"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}]
    assert tok.apply_chat_template(msgs, extra=7) == (
        '{"role": "user", "content": "ü"}|{"role": "user", "content": "b"}|<|im_end|>4True7'
    )
    with pytest.raises(TokenizerError, match="role bad is not allowed"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])
    for escape in ("{{ messages.append(1) }}", "{{ ''.__class__.__mro__[1].__subclasses__() }}"):
        unsafe = load_tokenizer(write_tokenizer_dir(tmp_path / str(len(escape)), pack_dir, escape))
        with pytest.raises(TokenizerError, match="chat template"):
            unsafe.apply_chat_template(msgs)
    broken = load_tokenizer(write_tokenizer_dir(tmp_path / "broken", pack_dir, "{% if %}"))
    with pytest.raises(TokenizerError, match="does not parse"):
        broken.apply_chat_template(msgs)


def test_missing_or_corrupt_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_synth_tokenizer_keeps_text_tags_in_decoded_text(tok):
    """Bug report for monolith.synth (not this module): its tokenizer_config.json marks
    <think>, <tool_call>... non-special (as Qwen does), but tokenizer.json marks them
    special because `Tokenizer.add_special_tokens` forces special=True on every
    AddedToken. Decoding with skip_special_tokens (the default everywhere) then drops
    the reasoning and tool-call tags from generated text. Fix: add the text tags with
    `add_tokens` instead."""
    think = tok.token_to_id("<think>")
    assert tok.decode([think, *tok.encode("hm")]) == "<think>hm"


# ------------------------------------------------------------------ incremental detokenization


def stream(tok, ids, **kw):
    detok = IncrementalDetokenizer(tok, **kw)
    pieces = [detok.add(t) for t in ids]
    return pieces, detok.flush()


def test_detokenizer_releases_only_complete_characters(tok):
    text = "naïve → 日本語 🙂 ok"
    ids = tok.encode(text)
    assert len(ids) > len(text.encode()) // 2  # the multi-byte characters are split over byte tokens
    pieces, rest = stream(tok, ids)
    assert "".join(pieces) + rest == text and rest == ""
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    held = 0
    for n in range(1, len(ids) + 1):  # every character comes out with the token that completes it
        prefix = tok.decode(ids[:n])
        if prefix.endswith(REPLACEMENT_CHAR):
            held += 1
        else:
            assert "".join(pieces[:n]) == prefix
    assert held >= 5  # the test text does split characters across tokens


def test_detokenizer_special_tokens_and_flush(tok):
    ids = [401, *tok.encode("ab"), 402, *tok.encode(" c")]
    pieces, rest = stream(tok, ids)
    assert "".join(pieces) + rest == "ab c"
    pieces, rest = stream(tok, ids, skip_special_tokens=False)
    assert "".join(pieces) + rest == "<|im_start|>ab<|im_end|> c"
    partial = tok.encode("日")[:-1]  # an incomplete character is held back until flush
    pieces, rest = stream(tok, tok.encode("x") + partial)
    assert "".join(pieces) == "x" and rest.startswith(REPLACEMENT_CHAR)


# ------------------------------------------------------------------ prompts resent turn after turn


def conversation_prompts(tok) -> list[str]:
    """What an agent sends turn after turn: a growing history (tool results, unicode and
    added-token strings in the text), one turn edited in the middle, one cut mid-token."""
    system = "You are a coding agent. Tools: read_file, search. Prefer small edits; naïve → 日本語 🙂 "
    messages = [{"role": "system", "content": system * 20}, {"role": "user", "content": "Fix test_refunds."}]
    prompts = []
    for turn in range(6):
        prompts.append(tok.apply_chat_template(messages, add_generation_prompt=True))
        messages.append({"role": "assistant", "content": f"<tool_call>read_file services/{turn}.py</tool_call>"})
        messages.append({"role": "user", "content": f"def f{turn}(x):\n    return x  # <|im_start|> in text é\n" * 9})
    messages[3]["content"] = "[cleared]"  # an agent's context edit: an old tool result replaced
    prompts.append(tok.apply_chat_template(messages, add_generation_prompt=True))
    prompts.append(prompts[-1][:-40] + "日本語🙂 and more")  # shares a prefix that ends inside a token
    prompts.append(prompts[2])  # an older prompt again
    return prompts


@pytest.mark.parametrize("which", ["synthetic", "demo"])
def test_prompts_encoded_from_recent_prompts_equal_whole_encodings(tok, which, monkeypatch):
    """encode_prompt starts from the ids of a recent prompt sharing a prefix: every
    prompt's ids equal the tokenizers library's own encoding of the whole text."""
    from tokenizers import Tokenizer as Library

    if which == "demo":
        from monolith.pack.demo import bundle_dir

        tok = load_tokenizer(bundle_dir() / "target")
    library = Library.from_file(str(tok.path / "tokenizer.json"))
    encoded = []  # the lengths of the texts the library is asked to encode

    class Recording:
        def __getattr__(self, name):
            return getattr(library, name)

        def encode(self, text, **kw):
            encoded.append(len(text))
            return library.encode(text, **kw)

    monkeypatch.setattr(tok, "_tok", Recording())
    prompts = conversation_prompts(tok)
    for text in prompts:
        assert tok.encode_prompt(text) == library.encode(text, add_special_tokens=False).ids
    later = zip(prompts[1:6], encoded[1:6])
    assert encoded[0] == len(prompts[0]) and all(n < len(text) / 4 for text, n in later)  # the new turn alone
    assert encoded[-1] < len(prompts[-1]) / 4  # an older prompt again
