"""What the speculative tests share: the tiny target, its greedy continuation, and
oracle drafters that know the target's own continuation (every accepted length and
commit path runs) or propose a constant (timing only)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from decoding import plain

from monolith.runtime.drafter import Drafter, Proposal
from monolith.sampling import SamplingParams

GREEDY = SamplingParams()
GAMMA = 7
TAPS = [0, 2]  # the taps the synthetic draft of the tiny target reads
PROMPT = [401, 316, 265, 198, 71, 72, 402, 198, 401, 77, 81]  # 11 tokens: crosses chunks of 4
CHUNK = 4
NEAR_TIE = 1e-3  # top-1/top-2 logit margin below which float32 kernel noise may part two runs
NEAR_TIES: list[tuple[int, float]] = []  # (token, margin) of each near-tie parting assert_same_greedy passed
STATE_TOL = 1e-4  # max |a - b| / max |b| of cache arrays: verify-block vs one-forward kernels


def plain_greedy(model, prompt, n, max_context=None):
    """The target's own greedy continuation (no stop tokens)."""
    return plain(model, prompt, n, GREEDY, [], max_context or len(prompt) + n + 1).token_ids


def forward_all(model, tokens, taps=None):
    """One plain forward over `tokens` on a fresh cache: (logits, features, cache)."""
    cache = model.make_cache(len(tokens) + 1)
    logits, features = model(mx.array(tokens, dtype=mx.int32), cache, taps=taps)
    return np.array(logits), None if features is None else np.array(features), cache


def first_parting(model, prompt, got, want) -> tuple[int, float] | None:
    """(index, top-1/top-2 margin of the target there) where two outputs part, or None."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            logits = forward_all(model, prompt + want[:i])[0][-1]
            top = np.sort(logits)[::-1]
            return i, float(top[0] - top[1])
    return None if len(got) == len(want) else (min(len(got), len(want)), float("inf"))


def assert_same_greedy(model, prompt, got, want):
    """`got` is `want`, or parts from it only where the target's top two logits lie within
    NEAR_TIE (float32 kernel noise): that parting is counted in NEAR_TIES (the run's summary
    gives the count, conftest.py) and passes, as histories.WarmCold counts its near-ties."""
    parting = first_parting(model, prompt, got, want)
    if parting is not None:
        i, margin = parting
        assert margin < NEAR_TIE, f"speculative output parts from plain at token {i} with margin {margin:.4g}"
        NEAR_TIES.append((i, margin))


# ------------------------------------------------------------------ oracle drafters


class SequenceTracker(Drafter):
    """Rebuilds the committed tokens from what a drafter sees: the prompt's features
    first, then after each proposal the anchor and the accepted proposals (the kept
    rows: features of a + 1 rows means a proposals were accepted)."""

    def __init__(self, prompt, taps, hidden, max_proposals=GAMMA + 1):
        self.prompt, self.taps, self.hidden, self.max_proposals = list(prompt), list(taps), hidden, max_proposals

    def start(self, max_context):
        self.committed: list[int] = []
        self.features: list[np.ndarray] = []
        self.pending: list[int] | None = None  # [anchor, x_1..x_l] of the last proposal
        self.max_context = max_context

    def observe(self, features):
        n = features.shape[0]
        assert features.shape == (n, len(self.taps) * self.hidden) and n >= 1
        self.features.append(np.array(features))
        if self.pending is None:  # prompt chunks, or a round that verified the anchor alone
            start = len(self.committed)
            self.committed += [self.prompt[i] if i < len(self.prompt) else self.unknown(i)
                               for i in range(start, start + n)]
        else:
            assert n <= len(self.pending)
            self.committed += self.pending[:n]
            self.pending = None
        assert len(self.committed) <= self.max_context - 1

    def unknown(self, position):
        """The token at a committed position the drafter was never told (an anchor
        verified without proposals, at the very end of a generation)."""
        return -1

    def _begin(self, anchor, tokens):
        assert self.pending is None, "propose twice without a commit"
        self.pending = [anchor, *tokens]


class GreedyOracle(SequenceTracker):
    """Proposes the target's greedy continuation `reference`, with the proposal at
    0-based `error_at` replaced by a wrong token (None: no error)."""

    def __init__(self, prompt, reference, vocab, error_at=None, hidden=64, confidence=None):
        super().__init__(prompt, TAPS, hidden)
        self.sequence, self.vocab, self.error_at = list(prompt) + list(reference), vocab, error_at
        self.confidence = confidence
        self.gammas: list[int] = []

    def unknown(self, position):
        return self.sequence[position]

    def propose(self, anchor, gamma, params, key):
        pos = len(self.committed)
        assert anchor == self.sequence[pos], f"anchor {anchor} at position {pos}, the reference has {self.sequence[pos]}"
        tokens = (self.sequence[pos + 1:pos + 1 + gamma] + [0] * gamma)[:gamma]
        if self.error_at is not None and self.error_at < gamma:
            tokens[self.error_at] = (tokens[self.error_at] + 1) % self.vocab
        self.gammas.append(gamma)
        self._begin(anchor, tokens)
        q = np.zeros((gamma, self.vocab), np.float32)
        q[np.arange(gamma), tokens] = 1
        conf = None if self.confidence is None else mx.array(self.confidence[:gamma], dtype=mx.float32)
        return Proposal(mx.array(tokens, dtype=mx.int32), mx.array(q), conf)



class ConstantDrafter(Drafter):
    """Proposes token 0 everywhere (timing only)."""

    taps, max_proposals = TAPS, GAMMA + 1

    def start(self, max_context):
        self.rows = 0

    def observe(self, features):
        self.rows += features.shape[0]

    def propose(self, anchor, gamma, params, key):
        return Proposal(mx.zeros((gamma,), mx.int32), mx.zeros((gamma, 512)), None)
