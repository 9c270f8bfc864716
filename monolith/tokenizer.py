"""The tokenizer of a pack or checkpoint directory, with the `tokenizers` library.

`load_tokenizer(dir)` reads tokenizer.json (the vocabulary and the encoding
pipeline), tokenizer_config.json (special tokens, chat template), and, when present,
chat_template.jinja (which wins over the config's template, as in `transformers`),
generation_config.json and config.json (end-of-sequence ids).

Chat templates render in jinja2's immutable sandbox with the globals Hugging Face
templates use (`raise_exception`, `strftime_now`, the `tojson` filter, loop controls),
so a checkpoint's template cannot touch anything outside the values passed in.
"""

from __future__ import annotations

import json
import threading
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path

REPLACEMENT_CHAR = "\ufffd"  # what decoding shows for an incomplete UTF-8 sequence
RECENT_PROMPTS = 16  # prompt texts (an image cuts a prompt in several) whose ids encode_prompt keeps to start later prompts from


class TokenizerError(ValueError):
    """A tokenizer or chat template is missing or unusable; the message names the file."""


class Tokenizer:
    def __init__(self, path):
        from tokenizers import Tokenizer as _Tokenizer

        self.path = Path(path)
        file = self.path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{self.path}: no tokenizer.json")
        try:
            self._tok = _Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions for bad files
            raise TokenizerError(f"{file}: cannot load: {e}") from None
        self.config = _read_json(self.path / "tokenizer_config.json")
        self.special_tokens = {
            name: _token_text(self.config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.eos_token_ids = self._eos_ids()
        self.chat_template = self._chat_template()
        self._recent: list[_Encoded] = []  # newest last
        self._recent_lock = threading.Lock()

    # ------------------------------------------------------------------ ids <-> text

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """`encode(text, add_special_tokens=False)`, starting from a recent prompt's ids.
        Agents resend the whole conversation every turn; the tokenizers library cuts the
        text at each added token (such as <|im_start|>) and encodes the pieces apart, so
        the ids up to the last added token that `text` shares with a recent prompt are
        that prompt's, and only the text from there is encoded again."""
        with self._recent_lock:
            shared, best = max(((_common_prefix(e.text, text), e) for e in self._recent), key=lambda p: p[0],
                               default=(0, None))
        kept = 0 if best is None else bisect_right(best.cuts, shared - self._longest_cut)
        start = best.cuts[kept - 1] if kept else 0
        encoding = self._tok.encode(text[start:], add_special_tokens=False)
        first = best.at[kept - 1] if kept else 0
        entry = _Encoded(text, (best.ids[:first] if kept else []) + encoding.ids,
                         (best.cuts[:kept - 1] if kept else []), (best.at[:kept - 1] if kept else []))
        for i, (token, (begin, _)) in enumerate(zip(encoding.ids, encoding.offsets)):
            if token in self._cut_ids:
                entry.cuts.append(start + begin)
                entry.at.append(first + i)
        replaced = best if best is not None and shared == len(best.text) else None  # text extends it
        with self._recent_lock:
            self._recent = [e for e in self._recent if e is not replaced][-(RECENT_PROMPTS - 1):] + [entry]
        return list(entry.ids)

    @cached_property
    def _cut_ids(self) -> frozenset[int]:
        """Added tokens the library cuts text at with nothing around them changed (none
        where a text's first piece is encoded unlike the others: a Metaspace prefix)."""
        if '"prepend_scheme":"first"' in self._tok.to_str().replace(" ", ""):
            return frozenset()
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items()
                         if not (t.lstrip or t.rstrip or t.single_word or t.normalized))

    @cached_property
    def _longest_cut(self) -> int:
        """Characters a cut needs shared past its start (no longer added token can match there)."""
        return max((len(t.content) for t in self._tok.get_added_tokens_decoder().values()), default=0)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids the tokenizer does not know (vocabulary padding) decode to ''."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: list[dict], tools: list | None = None,
                            add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The prompt text for `messages` (OpenAI-style dicts); extra keyword arguments
        (e.g. enable_thinking=False) are visible to the template."""
        import jinja2

        if self.chat_template is None:
            raise TokenizerError(f"{self.path}: no chat template (tokenizer_config.json or chat_template.jinja)")
        values = {name: text for name, text in self.special_tokens.items() if text is not None}
        values.update(messages=messages, add_generation_prompt=add_generation_prompt)
        if tools is not None:
            values["tools"] = tools
        clash = sorted(set(template_kwargs) & set(values))
        if clash:
            raise TokenizerError(f"chat template arguments may not set {', '.join(clash)} (the renderer sets them)")
        values.update(template_kwargs)
        try:
            return self._compiled_template.render(values)  # a dict: no keyword can clash with render's own
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from None
        except Exception as e:  # noqa: BLE001 - e.g. the sandbox's OverflowError for range(10**6)
            raise TokenizerError(f"chat template: {type(e).__name__}: {e}") from None

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, without encoding it: no token
        covers more than `max_token_bytes` bytes."""
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (byte-level BPE: one vocabulary
        character per byte; otherwise up to 4 bytes a character)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        longest = max((len(t) for t in vocab), default=1)
        from tokenizers import decoders

        byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        return max(longest if byte_level else 4 * longest, 1)

    def encode_chat(self, messages: list[dict], tools: list | None = None, **template_kwargs) -> list[int]:
        """Token ids of the rendered chat prompt (the template already holds every special token)."""
        return self.encode(self.apply_chat_template(messages, tools, **template_kwargs), add_special_tokens=False)

    def message_ends(self, ids: Sequence[int]) -> list[int]:
        """Where the chat messages of a rendered prompt end: the position after each
        end-of-turn token (an end-of-sequence id, e.g. Qwen's <|im_end|>)."""
        ends = frozenset(self.eos_token_ids)
        return [i + 1 for i, t in enumerate(ids) if t in ends]

    @cached_property
    def _compiled_template(self):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.path}: chat template does not parse: {e}") from None

    # ------------------------------------------------------------------ loading

    def _eos_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids: generation_config.json, then config.json (top level or
        text_config), then tokenizer_config.json's eos_token; each listed once."""
        found: list[int] = []
        generation = _read_json(self.path / "generation_config.json")
        model = _read_json(self.path / "config.json")
        for source in (generation, model, model.get("text_config") or {}):
            value = source.get("eos_token_id")
            found += [value] if isinstance(value, int) else list(value or [])
        eos_text = self.special_tokens["eos_token"]
        if eos_text is not None and self.token_to_id(eos_text) is not None:
            found.append(self.token_to_id(eos_text))
        return tuple(dict.fromkeys(int(i) for i in found))

    def _chat_template(self) -> str | None:
        file = self.path / "chat_template.jinja"
        if file.is_file():
            return file.read_text(encoding="utf-8")
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{self.path / 'tokenizer_config.json'}: chat_template is not a string")
        return template


class IncrementalDetokenizer:
    """Text of a growing token sequence, released only as complete characters: a
    token that ends inside a multi-byte UTF-8 character is held back until the
    character is complete. Pieces joined equal `decode` of all tokens (after `flush`).

    Each step decodes a short window of recent tokens, so tokenizers whose pieces
    depend on their neighbours (leading-space rules) come out right.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: the tokens before _read are already released
        self._read = 0

    def _decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Add one token; return the newly complete text (maybe '')."""
        self.ids.append(int(token_id))
        released = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) <= len(released) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(released) :]

    def flush(self) -> str:
        """The text still held back (an incomplete character shows as U+FFFD)."""
        released = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(released) :]


@dataclass
class _Encoded:
    """A prompt's text and ids, and where in both its cutting added tokens start."""

    text: str
    ids: list[int]
    cuts: list[int]  # character positions, ascending
    at: list[int]  # the token index of each


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of a and b (bisected: slices compare in C)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while high - low > 1:  # a[:low] == b[:low], a[:high] != b[:high]
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer of a pack or checkpoint directory."""
    return Tokenizer(path)


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{file}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{file}: expected a JSON object")
    return value


def _token_text(value) -> str | None:
    """A special token as stored in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
