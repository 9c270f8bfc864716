"""Speculative decoding (monolith.runtime.speculative, drafter, scheduler, stats) and
`python -m monolith.generate --draft`: oracle drafters that know the target's own
continuation make every accepted length and commit path run, and greedy speculative
output must equal plain greedy output token for token (float32, the tiny synthetic
target's peaked lm_head; a parting is reported with its top-1/top-2 margin); after
every round the cache equals a plain forward over the committed tokens; sampled output
follows the target's distribution (chi-square); the schedulers' rules on given
confidences and timings. The last section runs the real DSpark/DFlash drafts."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from numeric import rel
from scipy import stats as scipy_stats

from decoding import plain, speculate
from monolith.generate import main
from monolith.models import load_model
from monolith.models.cache import GDNState, KVCache
from monolith.pack import build_pack
from monolith.runtime import calibrate, rounds
from monolith.runtime.accept import accept_greedy, accept_sampled
from monolith.runtime.calibrate import measure_break_even, measure_costs
from monolith.runtime.draft_model import DraftModelDrafter
from monolith.runtime.drafter import Drafter, Proposal
from monolith.runtime.events import ContextLengthError
from monolith.runtime.rounds import PLAIN_RUN, Rounds
from monolith.runtime.speculative import SpeculativeDecoder
from monolith.runtime.scheduler import (
    CostScheduler,
    Fallback,
    FixedScheduler,
    ThresholdScheduler,
    make_scheduler,
)
from monolith.runtime.stats import SpecStats
from monolith.sampling import SamplingParams, filtered_probs

GREEDY = SamplingParams()
GAMMA = 7
TAPS = [0, 2]  # the taps the synthetic draft of the tiny target reads
PROMPT = [401, 316, 265, 198, 71, 72, 402, 198, 401, 77, 81]  # 11 tokens: crosses chunks of 4
CHUNK = 4
NEAR_TIE = 1e-3  # top-1/top-2 logit margin below which float32 kernel noise may part two runs
STATE_TOL = 1e-4  # max |a - b| / max |b| of cache arrays: verify-block vs one-forward kernels


@pytest.fixture(scope="module")
def target_pack(tmp_path_factory):
    from monolith.synth import write_target

    root = tmp_path_factory.mktemp("spec")
    return build_pack(write_target(root / "target"), root / "target.pack", role="target")


@pytest.fixture(scope="module")
def model(target_pack):
    return load_model(target_pack, dtype="float32")


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
    parting = first_parting(model, prompt, got, want)
    if parting is not None:
        i, margin = parting
        assert margin < NEAR_TIE, f"speculative output parts from plain at token {i} with margin {margin:.4g}"
        pytest.skip(f"outputs part at a near-tie (token {i}, margin {margin:.3g}): not a bug")


# ------------------------------------------------------------------ oracle drafters


class SequenceTracker:
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

    def arrays(self):
        return []

    def snapshot(self):
        return None  # an oracle cannot resume: every prompt is prefilled whole

    def restore(self, snapshot, rows):
        return False

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


def test_oracles_are_drafters():
    assert isinstance(GreedyOracle([1], [2], 8), Drafter)


# ------------------------------------------------------------------ acceptance rules


def test_accept_greedy_prefix_and_bonus():
    vocab = 6
    targets = [3, 1, 4, 1, 5]  # argmax of each verify row

    logits = mx.array(np.eye(vocab, dtype=np.float32)[targets] * 5)
    for proposed, want in (([3, 1, 4, 1], (4, 5)), ([3, 1, 0, 1], (2, 4)), ([2, 1, 4, 1], (0, 3)),
                           ([3, 1, 4, 2], (3, 1))):
        got = np.array(accept_greedy(mx.array(proposed, dtype=mx.int32), logits)).tolist()
        assert tuple(got) == want, (proposed, got)
    got = accept_greedy(mx.zeros((0,), mx.int32), logits[:1])
    assert np.array(got).tolist() == [0, 3]


def emitted_first(p, q, proposed, draws, seed=0):
    """Counts of the first emitted token (x_1 if accepted, else the bonus) over `draws` keys."""
    keys = mx.random.split(mx.random.key(seed), draws)
    out = []
    for i in range(draws):
        a, bonus = np.array(accept_sampled(mx.array(proposed, dtype=mx.int32), p, q, keys[i])).tolist()
        out.append(proposed[0] if a > 0 else bonus)
    return np.bincount(out, minlength=p.shape[1])


def chi_square_ok(counts, probs, alpha=1e-3) -> float:
    """p-value of counts against probs, merging cells expected below 5 (must exceed alpha)."""
    probs = np.asarray(probs, np.float64)
    counts, expected = np.asarray(counts, np.float64), probs / probs.sum() * np.sum(counts)
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        assert counts[-1] == 0
        counts, expected = counts[:-1], expected[:-1]
    pvalue = scipy_stats.chisquare(counts, expected).pvalue
    assert pvalue > alpha, (pvalue, counts, expected)
    return pvalue


def test_rejection_sampling_exact_distribution():
    p = mx.array([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=mx.float32)
    q = mx.array([[0.1, 0.6, 0.0, 0.3]], dtype=mx.float32)
    draws = 3000
    # x = 1 (q > p): accepted with p/q = 0.5, else the residual max(p - q, 0) = [0.4, 0, 0.2, 0] / 0.6
    chi_square_ok(emitted_first(p, q, [1], draws), [0.5 * 0.4 / 0.6, 0.5, 0.5 * 0.2 / 0.6, 0.0])
    # x = 0 (p > q): always accepted; the bonus then comes from the last row
    keys = mx.random.split(mx.random.key(1), draws)
    bonus = [np.array(accept_sampled(mx.array([0], dtype=mx.int32), p, q, keys[i])).tolist() for i in range(draws)]
    assert all(a == 1 for a, _ in bonus)
    chi_square_ok(np.bincount([b for _, b in bonus], minlength=4), np.array(p[1]))
    # x = 3 (p = 0): always rejected, the residual again
    chi_square_ok(emitted_first(p, q, [3], 1000), [0.4 / 0.6, 0.0, 0.2 / 0.6, 0.0])
    # x drawn from q: the first emitted token is distributed as p's first row
    xs = np.random.default_rng(0).choice(4, size=draws, p=np.array(q[0]))
    keys = mx.random.split(mx.random.key(2), draws)
    first = []
    for i, x in enumerate(xs):
        a, b = np.array(accept_sampled(mx.array([int(x)], dtype=mx.int32), p, q, keys[i])).tolist()
        first.append(int(x) if a else b)
    chi_square_ok(np.bincount(first, minlength=4), np.array(p[0]))


def test_rejection_with_an_empty_residual_falls_back_to_p():
    p = q = mx.array([[0.5, 0.5, 0.0]], dtype=mx.float32)
    p2 = mx.concatenate([p, p])
    # x = 2 has p = q = 0: rejected, and max(p - q, 0) is all zero: the bonus comes from p
    counts = emitted_first(p2, q, [2], 400)
    assert counts[2] == 0 and counts[0] > 100 and counts[1] > 100


# ------------------------------------------------------------------ greedy: speculative == plain


def check_cache_matches_plain(model, prompt, emitted, decoder):
    """The cache after a round equals one plain forward over the committed tokens, and
    the drafter has seen exactly those rows' features."""
    cache = decoder.cache
    committed = (prompt + emitted)[:cache.offset]
    assert cache.offset == len(prompt) + len(emitted) - 1  # the last emitted token is the anchor
    assert decoder.drafter.committed == committed
    _, features, plain = forward_all(model, committed, taps=TAPS)
    assert rel(np.concatenate(decoder.drafter.features), features) < STATE_TOL
    for ours, ref in zip(cache.layers, plain.layers):
        if isinstance(ours, GDNState):
            assert rel(np.array(ours.conv), np.array(ref.conv)) < STATE_TOL
            assert rel(np.array(ours.recurrent), np.array(ref.recurrent)) < STATE_TOL
        else:
            assert isinstance(ours, KVCache)
            n = cache.offset
            assert rel(np.array(ours.keys[:, :, :n]), np.array(ref.keys[:, :, :n])) < STATE_TOL
            assert rel(np.array(ours.values[:, :, :n]), np.array(ref.values[:, :, :n])) < STATE_TOL


@pytest.mark.parametrize("error_at", [*range(GAMMA + 1), None])
def test_greedy_equals_plain_for_every_accepted_length(model, error_at):
    max_context = len(PROMPT) + 30
    reference = plain_greedy(model, PROMPT, 30, max_context)
    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at)
    emitted: list[int] = []
    rounds = []

    def on_round(result, decoder):
        emitted.extend(result.tokens)
        rounds.append((result.proposed, result.accepted))
        check_cache_matches_plain(model, PROMPT, [reference[0], *emitted], decoder)

    result = speculate(model, oracle, PROMPT, 100, GREEDY, [], max_context, prefill_chunk_size=CHUNK,
                                  block_size=GAMMA, on_round=on_round)
    assert_same_greedy(model, PROMPT, result.token_ids, reference)
    assert result.finish_reason == "length" and len(result.token_ids) == 30  # the context is full
    want = GAMMA if error_at is None else error_at
    # every round accepts exactly `want` unless the block was shrunk near the end
    assert all(a == min(want, l) for l, a in rounds)
    assert rounds[0] == (GAMMA, want)
    assert result.speculative.accepted_per_round == [a for _, a in rounds]
    assert result.decode_steps == 29 and result.prompt_tokens == len(PROMPT)


@pytest.mark.parametrize("room", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("chunk", [1, 3, 512])
def test_context_limit_and_prefill_chunks(model, room, chunk):
    max_context = len(PROMPT) + room
    reference = plain_greedy(model, PROMPT, room, max_context)
    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at=None)
    result = speculate(model, oracle, PROMPT, 1000, GREEDY, [], max_context, prefill_chunk_size=chunk)
    assert_same_greedy(model, PROMPT, result.token_ids, reference)
    assert len(result.token_ids) == room and result.finish_reason == "length"
    assert all(g <= room - 1 for g in oracle.gammas)


def test_prompt_that_fills_the_context_is_refused(model):
    oracle = GreedyOracle(PROMPT, [1], model.args.vocab_size)
    with pytest.raises(ContextLengthError):
        speculate(model, oracle, PROMPT, 5, GREEDY, [], len(PROMPT))
    with pytest.raises(ValueError, match="max_tokens"):
        speculate(model, oracle, PROMPT, 0, GREEDY, [], 64)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 8, 9, 10, 17])
def test_max_tokens_cuts_exactly(model, max_tokens):
    reference = plain_greedy(model, PROMPT, 20)
    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at=None)
    seen = []
    result = speculate(model, oracle, PROMPT, max_tokens, GREEDY, [], 256, on_token=seen.append)
    assert result.token_ids == seen == reference[:max_tokens] and result.finish_reason == "length"
    assert sum(r + 1 for r in result.speculative.accepted_per_round) == max_tokens - 1
    assert len(oracle.committed) == len(PROMPT) + max_tokens - 1


def test_stop_tokens_inside_a_round(model):
    reference = plain_greedy(model, PROMPT, 40)
    for error_at in (None, 3):
        # a stop token as an accepted proposal, as the bonus, and as the first token
        for k in (0, 1, 4, 5, 9, 12, 20):
            stop = reference[k]
            first = reference.index(stop)
            oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at)
            seen = []
            result = speculate(model, oracle, PROMPT, 100, GREEDY, {stop}, 256, on_token=seen.append)
            assert result.token_ids == seen == reference[:first], (error_at, k)
            assert result.finish_reason == "stop" and result.decode_steps == first
            plain_out = plain(model, PROMPT, 100, GREEDY, {stop}, 256)
            assert plain_out.token_ids == result.token_ids and plain_out.decode_steps == result.decode_steps


def test_decoder_rounds_and_stats(model):
    """The decoder step by step: the accepted count, the emitted tokens and the stats."""
    reference = plain_greedy(model, PROMPT, 30)
    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at=2)
    decoder = Rounds(model, oracle, GREEDY, 64, 4, profile=True)
    assert decoder.prefill(PROMPT, 5) == reference[0]
    out = [reference[0]]
    for _ in range(3):
        r = decoder.round(100)
        assert (r.proposed, r.accepted) == (4, 2) and len(r.tokens) == 3
        out += r.tokens
    assert out == reference[:10]
    s = decoder.stats
    assert s.rounds == 3 and s.acceptance_length == 3 and s.mean_accepted == 2
    assert s.per_position_acceptance() == [1.0, 1.0, 0.0, None]
    assert s.prometheus() == {"spec_decode_num_drafts_total": 3, "spec_decode_num_draft_tokens_total": 12,
                              "spec_decode_num_accepted_tokens_total": 6,
                              "spec_decode_num_accepted_tokens_per_pos_total": [3, 3, 0, 0]}
    assert s.draft_seconds > 0 and s.verify_seconds > 0 and s.commit_seconds > 0
    with pytest.raises(ValueError, match="block size must be an integer in 1..8"):
        SpeculativeDecoder(model, oracle, 64, gamma=9)


def test_stats_per_position_with_variable_blocks():
    s = SpecStats(3)
    for l, a in ((3, 3), (3, 1), (2, 0), (1, 1), (0, 0)):
        s.record(l, a)
    assert s.accepted_per_position() == [3, 1, 1]
    assert s.reached_per_position() == [4, 2, 1]
    assert s.per_position_acceptance() == [0.75, 0.5, 1.0]
    assert s.acceptance_length == 2.0 and s.prometheus()["spec_decode_num_drafts_total"] == 4
    assert s.draft_seconds is None
    with pytest.raises(ValueError):
        s.record(2, 3)


# ------------------------------------------------------------------ sampling: the target's distribution


class SamplingOracle(SequenceTracker):
    """Draws each proposal from a fixed distortion of the target's next-token
    distribution: q = 0.5 on its top-1, 0.2 on its top-2, 0.3 on its top-3 token. With
    top_k = 2 on the target, top-3 proposals are always rejected and top-1/top-2 ones
    accepted with p/q where that is below 1: both paths run."""

    def __init__(self, prompt, model):
        super().__init__(prompt, TAPS, model.args.hidden_size)
        self.model, self.vocab = model, model.args.vocab_size

    def propose(self, anchor, gamma, params, key):
        prefix = [*self.committed, anchor]
        tokens, qs = [], []
        keys = mx.random.split(key, gamma)
        for k in range(gamma):
            q = np.zeros(self.vocab, np.float32)
            q[list(top3(self.model, tuple(prefix)))] = [0.5, 0.2, 0.3]
            x = int(mx.random.categorical(mx.log(mx.array(q)), key=keys[k]).item())
            tokens.append(x)
            qs.append(q)
            prefix.append(x)
        self._begin(anchor, tokens)
        return Proposal(mx.array(tokens, dtype=mx.int32), mx.array(np.stack(qs)), None)


@functools.cache
def _last_logits(model, prefix: tuple) -> np.ndarray:
    return forward_all(model, list(prefix))[0][-1]


def top3(model, prefix):
    return np.argsort(-_last_logits(model, prefix))[:3]


def test_sampled_output_follows_the_target_distribution(model):
    """Chi-square of 4-token outputs over many seeds against the exact distribution of
    plain sampling (the product of the target's filtered next-token probabilities),
    with plain sampling itself as a control."""
    params = SamplingParams(temperature=1.0, top_k=2)
    prompt = PROMPT[:5]
    n_tokens, draws = 4, 600

    def probs(prefix):
        return np.array(filtered_probs(mx.array(_last_logits(model, tuple(prefix))), params), np.float64)

    cells: dict[tuple, float] = {}

    def expand(seq, prob):
        if len(seq) == n_tokens:
            cells[tuple(seq)] = prob
            return
        p = probs(prompt + seq)
        for t in np.flatnonzero(p):
            expand(seq + [int(t)], prob * p[t])

    expand([], 1.0)
    assert len(cells) == 2 ** n_tokens and abs(sum(cells.values()) - 1) < 1e-5
    index = {seq: i for i, seq in enumerate(cells)}
    expected = np.array(list(cells.values()))
    oracle = SamplingOracle(prompt, model)
    spec_counts, plain_counts = np.zeros(len(cells)), np.zeros(len(cells))
    accepted, proposed = 0, 0
    for seed in range(draws):
        seeded = SamplingParams(temperature=1.0, top_k=2, seed=seed)
        r = speculate(model, oracle, prompt, n_tokens, seeded, [], 64, block_size=2)
        spec_counts[index[tuple(r.token_ids)]] += 1
        accepted += sum(r.speculative.accepted_per_round)
        proposed += sum(r.speculative.proposed_per_round)
        if seed % 2 == 0:
            plain_counts[index[tuple(plain(model, prompt, n_tokens, seeded, [], 64).token_ids)]] += 1
    assert 0.2 * proposed < accepted < 0.8 * proposed  # both acceptance and rejection ran often
    chi_square_ok(spec_counts, expected)
    chi_square_ok(plain_counts, expected)


def test_sampled_speculative_is_reproducible_with_a_seed(model):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    runs = [speculate(model, SamplingOracle(PROMPT, model), PROMPT, 12, params, [], 64).token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


# ------------------------------------------------------------------ schedulers


def test_fixed_scheduler_keeps_gamma():
    s = FixedScheduler()
    assert s.choose(7, None) == 7 and s.choose(3, np.array([0.01, 0.01, 0.01])) == 3
    assert not s.uses_confidence and make_scheduler("fixed").name == "fixed"


def test_threshold_cuts_at_the_first_survival_below():
    conf = np.array([0.9, 0.8, 0.5, 0.9, 0.9])  # survival 0.9, 0.72, 0.36, 0.324, 0.29
    for threshold, want in ((0.1, 5), (0.3, 4), (0.33, 3), (0.5, 2), (0.8, 1), (0.95, 0)):
        assert ThresholdScheduler(threshold, min_proposals=0).choose(5, conf) == want
    assert ThresholdScheduler(0.95).choose(5, conf) == 1  # at least one proposal by default
    assert ThresholdScheduler(0.5).choose(1, conf[:1]) == 1
    assert make_scheduler("threshold").threshold == 0.1 and make_scheduler("threshold", threshold=0.3).threshold == 0.3


def test_cost_scheduler_maximizes_tokens_per_second_and_stops_at_first_non_improvement():
    t_verify = [1.0, 1.1, 1.2, 1.3, 2.2, 2.25, 2.3, 2.35]  # a jump at 5 rows
    conf = np.ones(7)  # survival 1 everywhere: expected tokens 1 + l
    s = CostScheduler(draft_seconds=0.5, verify_seconds=t_verify, min_proposals=0)
    values = [(1 + l) / (0.5 + t_verify[l]) for l in range(8)]
    # l = 3 beats 4 (the jump), though 7 would beat 3: the scan stops at the first drop
    assert values[3] > values[4] and values[7] > values[3]
    assert s.choose(7, conf) == 3
    # a steep survival drop stops earlier
    conf = np.array([0.9, 0.9, 0.05, 1, 1, 1, 1])
    values = [(1 + np.cumprod(conf)[:l].sum()) / (0.5 + t_verify[l]) for l in range(8)]
    want = next(l for l in range(7) if values[l + 1] <= values[l])
    assert want == 2 and s.choose(7, conf) == 2
    # verifying nothing wins when even one proposal does not pay; the floor keeps one
    flat = CostScheduler(draft_seconds=0.0, verify_seconds=[1, 3, 5, 7, 9, 11, 13, 15], min_proposals=0)
    assert flat.choose(7, np.full(7, 0.5)) == 0
    assert CostScheduler(0.0, [1, 3, 5, 7, 9, 11, 13, 15]).choose(7, np.full(7, 0.5)) == 1
    assert flat.verify_time(10) == 19  # linear past the table
    with pytest.raises(RuntimeError, match="timings"):
        CostScheduler().choose(3, None)


def test_online_estimates_without_and_with_a_confidence_head():
    # without a head: per-position acceptance measured from the rounds
    s = ThresholdScheduler(0.3, decay=1.0)
    assert s.choose(4, None) == 4  # optimistic before any round
    for _ in range(20):
        s.update(4, 1, None)  # position 1 always accepted, position 2 never
    survival = s.survival(4, None)
    assert survival[0] == 1.0 and survival[1] == pytest.approx(1 / 21) and s.choose(4, None) == 1
    # with a head: raw survival scaled by observed / predicted survival per position
    c = CostScheduler(draft_seconds=0.1, verify_seconds=[1.0] * 8, decay=1.0)
    conf = np.full(4, 0.9)
    np.testing.assert_allclose(c.survival(4, conf), np.cumprod(conf))
    for _ in range(30):
        c.update(4, 4, conf)  # everything accepted: the head was pessimistic
    assert np.all(c.survival(4, conf) > np.cumprod(conf)) and np.all(c.survival(4, conf) <= 1)
    for _ in range(300):
        c.update(4, 0, conf)  # nothing accepted any more
    assert np.all(c.survival(4, conf) < 0.2 * np.cumprod(conf))


def test_forgetting_brings_unobserved_positions_back_to_the_prior():
    s = ThresholdScheduler(0.5)
    for _ in range(10):
        s.update(3, 0, None)
    assert s.choose(3, None) == 1
    before = s.survival(3, None)[1]
    for _ in range(200):
        s.update(1, 1, None)  # only position 1 is verified (and accepted)
    assert s.survival(3, None)[1] > before


def test_schedulers_in_the_loop_keep_greedy_output(model):
    reference = plain_greedy(model, PROMPT, 24)
    conf = [0.9, 0.9, 0.8, 0.5, 0.3, 0.3, 0.3]
    for scheduler in (ThresholdScheduler(0.3), CostScheduler(0.2, [1.0 + 0.05 * r for r in range(GAMMA + 1)])):
        oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at=4, confidence=conf)
        result = speculate(model, oracle, PROMPT, 24, GREEDY, [], 128, scheduler=scheduler)
        assert_same_greedy(model, PROMPT, result.token_ids, reference)
        assert max(result.speculative.proposed_per_round) < GAMMA  # the scheduler cut the block


def test_fallback_drafts_until_rounds_stop_paying_and_probes():
    fallback = Fallback(3.0)
    assert fallback.speculate()  # no round seen yet
    fallback.update(8)
    assert fallback.speculate()
    for _ in range(6):  # rounds of one token pull the average below 3 tokens per round
        fallback.update(1)
    assert fallback.tokens_per_round < 3.0
    choices = [fallback.speculate() for _ in range(Fallback.PROBE_EVERY + 1)]
    assert choices == [False] * Fallback.PROBE_EVERY + [True]  # a probe round after PROBE_EVERY plain ones
    fallback.update(1)  # the probe did not pay: the next one waits twice as long
    choices = [fallback.speculate() for _ in range(2 * Fallback.PROBE_EVERY + 1)]
    assert choices == [False] * 2 * Fallback.PROBE_EVERY + [True]
    for _ in range(8):  # probes that emit 8 tokens bring drafting back
        fallback.update(8)
    assert fallback.speculate() and fallback.speculate()
    with pytest.raises(ValueError, match="break-even"):
        Fallback(0.0)


def test_fallback_tells_ahead_whether_the_next_round_is_plain():
    fallback = Fallback(3.0)
    assert not fallback.plain_next()  # no round seen yet: the next one drafts
    fallback.update(1)
    for _ in range(2 * Fallback.PROBE_EVERY + 2):
        expected = fallback.plain_next()
        assert fallback.plain_next() == expected  # asking changes nothing
        assert fallback.speculate() == (not expected)
    fallback.update(8)
    assert not fallback.plain_next()


def test_measure_break_even_times_rounds_against_pipelined_plain_steps(model, monkeypatch):
    """Per round over per plain step, on a clock that only the decoder's work moves (a
    round takes 3 units, a plain step 1, except in the second trial, where a round takes
    9: the median ignores it): no wall-clock time, which belongs in benches."""
    now, trial_rounds = [0.0], []
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: now[0])
    real_round, real_plain = Rounds.round, Rounds.run_plain

    def round_(self, *args, **kwargs):
        out = real_round(self, *args, **kwargs)
        trial_rounds.append(1)
        now[0] += 9.0 if 3 < len(trial_rounds) <= 6 else 3.0  # rounds 4-6: the second trial's warm-up + 2
        return out

    def run_plain(self, steps, *args, **kwargs):
        out = real_plain(self, steps, *args, **kwargs)
        now[0] += float(steps)
        return out

    monkeypatch.setattr(Rounds, "round", round_)
    monkeypatch.setattr(Rounds, "run_plain", run_plain)
    drafter = ConstantDrafter()
    break_even = measure_break_even(model, drafter, 3, GREEDY, context=16, repeats=2, trials=3)
    assert break_even.steps == pytest.approx(3.0)
    assert break_even.trials == pytest.approx((3.0, 9.0, 3.0))
    # the scratch decoder's rows: the context, then per trial warm-up + 2 rounds of 1 token, 3 runs of PLAIN_RUN
    assert drafter.rows == 16 + 3 * (3 + 3 * PLAIN_RUN)


def test_serving_drafts_only_clearly_below_the_cut():
    """A round of 7 proposals emits at most 8 tokens: with the margin, a break-even of
    8.0 (the cut itself, where measurements swing across from start to start) decodes
    plainly, 7.0 drafts."""
    assert calibrate.round_pay_limit(7) == pytest.approx(7.2)
    assert calibrate.round_can_pay(7.0, 7) and not calibrate.round_can_pay(8.0, 7)


@pytest.mark.parametrize("error_at", [0, 3])
def test_fallback_rounds_keep_greedy_output_and_the_draft_context(model, error_at):
    reference = plain_greedy(model, PROMPT, 40)
    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at)
    rounds, decoders = [], []

    def on_round(result, decoder):
        fallback = decoder.fallback
        rounds.append(result.proposed)
        decoders.append(decoder)
        assert len(result.tokens) <= PLAIN_RUN or result.proposed > 0
        # plain rounds' rows wait in `unobserved` until the drafter next drafts
        assert len(oracle.committed) + sum(f.shape[0] for f in decoder.unobserved) == decoder.committed
        # a plain round followed by another leaves that round's first step queued (its row in the cache)
        queued = result.proposed == 0 and fallback.plain_next()
        assert (decoder.queued is not None) == queued
        assert decoder.cache.offset == decoder.committed + queued

    result = speculate(model, oracle, PROMPT, 40, GREEDY, [], 128, on_round=on_round,
                       break_even=100.0)  # drafting never pays: plain rounds with probes
    assert_same_greedy(model, PROMPT, result.token_ids, reference)
    decoders[-1].sync_drafter()
    assert len(oracle.committed) == decoders[-1].cache.offset and not decoders[-1].unobserved
    stats = result.speculative
    # every token after the prefill's came from a drafted round (a + 1) or a plain step
    assert stats.plain_rounds > 0 and stats.plain_rounds + sum(stats.accepted_per_round) + stats.rounds == 39
    drafted = [l for l in stats.proposed_per_round if l]  # stats keep the drafted rounds (and a last one-row one)
    assert rounds[0] == GAMMA and 1 <= len(drafted) <= 1 + 39 // Fallback.PROBE_EVERY
    assert stats.as_json()["plain_rounds"] == stats.plain_rounds


def test_queued_plain_steps_stop_at_the_context_and_leave_when_a_round_drafts(model):
    # plain rounds up to a full context: the queued step never takes a row past it
    reference = plain_greedy(model, PROMPT, 40, max_context=len(PROMPT) + 40)
    result = speculate(model, ConstantDrafter(), PROMPT, 100, GREEDY, [], len(PROMPT) + 40, break_even=100.0)
    assert result.token_ids == reference and result.finish_reason == "length"
    # a probe after queued plain rounds: the queued row is dropped before the draft, and the
    # drafter observes exactly the committed rows
    reference = plain_greedy(model, PROMPT, 60)
    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at=0)
    probes = []

    def on_round(result, decoder):
        if result.proposed:
            probes.append(decoder.cache.offset)
            assert decoder.queued is None and len(oracle.committed) == decoder.cache.offset

    result = speculate(model, oracle, PROMPT, 60, GREEDY, [], 128, on_round=on_round, break_even=100.0)
    assert_same_greedy(model, PROMPT, result.token_ids, reference)
    assert len(probes) >= 3  # the first round and probes after runs of queued plain rounds


def test_fallback_keeps_sampled_output_reproducible(model):
    outs = []
    for _ in range(2):
        params = SamplingParams(temperature=0.8, seed=7)
        result = speculate(model, ConstantDrafter(), PROMPT, 30, params, [], 128, break_even=100.0)
        assert result.speculative.plain_rounds > 0
        outs.append(result.token_ids)
    assert outs[0] == outs[1]


class ConstantDrafter:
    """Proposes token 0 everywhere (timing only)."""

    taps, max_proposals = TAPS, GAMMA + 1

    def start(self, max_context):
        self.rows = 0

    def observe(self, features):
        self.rows += features.shape[0]

    def propose(self, anchor, gamma, params, key):
        return Proposal(mx.zeros((gamma,), mx.int32), mx.zeros((gamma, 512)), None)

    def arrays(self):
        return []

    def snapshot(self):
        return None

    def restore(self, snapshot, rows):
        return False


def test_measure_costs(model):
    drafter = ConstantDrafter()
    t_draft, t_verify = measure_costs(model, drafter, 3, GREEDY, context=16, repeats=2)
    assert t_draft > 0 and len(t_verify) == 4 and all(t > 0 for t in t_verify)
    assert drafter.rows == 16
    # an uncalibrated cost scheduler is calibrated before the generation starts
    scheduler = CostScheduler()
    speculate(model, drafter, PROMPT, 3, GREEDY, [], 64, block_size=4, scheduler=scheduler)
    assert scheduler.calibrated and len(scheduler.verify_seconds) == 5


# ------------------------------------------------------------------ the CLI with an oracle drafter


def run_cli(capsys, argv, model, drafter):
    loaded = []

    def load_draft(source, target, dtype, quantization, local_files_only, revision=None):
        assert target is model and local_files_only is False
        loaded.append((source, dtype, quantization))
        return drafter

    code = main(argv, load=lambda pack, dtype: model, load_draft=load_draft)
    out, err = capsys.readouterr()
    return code, out, err, loaded


def test_cli_draft_json_and_stats_line(capsys, model, target_pack):
    reference = plain_greedy(model, PROMPT, 20)
    base = ["--model", str(target_pack), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "20",
            "--dtype", "float32"]
    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at=3)
    code, out, err, loaded = run_cli(capsys, [*base, "--json", "--draft", "D", "--draft-quantization", "none",
                                              "--draft-block-size", "5"], model, oracle)
    assert code == 0, err
    assert loaded == [("D", "float32", "none")]
    doc = json.loads(out)
    assert doc["token_ids"] == reference[:len(doc["token_ids"])] and doc["finish_reason"] in ("length", "stop")
    s = doc["stats"]
    assert s["rounds"] == len(s["accepted_per_round"]) and s["block_size"] == 5
    assert s["accepted_per_round"][0] == 3 and s["acceptance_length"] == pytest.approx(s["mean_accepted"] + 1)
    assert s["per_position_acceptance"][:4] == [1.0, 1.0, 1.0, 0.0]
    assert min(s["draft_seconds"], s["verify_seconds"], s["commit_seconds"]) > 0
    assert s["counters"]["spec_decode_num_draft_tokens_total"] == sum(s["proposed_per_round"])

    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at=None)
    code, out, err, loaded = run_cli(capsys, [*base, "--draft", "D", "--spec-sched", "threshold",
                                              "--spec-threshold", "0.2"], model, oracle)
    assert code == 0, err
    assert loaded == [("D", "float32", "auto")]
    assert "rounds: " in err and "acceptance length" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["--draft", "D", "--draft-block-size", "9"], "--draft-block-size must be at most 8"),
    (["--draft", "D", "--draft-block-size", "0"], "--draft-block-size must be at least 1"),
    (["--draft", "D", "--spec-threshold", "0.2"], "--spec-threshold only applies with --spec-sched threshold"),
    (["--draft", "D", "--spec-sched", "threshold", "--spec-threshold", "2"], "--spec-threshold must be in [0, 1]"),
    (["--spec-threshold", "0.2"], "--spec-threshold only applies with a draft (--draft)"),
])
def test_cli_draft_argument_errors(capsys, model, target_pack, argv, message):
    oracle = GreedyOracle(PROMPT, [1], model.args.vocab_size)
    code, out, err, _ = run_cli(capsys, ["--model", str(target_pack), "--prompt-ids", "1,2", *argv], model, oracle)
    assert code == 1 and out == "" and message in err and err.startswith("error: "), err


# ------------------------------------------------------------------ with the real draft (monolith.models.dspark)

DRAFT_FORMATS = ("deepspec", "deepspec-nvfp4", "speculators", "dflash")


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory):
    from monolith.synth import write_draft, write_target

    root = tmp_path_factory.mktemp("pair")
    target = write_target(root / "target")
    drafts = {fmt: write_draft(root / f"draft-{fmt}", target, format=fmt) for fmt in DRAFT_FORMATS}
    return build_pack(target, root / "target.pack", role="target"), drafts


@pytest.mark.parametrize("fmt", DRAFT_FORMATS)
def test_real_draft_greedy_speculative_equals_plain(real_pair, fmt, monkeypatch, tmp_path):
    from monolith.launch import load_drafter

    monkeypatch.setenv("MONOLITH_CACHE", str(tmp_path / "cache"))
    target_pack, drafts = real_pair
    model = load_model(target_pack, dtype="float32")
    drafter = load_drafter(drafts[fmt], model, dtype="float32")
    assert drafter.taps and drafter.max_proposals >= 1
    plain_out = plain(model, PROMPT, 24, GREEDY, [], 128)
    for scheduler in (FixedScheduler(), ThresholdScheduler(0.3)):
        spec = speculate(model, drafter, PROMPT, 24, GREEDY, [], 128, prefill_chunk_size=CHUNK,
                                    scheduler=scheduler)
        assert_same_greedy(model, PROMPT, spec.token_ids, plain_out.token_ids)
        assert spec.speculative.rounds >= 1
    # sampling runs through the draft's q and is reproducible with a seed
    params = SamplingParams(temperature=0.9, top_k=20, seed=7)
    runs = [speculate(model, drafter, PROMPT, 12, params, [], 128).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_real_draft_cli_json(real_pair, tmp_path):
    from monolith.models.dspark import load_draft  # noqa: F401 - the draft model must exist

    target_pack, drafts = real_pair
    ids = ",".join(map(str, PROMPT))
    env = {"MONOLITH_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}

    def cli(*extra):
        import os

        proc = subprocess.run([sys.executable, "-m", "monolith.generate", "--model", str(target_pack),
                               "--prompt-ids", ids, "--max-tokens", "16", "--dtype", "float32", "--json", *extra],
                              capture_output=True, text=True, env={**os.environ, **env}, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    plain = cli()
    spec = cli("--draft", str(drafts["deepspec"]), "--spec-sched", "cost")
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["rounds"] >= 1 and spec["stats"]["acceptance_length"] >= 1
