"""Drafting chosen per request as the context grows (docs/drafts.md 4.2): a round is
priced at the sequence's context (an injected CostCurve: no wall-clock time) and the
request's own tokens per round; a short request drafts, a long one decodes plainly, one
whose acceptance collapses falls back mid-generation (and a probe brings drafting
back), every output that of plain greedy decoding; each switch is in the request's
stats, the chat reply's `monolith.stats` and /metrics."""

from __future__ import annotations

import argparse

import pytest
from decoding import speculate
from oracles import GAMMA, GREEDY, PROMPT, ConstantDrafter, GreedyOracle, assert_same_greedy, plain_greedy
from serving_rig import MAX_CONTEXT, NAME, Server, expected

from monolith import engine_setup
from monolith.runtime import calibrate
from monolith.runtime.calibrate import BreakEven, curve_contexts, measure_cost_curve
from monolith.runtime.decoder import Decoder
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.fallback import Fallback, Switch
from monolith.runtime.scheduler import CostCurve, CostScheduler

SHORT = 40  # rounds cost 3 plain steps up to 40 rows of context, then more than a round can emit (8) from 43 on
CURVE = CostCurve(((0, 3.0), (SHORT, 3.0), (SHORT + 8, 20.0)))
LONG_PROMPT = PROMPT * 6  # 66 tokens: past SHORT + 8


class CollapsingOracle(GreedyOracle):
    """The target's greedy continuation, except while `bad(committed rows)`: then every
    proposal's first token is wrong (a round emits 1 token)."""

    def __init__(self, prompt, reference, vocab, bad):
        super().__init__(prompt, reference, vocab)
        self.bad = bad

    def propose(self, anchor, gamma, params, key):
        self.error_at = 0 if self.bad(len(self.committed)) else None
        return super().propose(anchor, gamma, params, key)


def run(model, drafter, prompt, n, curve=CURVE):
    result = speculate(model, drafter, prompt, n, GREEDY, [], 128, block_size=GAMMA, break_even=curve)
    return result, result.speculative


# ------------------------------------------------------------------ the cost curve


def test_the_cost_curve_is_linear_between_its_points_and_assumes_no_fall_past_them():
    curve = CostCurve(((64, 2.0), (2048, 4.0), (8192, 7.0)))
    assert curve.at(0) == curve.at(64) == 2.0
    assert curve.at(1056) == pytest.approx(3.0) and curve.at(5120) == pytest.approx(5.5)
    assert curve.at(8192 + 6144) == pytest.approx(10.0)  # a rise goes on at the last slope
    falling = CostCurve(((64, 5.0), (2048, 4.0)))
    assert falling.at(100_000) == 4.0  # a fall is held at the last point
    assert CostCurve.flat(3.5).at(10**6) == 3.5
    for bad in ((), ((10, 1.0), (10, 2.0)), ((10, 1.0), (5, 2.0)), ((0, -1.0),)):
        with pytest.raises(ValueError, match="cost curve"):
            CostCurve(bad)
    with pytest.raises(ValueError, match="break-even"):
        Fallback(CostCurve(((0, 1.0), (10, 0.0))))


def test_the_start_prices_a_round_at_the_contexts_a_request_reaches(model, monkeypatch):
    assert curve_contexts(256) == (64,) and curve_contexts(4096) == (64, 2048)
    assert curve_contexts(32768) == (64, 2048, 8192)
    measured = []

    def break_even(model, drafter, gamma, params, context=64):
        measured.append(context)
        return BreakEven(1.0 + context / 1024, (1.0,))

    monkeypatch.setattr(calibrate, "measure_break_even", break_even)
    curve = measure_cost_curve(model, ConstantDrafter(), GAMMA, GREEDY, 32768, first=BreakEven(1.5, (1.5,)))
    assert measured == [2048, 8192]  # the short context's figure was given
    assert curve.points == ((64, 1.5), (2048, 3.0), (8192, 9.0))


@pytest.mark.parametrize(("short_cost", "contexts"), [(9.0, [64]), (3.0, [64, 2048])])
def test_a_start_measures_the_longer_contexts_only_where_drafting_pays(model, monkeypatch, short_cost, contexts):
    """On this CPU a round cannot pay at a short context: the start decodes plainly and
    measures nothing more (its start-up stays as cheap as before)."""
    measured = []

    def break_even(model, drafter, gamma, params, context=64):
        measured.append(context)
        return BreakEven(short_cost if context == 64 else 5.0, (short_cost,))

    monkeypatch.setattr(calibrate, "measure_break_even", break_even)
    monkeypatch.setattr(engine_setup, "measure_break_even", break_even)
    flags = argparse.Namespace(draft_block_size=GAMMA, spec_sched=None, spec_threshold=None, max_context=4096,
                               prefill_chunk_size=512)
    decoder, _ = engine_setup.drafting_decoder(flags, model, ConstantDrafter(), lambda line: None)
    assert measured == contexts
    if short_cost > GAMMA:
        assert decoder is None
    else:
        assert decoder.cost_curve.points == ((64, 3.0), (2048, 5.0)) and decoder.break_even == 3.0


def test_the_cost_schedulers_block_follows_the_context():
    """Timings at two contexts: verify rows cost little at 64 rows of context and much at
    2048 (attention over the context): the block is long for a short sequence, short for
    a long one, and in between each time is linear in the context."""
    scheduler = CostScheduler(min_proposals=0)
    scheduler.set_costs(0.1, [1.0 + 0.01 * r for r in range(GAMMA + 1)], context=64)
    scheduler.add_costs(2048, 0.1, [1.0 + 1.0 * r for r in range(GAMMA + 1)])
    for _ in range(10):
        scheduler.update(GAMMA, 3, None)  # survival falls off after 3 positions
    assert scheduler.verify_time(3, 1056) == pytest.approx((1.02 + 3.0) / 2)
    assert scheduler.choose(GAMMA, None, context=64) > scheduler.choose(GAMMA, None, context=2048)
    with pytest.raises(ValueError, match="after"):
        scheduler.add_costs(1024, 0.1, [1.0] * 8)


# ------------------------------------------------------------------ the fallback's switches


def test_switches_say_why():
    fallback = Fallback(CURVE, gamma=GAMMA)
    assert fallback.speculate(context=11) and fallback.switch is None  # a round pays here even before any
    fallback.update(8)
    assert not fallback.speculate(context=SHORT + 4)  # 8 tokens a round, but rounds cost more here
    switch = fallback.switch
    assert (switch.to, switch.reason, switch.context) == ("plain", "cost", SHORT + 4)
    assert switch.cost > GAMMA + 1 and switch.expected == 8.0
    assert switch.describe().startswith(f"context {SHORT + 4}: a round costs")
    assert fallback.plain_next(SHORT + 50) and not fallback.speculate(context=SHORT + 50)
    # no probe where no round can pay: plain for good
    assert not any(fallback.speculate(context=SHORT + 60) for _ in range(3 * Fallback.MAX_PROBE_EVERY))
    # acceptance collapses at a context where rounds pay
    fallback = Fallback(CURVE, gamma=GAMMA)
    fallback.speculate(context=11)
    fallback.update(8)
    for _ in range(5):
        fallback.speculate(context=12)
        fallback.update(1)
    assert fallback.switch is not None and (fallback.switch.to, fallback.switch.reason) == ("plain", "acceptance")
    assert Switch(5, "draft", "probe", 3.0, 4.2).as_json()["detail"].startswith("context 5: a probe lifted")


# ------------------------------------------------------------------ requests


def test_a_short_request_drafts(model):
    reference = plain_greedy(model, PROMPT, 24)
    result, stats = run(model, GreedyOracle(PROMPT, reference, model.args.vocab_size), PROMPT, 24)
    assert_same_greedy(model, PROMPT, result.token_ids, reference)
    assert stats.rounds >= 3 and stats.plain_rounds == 0 and stats.switches == []


def test_a_long_request_decodes_plainly(model):
    reference = plain_greedy(model, LONG_PROMPT, 24)
    oracle = GreedyOracle(LONG_PROMPT, reference, model.args.vocab_size)
    result, stats = run(model, oracle, LONG_PROMPT, 24)
    assert result.token_ids == reference  # plain steps only: plain decoding's own
    assert stats.rounds == 0 and oracle.gammas == [] and stats.plain_rounds == 23  # the first token is the prefill's
    [switch] = stats.switches
    assert (switch.context, switch.to, switch.reason) == (len(LONG_PROMPT), "plain", "cost")


def test_a_request_that_grows_long_stops_drafting(model):
    reference = plain_greedy(model, PROMPT, 60)
    result, stats = run(model, GreedyOracle(PROMPT, reference, model.args.vocab_size), PROMPT, 60)
    assert_same_greedy(model, PROMPT, result.token_ids, reference)
    [switch] = stats.switches
    assert (switch.to, switch.reason) == ("plain", "cost") and SHORT < switch.context <= SHORT + 8
    assert stats.rounds == 4 and stats.accepted_per_round == [GAMMA] * 4  # contexts 11, 19, 27, 35
    assert stats.plain_rounds == 60 - 1 - 4 * (GAMMA + 1)


def test_a_request_whose_acceptance_collapses_falls_back_and_a_probe_brings_drafting_back(model):
    """Rounds emit 8 tokens up to 30 rows, 1 from 30 to 60 (the drafter no longer fits
    the text), 8 again after: the request drafts, falls back mid-generation for its
    acceptance, and a probe that pays switches drafting back on."""
    n, curve = 100, CostCurve.flat(3.0)
    reference = plain_greedy(model, PROMPT, n, max_context=128)
    oracle = CollapsingOracle(PROMPT, reference, model.args.vocab_size, bad=lambda rows: 30 <= rows < 60)
    result, stats = run(model, oracle, PROMPT, n, curve)
    assert_same_greedy(model, PROMPT, result.token_ids, reference)
    assert [(s.to, s.reason) for s in stats.switches] == [("plain", "acceptance"), ("draft", "probe")]
    fell, back = stats.switches
    assert 30 < fell.context < 60 <= back.context and fell.expected < 3.0 <= back.expected
    assert stats.plain_rounds > 0 and stats.accepted_per_round.count(GAMMA) >= 5  # 3 before, more after
    json = stats.as_json()
    assert json["plain_rounds"] == stats.plain_rounds and [s["reason"] for s in json["switches"]] == [
        "acceptance", "probe"]


# ------------------------------------------------------------------ serving


def test_the_reply_stats_and_metrics_count_plain_rounds_and_switches(model, tok):
    messages = [{"role": "user", "content": "Hello there"}]
    prompt = tok.encode_chat(messages)
    n = 24
    oracle = GreedyOracle(prompt, plain_greedy(model, prompt, n + GAMMA + 1), model.args.vocab_size)
    curve = CostCurve(((len(prompt), 3.0), (len(prompt) + 10, 20.0)))  # the first round drafts, then too dear
    decoder = Decoder(model, oracle, MAX_CONTEXT, gamma=GAMMA, break_even=curve)
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=decoder)) as s:
        s.wait_ready()
        r = s.post("/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": n,
                                            "temperature": 0, "monolith": {"spec": True}})
        body = r.json()
        assert body["choices"][0]["message"]["content"] == expected(model, tok, prompt, n)[1]
        stats = body["monolith"]["stats"]
        assert stats["rounds"] == 1 and stats["plain_rounds"] == n - 1 - (GAMMA + 1)
        [switch] = stats["switches"]
        assert (switch["to"], switch["reason"], switch["context"]) == ("plain", "cost", len(prompt) + GAMMA + 1)
        assert switch["detail"].startswith(f"context {len(prompt) + GAMMA + 1}: a round costs")
        assert s.metric("monolith_spec_plain_rounds_total") == stats["plain_rounds"]
        assert s.metric('monolith_spec_switches_total{reason="cost",to="plain"}') == 1
        assert s.metric('monolith_spec_switches_total{reason="acceptance",to="plain"}') == 0
        assert s.metric("spec_decode_num_drafts_total") == 1
