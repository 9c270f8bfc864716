"""What a request is and what the engine reports back: the request, its token events
(`Started`, `Delta`s, then one `Finished` or `Failed`), usage and speculative counters."""

from __future__ import annotations

from dataclasses import dataclass

from ..sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int | None = None  # None: until a stop or the context is full
    params: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and the k most likely


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
    """What a backend call produced."""

    token_ids: list[int]  # output tokens (a stop token is not one of them)
    finish_reason: str  # "stop" (stop token), "length", or "abort" (on_token asked to stop)
    prompt_tokens: int
    cached_tokens: int  # prompt tokens taken from the session instead of prefilled
    prefill_seconds: float  # start to the first output token
    decode_seconds: float  # first output token to the last
    decode_steps: int
    stop_token: bool = False  # a stop token ended it (it counts as generated)
    spec: SpecCounters | None = None


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
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop", "length", or "cancelled"
    usage: Usage
    token_ids: tuple[int, ...]
    queued_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    spec: SpecCounters | None = None

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


Event = Started | Delta | Finished | Failed
