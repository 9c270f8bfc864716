"""Speculative decoding (monolith.runtime.rounds, speculative, accept, drafter, stats):
oracle drafters make every accepted length and commit path run, and greedy speculative
output must equal plain greedy output token for token (float32, the tiny synthetic
target's peaked lm_head; a parting is reported with its top-1/top-2 margin); after
every round the cache equals a plain forward over the committed tokens; sampled output
follows the target's distribution (chi-square)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from decoding import plain, speculate
from numeric import chi_square_ok, rel, sequence_distribution
from oracles import (
    CHUNK,
    GAMMA,
    GREEDY,
    PROMPT,
    STATE_TOL,
    TAPS,
    GreedyOracle,
    SequenceTracker,
    assert_same_greedy,
    forward_all,
    plain_greedy,
)

from monolith.models.cache import GDNState, KVCache
from monolith.runtime.accept import accept_greedy, accept_sampled
from monolith.runtime.decoder import Decoder
from monolith.runtime.draft_model import DraftModelDrafter
from monolith.runtime.drafter import Drafter, Forking, Guided, Proposal
from monolith.runtime.events import ContextLengthError
from monolith.runtime.generation import Generation, Tokens
from monolith.runtime.rounds import Rounds
from monolith.runtime.stats import SpecStats
from monolith.sampling import SamplingParams, filtered_probs


def test_oracles_are_drafters():
    oracle = GreedyOracle([1], [2], 8)
    assert isinstance(oracle, Drafter)
    assert not isinstance(oracle, Forking) and not isinstance(oracle, Guided)  # one sequence at a time, no grammar


def test_the_draft_model_drafter_forks_and_proposes_under_a_grammar():
    drafter = DraftModelDrafter(SimpleNamespace(taps=[1, 2], max_proposals=4))  # reads only these two at once
    assert isinstance(drafter, Forking) and isinstance(drafter, Guided)
    assert isinstance(drafter.fork(), Drafter)


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
    decoder = Rounds(model, oracle, Generation(params=GREEDY), 64, 4)
    decoder.profile = True
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
        Decoder(model, oracle, 64, gamma=9)


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

    cells = sequence_distribution(lambda seq: probs(prompt + seq), n_tokens)
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


@pytest.mark.parametrize(("error_at", "break_even"), [(None, None), (0, None), (3, None), (3, 7.5)])
def test_logprobs_with_a_draft_equal_plain(model, error_at, break_even):
    """The logprobs of every emitted token (accepted, corrected, bonus, and, with a
    fallback where rounds of 4 tokens do not pay, plain rounds) come from the target's rows: they equal plain
    decoding's, top tokens included."""
    from monolith.runtime.decoder import Decoder

    max_context = len(PROMPT) + 30
    reference = plain_greedy(model, PROMPT, 30, max_context)

    def run(decoder):
        seen = []
        out = decoder(Generation(PROMPT, 30, GREEDY, logprobs=3,
                                 emitter=Tokens(lambda token, lp: seen.append(lp) or True)))
        return out, seen

    want, want_lps = run(Decoder(model, None, max_context, CHUNK))
    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at)
    decoder = Decoder(model, oracle, max_context, CHUNK, GAMMA, break_even=break_even)
    assert decoder.logprobs
    got, got_lps = run(decoder)
    assert got.token_ids == want.token_ids
    if break_even is None:
        assert got.speculative.rounds > 0
    else:
        assert got.speculative.plain_rounds > 0
    assert len(got_lps) == len(want_lps) == len(want.token_ids)
    for ours, theirs in zip(got_lps, want_lps):
        assert ours.token_id == theirs.token_id
        assert abs(ours.logprob - theirs.logprob) < 1e-4
        assert len(ours.top) == 3
        assert np.allclose([v for _, v in ours.top], [v for _, v in theirs.top], atol=1e-4)
        assert {t for t, _ in ours.top} == {t for t, _ in theirs.top}
