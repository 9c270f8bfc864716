"""Token sampling: the filtered next-token distribution and seeded draws from it.

The filters run in Hugging Face `generate`'s order: temperature, then top-k, then
top-p, then min-p. (vLLM v1 applies min-p before top-k/top-p; the two orders differ
only when top-p and min-p are both set, because top-p's cumulative mass depends on
what min-p removed. top-k and min-p commute.) Each filter sets the logits it drops to
-inf; the survivors keep their relative weights:

- temperature T: logits / T; T == 0 means greedy (a one-hot distribution on argmax).
- top-k: keep the k largest logits (0 = off); ties with the k-th are kept, as in HF.
- top-p: keep the smallest set of most likely tokens whose mass is >= top_p, i.e.
  token i survives if the mass of the tokens ranked above it is < top_p (so the most
  likely token always survives); tokens tied with the last one kept are kept too.
- min-p: drop tokens with p < min_p * p_max.

`filtered_probs` works on any batch of rows [..., V]: speculative rejection sampling
compares the draft's and the target's filtered distributions with the same params.
Everything stays in MLX ops; reading the sampled token is the caller's one sync.
"""

from __future__ import annotations

import math
import numbers
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx

NEG_INF = float("-inf")


class SamplingError(ValueError):
    """A sampling parameter out of its range; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        _check_real("temperature", self.temperature, "a finite number >= 0", lambda v: v >= 0)
        _check_real("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        _check_real("min_p", self.min_p, "in [0, 1)", lambda v: 0 <= v < 1)
        _check_int("top_k", self.top_k, "an integer >= 0 (0 = off)", lambda v: v >= 0)
        if self.seed is not None:
            _check_int("seed", self.seed, "an integer in [0, 2**64) or None", lambda v: 0 <= v < 2**64)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_args(cls, args) -> SamplingParams:
        """From the flags add_sampling_arguments added (chat, generate)."""
        return cls(args.temperature, args.top_p, args.top_k, args.min_p, args.seed)


def add_sampling_arguments(parser) -> None:
    """The sampling flags of the command-line faces that sample (chat, generate)."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int)


def _check_real(name, value, want, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        raise SamplingError(name, f"{name} must be {want}, got {value!r}")


def _check_int(name, value, want, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not ok(value):
        raise SamplingError(name, f"{name} must be {want}, got {value!r}")


def _mask_below(x: mx.array, threshold: mx.array) -> mx.array:
    return mx.where(x < threshold, NEG_INF, x)


def filtered_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Temperature-scaled logits [..., V] (float32) with every filtered-out token at -inf;
    unnormalized (see `filtered_logprobs` / `filtered_probs`)."""
    x = logits.astype(mx.float32)
    vocab = x.shape[-1]
    if params.greedy:
        hit = mx.arange(vocab) == mx.argmax(x, axis=-1, keepdims=True)
        return mx.where(hit, 0.0, NEG_INF)
    if params.temperature != 1:
        x = x / params.temperature
    top = None
    if 0 < params.top_k < vocab:
        top = mx.topk(x, params.top_k, axis=-1)
        x = _mask_below(x, mx.min(top, axis=-1, keepdims=True))
    if params.top_p < 1:
        # With top-k on, only its k survivors (plus ties) can be in the nucleus: sort those.
        lse = mx.logsumexp(x, axis=-1, keepdims=True)
        ranked = mx.sort(x if top is None else top, axis=-1)  # ascending
        mass_above = mx.cumsum(mx.exp(ranked - lse), axis=-1, reverse=True, inclusive=False)
        x = _mask_below(x, mx.min(mx.where(mass_above < params.top_p, ranked, math.inf), axis=-1, keepdims=True))
    if params.min_p > 0:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p)
        x = _mask_below(x, mx.max(x, axis=-1, keepdims=True) + math.log(params.min_p))
    return x


def filtered_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Log-probabilities [..., V] of the filtered distribution (-inf where filtered)."""
    x = filtered_logits(logits, params)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def filtered_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Probabilities [..., V] of the filtered distribution; each row sums to 1."""
    return mx.softmax(filtered_logits(logits, params), axis=-1)


def sample(logits: mx.array, params: SamplingParams, key: mx.array | None) -> mx.array:
    """One token per row of logits [..., V] as int32 [...] (lazy). Greedy needs no key;
    sampling needs one (from `key_chain`) so that a seed reproduces the output."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    if key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key (see key_chain)")
    return mx.random.categorical(filtered_logits(logits, params), axis=-1, key=key).astype(mx.int32)


def allowed(words, width: int) -> mx.array:
    """Bool [..., width] from int32 words [..., ceil(width / 32)]: bit i % 32 of word
    i // 32 says whether token i is allowed (llguidance's bitmask layout). Each word is
    shifted 32 ways and flattened (no gather)."""
    w = mx.array(words).view(mx.uint32)  # (made per call: MLX arrays belong to a thread's stream)
    bits = (mx.right_shift(w[..., None], mx.arange(32, dtype=mx.uint32)) & 1).reshape(*w.shape[:-1], -1)
    return bits[..., :width].astype(mx.bool_)


def mask_logits(logits: mx.array, words) -> mx.array:
    """Logits [..., V] with the tokens the bitmask `words` [..., ceil(V / 32)] does not
    allow at -inf (a grammar's constraint, applied before temperature and the filters);
    `words` None: unchanged."""
    if words is None:
        return logits
    return mx.where(allowed(words, logits.shape[-1]), logits, NEG_INF)


def key_chain(seed: int | None) -> Iterator[mx.array]:
    """Endless PRNG keys, one per draw: split the running key, hand out one half.
    Without a seed the chain starts from fresh OS randomness."""
    key = mx.random.key(secrets.randbits(63) if seed is None else seed)
    while True:
        pair = mx.random.split(key)
        key = pair[0]
        yield pair[1]
