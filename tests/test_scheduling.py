"""Block schedulers, the fallback to plain steps and the calibration at start
(monolith.runtime.scheduler, calibrate): their rules on given confidences and timings,
and greedy output kept through them."""

from __future__ import annotations

import numpy as np
import pytest
from decoding import speculate
from oracles import GAMMA, GREEDY, PROMPT, ConstantDrafter, GreedyOracle, assert_same_greedy, plain_greedy

from monolith.runtime import calibrate
from monolith.runtime.calibrate import measure_break_even, measure_costs
from monolith.runtime.fallback import Fallback
from monolith.runtime.rounds import PLAIN_RUN, Rounds
from monolith.runtime.scheduler import (
    CostCurve,
    CostScheduler,
    FixedScheduler,
    StepCosts,
    ThresholdScheduler,
    make_scheduler,
)
from monolith.sampling import SamplingParams

# a round's cost in plain steps that only a round keeping all GAMMA proposals would pay
# (these drafters' rounds never do): plain rounds, with probes (a cost above GAMMA + 1
# tokens would run no probe at all)
NOT_PAYING = GAMMA + 0.5

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
                       break_even=NOT_PAYING)  # drafting does not pay: plain rounds with probes
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
    result = speculate(model, ConstantDrafter(), PROMPT, 100, GREEDY, [], len(PROMPT) + 40, break_even=NOT_PAYING)
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

    result = speculate(model, oracle, PROMPT, 60, GREEDY, [], 128, on_round=on_round, break_even=NOT_PAYING)
    assert_same_greedy(model, PROMPT, result.token_ids, reference)
    assert len(probes) >= 3  # the first round and probes after runs of queued plain rounds


def test_fallback_keeps_sampled_output_reproducible(model):
    """Sampled, the constant drafter's proposals (q = 0) are always accepted: a round
    cheap at the prompt's context drafts, and the curve makes rounds cost more than they
    can emit a few tokens later (plain rounds)."""
    outs = []
    curve = CostCurve(((len(PROMPT), 1.0), (len(PROMPT) + 10, 100.0)))
    for _ in range(2):
        params = SamplingParams(temperature=0.8, seed=7)
        result = speculate(model, ConstantDrafter(), PROMPT, 30, params, [], 128, break_even=curve)
        assert result.speculative.rounds and result.speculative.plain_rounds > 0
        outs.append(result.token_ids)
    assert outs[0] == outs[1]


def test_measure_costs(model):
    drafter = ConstantDrafter()
    t_draft, t_verify = measure_costs(model, drafter, 3, GREEDY, context=16, repeats=2)
    assert t_draft > 0 and len(t_verify) == 4 and all(t > 0 for t in t_verify)
    assert drafter.rows == 16
    # an uncalibrated cost scheduler is calibrated before the generation starts
    scheduler = CostScheduler()
    speculate(model, drafter, PROMPT, 3, GREEDY, [], 64, block_size=4, scheduler=scheduler)
    assert scheduler.calibrated and len(scheduler.verify_seconds) == 5


def test_the_fallback_break_even_follows_the_batch():
    """Next to peers, a drafted round pays when it raises the batch's aggregate tokens per
    second, (peers + E) / T(drafted) > (peers + 1) / T(plain): worked by hand for a
    compute-bound step (every row costs a row: the threshold stays the break-even) and a
    bandwidth-bound one (rows are free, the draft's own 0.5 is paid by the whole batch)."""
    compute = Fallback(8.0, StepCosts(one_row=1.0, per_row=1.0, per_sequence=0.0), gamma=7)
    assert compute.threshold() == 8.0
    assert compute.threshold((3, 3)) == pytest.approx(4 * 11 / 4 - 3)  # = 8
    bandwidth = Fallback(1.5, StepCosts(one_row=1.0, per_row=0.0, per_sequence=0.0), gamma=7)
    assert bandwidth.threshold() == 1.5
    assert bandwidth.threshold((3, 3)) == pytest.approx(4 * 1.5 / 1 - 3)  # = 3
    assert Fallback(1.5).threshold((3, 3)) == 1.5  # no costs: the same at any batch
    bandwidth.update(2)  # rounds emit 2 tokens
    assert bandwidth.speculate() and not bandwidth.speculate((3, 3))


def test_the_cost_scheduler_counts_the_peers_rows_and_tokens():
    """The block length maximizes (peers + expected tokens) / (T_draft + T_verify(peer
    rows + 1 + l)): checked against a direct scan of that formula. Plain peers (a token
    per row) shorten the block; peers whose rows emit little (a prefill chunk) lengthen it:
    rows added to an expensive step cost relatively little."""
    table = [1.0 + 0.5 * r for r in range(8)]  # T_verify(1..8): half a row per row
    scheduler = CostScheduler(0.2, table)
    for accepted in [3, 4, 2, 5, 3] * 4:  # survival falls off after the first few positions
        scheduler.update(7, accepted, None)
    survival = scheduler.survival(7, None)

    def best(others, rows):
        values = [(others + 1 + survival[:l].sum()) / (0.2 + scheduler.verify_time(rows + 1 + l)) for l in range(8)]
        return max(max(range(8), key=lambda l: (values[l], -l)), 1)

    chosen = {peers: scheduler.choose(7, None, peers) for peers in ((0, 0), (5, 5), (3, 40))}
    assert chosen == {peers: best(*peers) for peers in chosen}
    assert chosen[(5, 5)] < chosen[(0, 0)] < chosen[(3, 40)]


def test_measure_step_costs_splits_a_forward_into_rows_and_sequences(model, monkeypatch):
    """On a clock that only the forwards move (1 + 0.5 per extra row + 0.25 per extra
    sequence), the measured StepCosts are those numbers: no wall-clock time."""
    now = [0.0]
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: now[0])
    real = calibrate.run_forwards

    def run_forwards(requests):
        rows = sum(r.rows for r in requests)
        now[0] += 1 + 0.5 * (rows - 1) + 0.25 * (len(requests) - 1)
        return real(requests)

    monkeypatch.setattr(calibrate, "run_forwards", run_forwards)
    costs = calibrate.measure_step_costs(model, 4, rows=8, context=16, repeats=2)
    assert costs == StepCosts(1.0, 0.5, 0.25)
