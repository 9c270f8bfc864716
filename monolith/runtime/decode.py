"""Plain (non-speculative) generation: chunked prefill, then one token per step.

The next step is queued before the current token is read (`mx.async_eval`), so the
host's work on token t overlaps the device's work on token t+1 and each generated
token costs one host sync. When the token read turns out to be a stop token, that
one queued step is discarded (the cache then holds one token past the output).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..sampling import SamplingParams, key_chain, sample
from .stats import SpecStats


class ContextLengthError(ValueError):
    """The prompt leaves no room for a generated token in the context."""

    def __init__(self, prompt_tokens: int, max_context: int):
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context
        super().__init__(
            f"prompt is {prompt_tokens} tokens but max_context is {max_context}: "
            f"the prompt plus at least one generated token must fit"
        )


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # generated tokens, without the stop token
    finish_reason: str  # "stop" (a stop token) or "length" (max_tokens or context full)
    prompt_tokens: int
    prefill_seconds: float  # start to first generated token (prefill + first sample)
    decode_seconds: float  # first generated token to the last one
    # tokens read after the first one, a stop token included (plain decoding: one
    # forward step each; a speculative round reads up to gamma + 1)
    decode_steps: int
    speculative: SpecStats | None = None  # rounds and acceptance (speculative decoding only)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_steps and self.decode_seconds > 0 else 0.0


def generate(
    model,
    prompt_ids: Sequence[int],
    max_tokens: int,
    params: SamplingParams,
    stop_ids: Iterable[int],
    max_context: int,
    prefill_chunk_size: int = 512,
    on_token: Callable[[int], None] | None = None,
) -> GenerationResult:
    """Generate up to `max_tokens` tokens after `prompt_ids`. The sequence (prompt +
    output) never exceeds `max_context` tokens; a stop token ends it with "stop" and is
    not part of the output. `on_token(id)` is called for each output token as it is read."""
    prompt = check_request(prompt_ids, model.args.vocab_size, max_tokens, max_context, prefill_chunk_size)
    stops = frozenset(int(t) for t in stop_ids)
    keys = None if params.greedy else key_chain(params.seed)

    def pick(logits: mx.array) -> mx.array:
        return sample(logits, params, None if keys is None else next(keys))

    start = time.perf_counter()
    cache = model.make_cache(max_context)
    token = pick(model.prefill(mx.array(prompt, dtype=mx.int32), cache, chunk_size=prefill_chunk_size))
    mx.async_eval(token)
    out: list[int] = []
    first_at = None
    steps = 0
    while True:
        produced = len(out) + 1  # counting the token in flight
        more = produced < max_tokens and len(prompt) + produced < max_context
        if more:
            logits, _ = model(token.reshape(1), cache)
            upcoming = pick(logits[-1])
            mx.async_eval(upcoming)
        token_id = token.item()
        if first_at is None:
            first_at = time.perf_counter()
        else:
            steps += 1
        if token_id in stops:
            finish = "stop"
            break
        out.append(token_id)
        if on_token is not None:
            on_token(token_id)
        if not more:
            finish = "length"
            break
        token = upcoming
    end = time.perf_counter()
    return GenerationResult(out, finish, len(prompt), first_at - start, end - first_at, steps)


def check_request(prompt_ids: Sequence[int], vocab_size: int, max_tokens: int, max_context: int,
                  prefill_chunk_size: int) -> list[int]:
    """The prompt as a list of ids, after checking every argument (before any work)."""
    prompt = check_prompt(prompt_ids, vocab_size, max_context)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if prefill_chunk_size < 1:
        raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size!r}")
    return prompt


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, max_context: int) -> list[int]:
    """The prompt as a list of ints; ValueError (or ContextLengthError) if it is empty,
    holds an id outside the vocabulary, or leaves no room for one generated token."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: at least one token is needed")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range for a vocabulary of {vocab_size}")
    if len(prompt) + 1 > max_context:
        raise ContextLengthError(len(prompt), max_context)
    return prompt
