"""monolith.sampling: the filtered distribution against numpy and transformers'
logits warpers, sampling statistics, seeded reproducibility, parameter validation."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from monolith.sampling import (
    SamplingParams,
    filtered_logprobs,
    filtered_probs,
    key_chain,
    sample,
)

# temperature, top_p, top_k, min_p
CASES = [
    (1.0, 1.0, 0, 0.0),
    (0.7, 1.0, 0, 0.0),
    (1.3, 1.0, 5, 0.0),
    (1.0, 0.9, 0, 0.0),
    (0.5, 0.5, 0, 0.0),
    (1.0, 1.0, 0, 0.1),
    (0.8, 0.95, 20, 0.0),
    (1.0, 0.8, 10, 0.05),
    (1.5, 0.6, 0, 0.2),
    (2.0, 0.99, 40, 0.01),
    (1.0, 0.3, 3, 0.5),
    (0.6, 1.0, 64, 0.0),  # top_k == vocab: no-op
]


def random_logits(rows=8, vocab=64, seed=0, scale=3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


def numpy_filtered_probs(logits: np.ndarray, temperature, top_p, top_k, min_p) -> np.ndarray:
    """Straightforward float64 reference, one row at a time, by sorted rank."""
    out = np.zeros(logits.shape, np.float64)
    for r, row in enumerate(logits.astype(np.float64)):
        if temperature == 0:
            out[r, np.argmax(row)] = 1.0
            continue
        x = row / temperature
        alive = np.ones(x.shape, bool)
        if 0 < top_k < x.size:
            alive &= x >= np.sort(x)[::-1][top_k - 1]
        if top_p < 1:
            p = np.where(alive, np.exp(x - x[alive].max()), 0.0)
            p /= p.sum()
            order = np.argsort(-p, kind="stable")
            n_keep = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1  # smallest prefix with mass >= top_p
            keep = np.zeros(x.shape, bool)
            keep[order[:n_keep]] = True
            alive &= keep
        if min_p > 0:
            p = np.where(alive, np.exp(x - x[alive].max()), 0.0)
            alive &= p >= min_p * p.max()
        p = np.where(alive, np.exp(x - x[alive].max()), 0.0)
        out[r] = p / p.sum()
    return out


def transformers_filtered_probs(logits: np.ndarray, temperature, top_p, top_k, min_p) -> np.ndarray:
    """The same distribution through transformers' warpers, in generate()'s order."""
    import torch
    from transformers import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = torch.from_numpy(logits.copy())
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0:
        warpers.append(MinPLogitsWarper(min_p))
    for w in warpers:
        scores = w(ids, scores)
    return torch.softmax(scores, dim=-1).numpy()


def ours(logits: np.ndarray, *case) -> np.ndarray:
    t, p, k, m = case
    return np.array(filtered_probs(mx.array(logits), SamplingParams(t, p, k, m)))


# ------------------------------------------------------------------ the filtered distribution


@pytest.mark.parametrize("case", CASES)
def test_filtered_probs_match_numpy_reference(case):
    logits = random_logits(seed=hash(case) % 1000)
    got, want = ours(logits, *case), numpy_filtered_probs(logits, *case)
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_filtered_probs_match_transformers_warpers(case):
    logits = random_logits(seed=1 + hash(case) % 1000)
    got, want = ours(logits, *case), transformers_filtered_probs(logits, *case)
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_filtered_logprobs_is_log_of_filtered_probs():
    logits = mx.array(random_logits())
    params = SamplingParams(0.9, 0.8, 12, 0.05)
    lp = np.array(filtered_logprobs(logits, params))
    p = np.array(filtered_probs(logits, params))
    assert np.all(np.isneginf(lp) == (p == 0))
    np.testing.assert_allclose(np.exp(lp), p, atol=1e-6)


def test_filtered_probs_work_on_any_batch_shape():
    logits = random_logits(rows=6)
    params = SamplingParams(1.1, 0.9, 7, 0.02)
    flat = np.array(filtered_probs(mx.array(logits), params))
    batched = np.array(filtered_probs(mx.array(logits.reshape(2, 3, -1)), params))
    single = np.array(filtered_probs(mx.array(logits[4]), params))
    np.testing.assert_allclose(batched.reshape(6, -1), flat, atol=1e-7)
    np.testing.assert_allclose(single, flat[4], atol=1e-7)


def test_greedy_is_one_hot_argmax():
    logits = random_logits(rows=16)
    p = np.array(filtered_probs(mx.array(logits), SamplingParams()))
    np.testing.assert_array_equal(p, np.eye(logits.shape[1])[logits.argmax(-1)])
    tokens = sample(mx.array(logits), SamplingParams(), None)
    assert tokens.dtype == mx.int32
    np.testing.assert_array_equal(np.array(tokens), logits.argmax(-1))
    np.testing.assert_array_equal(np.array(sample(mx.array(logits), SamplingParams(seed=5), None)), logits.argmax(-1))


def test_top_k_keeps_ties_with_the_kth_logit():
    logits = mx.array([[5.0, 3.0, 3.0, 1.0, 0.0]])
    p = np.array(filtered_probs(logits, SamplingParams(1.0, top_k=2)))[0]
    assert (p > 0).tolist() == [True, True, True, False, False]


def test_top_p_always_keeps_the_most_likely_token():
    logits = mx.array([[10.0, 0.0, -1.0, -2.0]])
    p = np.array(filtered_probs(logits, SamplingParams(1.0, top_p=1e-6)))[0]
    np.testing.assert_array_equal(p, [1.0, 0.0, 0.0, 0.0])


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = mx.array(np.log(probs)[None].astype(np.float32))

    def support(top_p):
        return int((np.array(filtered_probs(logits, SamplingParams(1.0, top_p=top_p)))[0] > 0).sum())

    assert [support(q) for q in (0.4, 0.51, 0.79, 0.81, 0.94, 0.96)] == [1, 2, 2, 3, 3, 4]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    probs = np.array([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = mx.array(np.log(probs)[None].astype(np.float32))
    p = np.array(filtered_probs(logits, SamplingParams(1.0, min_p=0.125)))[0]  # threshold 0.05
    np.testing.assert_allclose(p, np.array([0.4, 0.3, 0.2, 0.06, 0]) / 0.96, rtol=1e-5)


# ------------------------------------------------------------------ sampling


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    import torch

    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    half = lambda v: torch.tensor(v / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(half(dof), half(stat)))


@pytest.mark.parametrize("case", [(1.0, 1.0, 0, 0.0), (0.8, 0.9, 8, 0.05), (1.4, 0.95, 0, 0.0)])
def test_sampling_matches_the_filtered_distribution(case):
    draws = 20000
    logits = random_logits(rows=1, vocab=12, seed=7, scale=1.0)
    params = SamplingParams(*case, seed=11)
    probs = numpy_filtered_probs(logits, *case)[0]
    tokens = sample(mx.broadcast_to(mx.array(logits), (draws, 12)), params, next(key_chain(params.seed)))
    counts = np.bincount(np.array(tokens), minlength=12)
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a filtered-out token"
    assert support.sum() >= 3
    assert chi_square_p_value(counts[support], probs[support]) > 1e-3


def draw_sequence(seed, steps=40, params=None):
    table = mx.array(random_logits(rows=32, vocab=32, seed=3, scale=1.0))
    params = params or SamplingParams(1.0, seed=seed)
    keys = key_chain(params.seed)
    token, out = 0, []
    for _ in range(steps):
        token = sample(table[token], params, next(keys)).item()
        out.append(token)
    return out


def test_same_seed_same_sequence():
    assert draw_sequence(1234) == draw_sequence(1234)
    assert draw_sequence(1234) != draw_sequence(1235)
    filtered = SamplingParams(0.9, 0.9, 10, 0.02, seed=99)
    assert draw_sequence(None, params=filtered) == draw_sequence(None, params=filtered)


def test_unseeded_chains_differ():
    assert draw_sequence(None) != draw_sequence(None)


def test_sampling_needs_a_key():
    with pytest.raises(ValueError, match="key"):
        sample(mx.array(random_logits(rows=1)), SamplingParams(1.0), None)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_p": 1.0}, "min_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)


def test_valid_edges_are_accepted():
    SamplingParams(temperature=0, top_p=1, top_k=0, min_p=0, seed=0)
    SamplingParams(temperature=2.5, top_p=1e-9, top_k=10**6, min_p=0.999, seed=2**64 - 1)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.1).greedy
