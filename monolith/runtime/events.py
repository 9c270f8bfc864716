"""What a request is and what the engine reports back: the request (checked once, here,
at the boundary: the decoders trust it), what a decoder produced (`Outcome`), the token
events (`Started`, `Delta`s, then one `Finished` or `Failed`), usage and speculative
counters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..sampling import SamplingParams
from .grammar import Grammar
from .stats import SpecStats

MAX_TOP_LOGPROBS = 20


class RequestError(ValueError):
    """A request the engine cannot run; `field` names the culprit ("prompt", "max_tokens",
    "logprobs")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class ContextLengthError(RequestError):
    """The prompt leaves no room for a generated token in the context."""

    def __init__(self, prompt_tokens: int, max_context: int):
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context
        super().__init__("prompt", 
            f"prompt is {prompt_tokens} tokens but max_context is {max_context}: "
            f"the prompt plus at least one generated token must fit"
        )


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, max_context: int) -> list[int]:
    """The prompt as a list of ints; ValueError (or ContextLengthError) if it is empty,
    holds an id outside the vocabulary, or leaves no room for one generated token."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise RequestError("prompt", "the prompt is empty: at least one token is needed")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError("prompt", f"prompt token id {bad} is out of range for a vocabulary of {vocab_size}")
    if len(prompt) + 1 > max_context:
        raise ContextLengthError(len(prompt), max_context)
    return prompt


def check_request(prompt_ids: Sequence[int], max_tokens, logprobs: int | None, vocab_size: int, max_context: int,
                  logprobs_available: bool) -> list[int]:
    """The prompt as a list of ints, after checking everything a decoder trusts (the one
    check of a request's content: the engine's boundary)."""
    prompt = check_prompt(prompt_ids, vocab_size, max_context)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise RequestError("max_tokens", f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError("logprobs", f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    if logprobs is not None and not logprobs_available:
        raise RequestError("logprobs", "logprobs are not available with this decoder")
    return prompt


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int | None = None  # None: until a stop or the context is full
    params: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and the k most likely
    boundaries: tuple[int, ...] = ()  # where the prompt's chat messages end: prompt-cache saves
    grammar: Grammar | None = None  # constrains the output (runtime.grammar)
    # the prompt's images in order (models/image_inputs.PreparedImage): image i is the i-th
    # run of the vision's image_token_id in prompt_ids, image.tokens long (docs/target.md)
    images: tuple = ()
    # draft every round of this request whatever the start measured (Engine.draft_decoder;
    # greedy output is the same); without a draft decoder, decoded as the engine decodes
    draft: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probabilities under the model's raw next-token distribution (before
    temperature and filters, as vLLM reports them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class SpecCounters:
    drafts: int = 0  # speculative rounds
    draft_tokens: int = 0  # proposals verified
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # accepted count at draft position 0, 1, ...

    def __add__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + (0,) * (n - len(self.accepted_per_position))
        b = other.accepted_per_position + (0,) * (n - len(other.accepted_per_position))
        return SpecCounters(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                         self.accepted_tokens + other.accepted_tokens, tuple(x + y for x, y in zip(a, b)))

    @property
    def acceptance_length(self) -> float:
        """tau: tokens committed per round (accepted + the bonus token)."""
        return (self.accepted_tokens + self.drafts) / self.drafts if self.drafts else 0.0


@dataclass(frozen=True)
class Outcome:
    """What a decoder call produced."""

    token_ids: list[int]  # output tokens (a stop token is not one of them)
    finish_reason: str  # "stop" (stop token), "length", or "abort" (on_token asked to stop)
    prompt_tokens: int
    cached_tokens: int  # prompt tokens taken from the session instead of prefilled
    prefill_seconds: float  # start to the first output token (prefill + first sample)
    decode_seconds: float  # first output token to the last
    # tokens read after the first one, a stop token included (plain decoding: one
    # forward step each; a speculative round reads up to gamma + 1)
    decode_steps: int
    stop_token: bool = False  # a stop token ended it (it counts as generated)
    speculative: SpecStats | None = None  # rounds and acceptance (speculative decoding only)

    @property
    def spec(self) -> SpecCounters | None:
        return spec_counters(self.speculative)

    @property
    def prefill_tok_s(self) -> float:
        prefilled = self.prompt_tokens - self.cached_tokens
        return prefilled / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_steps and self.decode_seconds > 0 else 0.0


def spec_counters(stats: SpecStats | None) -> SpecCounters | None:
    """The engine's additive counters from a generation's speculative stats."""
    if stats is None:
        return None
    c = stats.prometheus()
    return SpecCounters(c["spec_decode_num_drafts_total"], c["spec_decode_num_draft_tokens_total"],
                        c["spec_decode_num_accepted_tokens_total"],
                        tuple(c["spec_decode_num_accepted_tokens_per_pos_total"]))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Started:
    queued_seconds: float


@dataclass(frozen=True)
class Resumed:
    """The sequence resumed with `cached_tokens` prompt tokens from the session or the
    prompt cache (the rest is prefilled); sent after Started, before any Delta."""

    cached_tokens: int


# How a generated token came (docs/serving.md, "Speculation in the stream"): a draft's
# proposal the target accepted, the target's token in place of the first rejected one,
# the extra token after a round that accepted every proposal, or a step without a draft.
ACCEPTED, CORRECTION, BONUS, PLAIN = "accepted", "correction", "bonus", "plain"


def merge_pieces(pieces) -> tuple[tuple[str, str], ...]:
    """(text, how) pieces with empty ones dropped and neighbours of the same kind joined."""
    out: list[tuple[str, str]] = []
    for text, how in pieces:
        if not text:
            continue
        if out and out[-1][1] == how:
            out[-1] = (out[-1][0] + text, how)
        else:
            out.append((text, how))
    return tuple(out)


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    spec: tuple[tuple[str, str], ...] = ()  # (text, how) pieces of `text`, in order (merge_pieces)

    @staticmethod
    def join(deltas: Sequence[Delta]) -> Delta:
        """One Delta for consecutive ones: their text, logprobs and pieces in order."""
        if len(deltas) == 1:
            return deltas[0]
        return Delta("".join(d.text for d in deltas), tuple(lp for d in deltas for lp in d.logprobs),
                     merge_pieces(p for d in deltas for p in d.spec))


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop", "length", or "cancelled"
    usage: Usage
    token_ids: tuple[int, ...]
    queued_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    speculative: SpecStats | None = None

    @property
    def spec(self) -> SpecCounters | None:
        return spec_counters(self.speculative)

    @property
    def prefilled_tokens(self) -> int:
        return self.usage.prompt_tokens - self.usage.cached_tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_steps and self.decode_seconds > 0 else 0.0


@dataclass(frozen=True)
class Failed:
    error: Exception


Event = Started | Resumed | Delta | Finished | Failed
