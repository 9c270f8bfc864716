"""Grammar-constrained decoding over llguidance (issue 16; why llguidance:
bench/archive/results/grammar_engines.md).

A `Grammar` is an llguidance grammar (from a JSON schema or a Lark text; the serving layer
builds them) and, for a prompt that leaves Qwen's reasoning block open, the token that
closes it: the model reasons freely and the constraint starts after that token; with a
`budget`, for at most that many tokens, after which the closing token is forced (a
thinking budget).
`GrammarTokenizer` is the model's vocabulary as llguidance reads it (built once per
model: about a second at 248K tokens), sized to the logits' width so that ids past the
tokenizer's are never allowed. A `Guide` follows one sequence: `words()` is the next
token's allowed set as a bitmask (int32 words, bit i of word i // 32 = token i, as
llguidance writes it), `push(token)` consumes a token, `rollback(n)` takes the last n
back (the speculative round's rejected proposals), `forced()` the one allowed token when
there is exactly one (jump-forward: emitted without sampling).

`sampling.mask_logits` applies a bitmask to logits rows on the device: disallowed tokens
go to -inf before temperature and the filters, so greedy is the argmax over the allowed
tokens and sampling follows the target's distribution renormalized over them (vLLM and
sglang apply the grammar before the sampler too).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


class GrammarError(ValueError):
    """A grammar llguidance refuses (an unsupported JSON-schema feature, a bad regex...)."""


@dataclass(frozen=True)
class Grammar:
    text: str  # an llguidance grammar (LLMatcher.grammar_from_json_schema / _from_lark)
    starts_after: int | None = None  # a token id: unconstrained until it was emitted
    budget: int | None = None  # at most this many tokens before starts_after, which is then forced


class GrammarTokenizer:
    """The model's vocabulary for llguidance: `width` = the logits' width, `eos_ids` the
    tokens that end the output (allowed once the grammar is complete)."""

    COMPILED = 32  # grammars kept compiled, most recently used first out

    def __init__(self, tokenizer_json: str, width: int, eos_ids):
        import llguidance

        self._llg = llguidance
        self.width = width
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=width, eos_token=list(eos_ids))
        # grammar text -> a matcher at its start: an agent resends the same tools every turn,
        # and compiling their calls' grammar costs ~10-20 ms where a copy costs microseconds
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer, width: int, eos_ids=None) -> GrammarTokenizer:
        """From a monolith.tokenizer.Tokenizer (its tokenizer.json; its end tokens unless
        `eos_ids` are given)."""
        return cls((tokenizer.path / "tokenizer.json").read_text(encoding="utf-8"), width,
                   sorted(tokenizer.eos_token_ids if eos_ids is None else eos_ids))

    def check(self, grammar: Grammar) -> None:
        """Raise GrammarError with llguidance's message when the grammar cannot be used (it is
        compiled here, and kept for the `guide` that follows)."""
        self._start(grammar.text)

    def guide(self, grammar: Grammar) -> Guide:
        start = self._start(grammar.text).deep_copy()
        return Guide(start, self.width, self.tokenizer.eos_tokens, grammar.starts_after, grammar.budget)

    def _start(self, text: str):
        """A matcher at the start of `text`, compiled once while it is among the COMPILED
        most recently used."""
        with self._lock:
            start = self._compiled.get(text)
            if start is not None:
                self._compiled.move_to_end(text)
                return start
        start = self._llg.LLMatcher(self.tokenizer, text, log_level=0)
        if start.is_error():
            raise GrammarError(start.get_error())
        with self._lock:
            self._compiled[text] = start
            while len(self._compiled) > self.COMPILED:
                self._compiled.popitem(last=False)
        return start


class Guide:
    """One sequence's position in its grammar (see the module doc)."""

    def __init__(self, matcher, width: int, end_ids, starts_after: int | None = None, budget: int | None = None):
        self.matcher, self.width, self.end_ids = matcher, width, frozenset(end_ids)
        self.waiting = starts_after is not None  # before the token that starts the constraint
        self.starts_after = starts_after
        self.budget = budget  # pushes allowed while waiting; then only starts_after is
        self.waited = 0  # pushes while waiting
        self.history: list[tuple[str, np.ndarray | None]] = []  # per push: how it went (below), its mask
        self._words: np.ndarray | None = None  # the current position's mask, computed once

    def words(self) -> np.ndarray | None:
        """The allowed next tokens as int32 words [ceil(width / 32)], or None while the
        constraint has not started and once it ended (an end token was consumed: nothing
        after it is emitted, so a speculative round may verify any token there). A
        waiting guide whose budget is spent allows only the token that starts it."""
        if self.waiting:
            if self.budget is None or self.waited < self.budget:
                return None
            if self._words is None:
                self._words = np.zeros((self.width + 31) // 32, np.int32)
                self._words.view(np.uint32)[self.starts_after // 32] = 1 << (self.starts_after % 32)
            return self._words
        if self.ended:
            return None
        if self._words is None:
            words = np.empty((self.width + 31) // 32, np.int32)
            self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)  # no bytes copy
            self._words = words
            if self.matcher.is_error():
                raise RuntimeError(f"grammar matcher failed: {self.matcher.get_error()}")
            if not self._words.any():
                raise RuntimeError("the grammar allows no next token (llguidance: "
                                   f"{self.matcher.get_error() or 'empty mask'})")
        return self._words

    def forced(self) -> int | None:
        """The only allowed next token, or None when there are several (or no constraint)."""
        words = self.words()
        if words is None:
            return None
        nonzero = np.flatnonzero(words)
        if len(nonzero) != 1:
            return None
        word = int(words[nonzero[0]]) & 0xFFFFFFFF
        if word & (word - 1):  # more than one bit
            return None
        return int(nonzero[0]) * 32 + word.bit_length() - 1

    def push(self, token: int) -> None:
        """Consume `token` (it must be allowed)."""
        words, self._words = self.words(), None
        if self.waiting:  # "wait": before the constraint
            if words is not None and token != self.starts_after:
                raise RuntimeError(f"token {token} is not allowed: the budget of {self.budget} tokens before "
                                   f"token {self.starts_after} is spent")
            self.history.append(("wait", words))
            self.waiting = token != self.starts_after
            self.waited += 1
        elif self.ended:  # "after": past the end token
            self.history.append(("after", None))
        elif token in self.end_ids and _allows(words, token):
            # "end": kept from the matcher, whose rollback does not count end tokens
            self.history.append(("end", words))
        elif self.matcher.consume_token(int(token)):
            self.history.append(("match", words))
        else:
            raise RuntimeError(f"token {token} is not allowed by the grammar: {self.matcher.get_error()}")

    def rollback(self, n: int) -> None:
        """Undo the last n pushes."""
        if n <= 0:
            return
        taken, self.history = self.history[-n:], self.history[:-n]
        consumed = sum(kind == "match" for kind, _ in taken)
        self.waited -= sum(kind == "wait" for kind, _ in taken)
        if consumed and not self.matcher.rollback(consumed):
            raise RuntimeError(f"grammar matcher cannot roll back {consumed} tokens: {self.matcher.get_error()}")
        kind, words = taken[0]
        if kind == "wait":  # the constraint had not started at the first undone push
            self.waiting = True
        # the first undone push met the mask of the state rolled back to: no recomputing
        self._words = words if kind in ("match", "end") else None

    @property
    def ended(self) -> bool:
        """An end token was consumed: the output is complete."""
        return bool(self.history) and self.history[-1][0] in ("end", "after")

    def masks(self, n: int) -> np.ndarray | None:
        """int32 [n + 1, words]: the masks the last n pushes met, then the current one
        (all ones where there was no constraint): the verify rows' masks; None when no
        row has a constraint."""
        rows = [w for _, w in self.history[len(self.history) - n:]] if n else []
        rows.append(self.words())
        known = [w for w in rows if w is not None]
        if not known:
            return None
        full = np.full_like(known[0], -1)
        return np.stack([full if w is None else w for w in rows])


def _allows(words: np.ndarray, token: int) -> bool:
    return bool((int(words[token // 32]) >> (token % 32)) & 1)
