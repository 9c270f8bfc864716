"""The drafter a start uses when it has several (monolith/drafter_choice.py): the
acceptance it measures against plain greedy decoding (oracle drafters built from it),
its rule on given figures, and serve's start on a synthetic target that carries an MTP
head beside a DSpark draft, with the round costs set (no wall-clock timing: that
belongs in bench/)."""

from __future__ import annotations

import pytest
from decoding import plain
from oracles import GAMMA, PROMPT, GreedyOracle, plain_greedy

from monolith import drafter_choice
from monolith.drafter_choice import Candidate, Measured, choose
from monolith.engine_setup import load_engine, resolve_sources
from monolith.model_flags import MTP_DRAFT, SetupError, plan_model
from monolith.pack import build_pack
from monolith.runtime.calibrate import BreakEven, measure_acceptance
from monolith.runtime.events import GenerationRequest
from monolith.runtime.mtp_drafter import MTPDrafter
from monolith.serve import build_parser
from monolith.synth import write_pair


@pytest.mark.parametrize("error_at", [0, 2, None])
def test_measure_acceptance_counts_what_plain_greedy_decoding_keeps(model, error_at):
    """An oracle that proposes the target's own greedy continuation, wrong at proposal
    `error_at`, gets exactly that many proposals accepted every round."""
    reference = plain_greedy(model, PROMPT, 60)
    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at)
    acceptance = measure_acceptance(model, oracle, GAMMA, [PROMPT], max_new=40)
    kept = GAMMA if error_at is None else error_at
    assert len(acceptance.accepted) >= 40 // (kept + 1) - 1 and set(acceptance.accepted) == {kept}
    assert acceptance.tokens() == kept + 1
    assert [acceptance.tokens(g) for g in (1, 3)] == [min(kept, 1) + 1, min(kept, 3) + 1]


def test_a_stop_token_ends_the_measured_run(model):
    reference = plain_greedy(model, PROMPT, 60)
    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size)
    acceptance = measure_acceptance(model, oracle, GAMMA, [PROMPT], max_new=40, stops=frozenset({reference[9]}))
    assert acceptance.accepted == (GAMMA, GAMMA)  # the second round emitted reference[8:16]


def figures(name, tokens, cost, gamma=7):
    return Measured(Candidate(name, None), gamma, BreakEven(cost, (cost,)), tokens)


def test_the_fastest_drafter_that_pays_is_chosen():
    slow, fast = figures("dspark", 3.0, 2.0), figures("mtp", 2.0, 0.9, gamma=2)
    assert slow.pays and fast.pays and choose([slow, fast]) is fast
    # a round costing 1.9 plain steps for 2.0 tokens would be 1.05x: inside the margin, plain decoding
    near = figures("dspark", 2.0, 1.9)
    assert near.speed > 1 and not near.pays and choose([near]) is None
    assert choose([]) is None


def test_a_sequential_drafters_proposals_a_round_are_chosen_by_expected_speed(model, monkeypatch):
    """An MTP-like drafter accepting 2 proposals a round, whose round costs 1 + 0.5 g
    plain steps at g proposals: 2 proposals are best (3 tokens for 2 steps); the costs at
    1 and 7 are measured, then the cost at 2 itself. A block drafter keeps its gamma."""
    asked = []

    def break_even(model, drafter, gamma, params):
        asked.append(gamma)
        return BreakEven(1 + 0.5 * gamma, (1 + 0.5 * gamma,))

    monkeypatch.setattr(drafter_choice, "measure_break_even", break_even)
    reference = plain_greedy(model, PROMPT, 60)
    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, 2)
    oracle.sequential = True
    measured = drafter_choice.measure(model, Candidate("mtp", oracle), GAMMA, [PROMPT], fixed_gamma=False)
    assert (measured.gamma, measured.cost.steps, measured.tokens, asked) == (2, 2.0, 3.0, [7, 1, 2])
    asked.clear()
    oracle.sequential = False
    measured = drafter_choice.measure(model, Candidate("dspark", oracle), GAMMA, [PROMPT], fixed_gamma=False)
    assert (measured.gamma, measured.tokens, asked) == (GAMMA, 3.0, [7])


def test_a_drafter_that_cannot_pay_even_accepting_everything_is_not_run(model, monkeypatch):
    """A round of 7 proposals costing 7.5 plain steps could emit at most 8 tokens: no
    acceptance would make it pay by the margin (7.2), so the prompts are not run."""
    monkeypatch.setattr(drafter_choice, "measure_break_even", lambda *a: BreakEven(7.5, (7.5,)))
    monkeypatch.setattr(drafter_choice, "measure_acceptance", lambda *a, **k: pytest.fail("acceptance measured"))
    measured = drafter_choice.measure(model, Candidate("dspark", None), GAMMA, [PROMPT])
    assert measured.tokens is None and not measured.pays and choose([measured]) is None
    assert "cannot pay even if it emitted all 8 tokens" in measured.describe()


# ------------------------------------------------------------------ serve's start


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    """(target pack with its MTP head, a DSpark draft's checkpoint) of the synthetic pair."""
    root = tmp_path_factory.mktemp("choice")
    target, draft = write_pair(root / "pair")
    return build_pack(target, root / "target.pack", role="target", with_mtp=True), draft


def start(pair, *flags, costs=None, monkeypatch=None):
    """(engine, log lines) of serve's start on the pair; `costs`: a round's cost in plain
    steps for the MTP head and for the DSpark draft (None: measured)."""
    pack, draft = pair
    if costs is not None:
        monkeypatch.setattr(drafter_choice, "measure_break_even", lambda model, drafter, gamma, params: BreakEven(
            c := costs[isinstance(drafter, MTPDrafter)], (c,)))
    quantization = ["--draft-quantization", "none"] if str(draft) in flags else []
    args = build_parser().parse_args(["--pack", str(pack), *quantization, "--dtype", "float32",
                                      "--max-context", "256", "--no-warmup", "--prompt-cache-size", "0", *flags])
    logs = []
    return load_engine(args, plan_model(args), logs.append), logs


@pytest.mark.parametrize("mtp_cost, dspark_cost, chosen", [(0.4, 0.8, MTP_DRAFT), (0.8, 0.4, "dspark"),
                                                           (5.0, 6.0, None)])
def test_serve_measures_each_drafter_and_uses_the_one_that_pays_best(mtp_pair, monkeypatch, mtp_cost, dspark_cost,
                                                                     chosen):
    engine, logs = start(mtp_pair, "--draft", str(mtp_pair[1]), "--draft", MTP_DRAFT,
                         costs={True: mtp_cost, False: dspark_cost}, monkeypatch=monkeypatch)
    try:
        [line] = [line for line in logs if line.startswith("drafters measured")]
        assert f"{mtp_pair[1]}: " in line and f"{MTP_DRAFT}: " in line and "plain decoding: 1.00x" in line
        if chosen is None:
            assert getattr(engine.decoder, "drafter", None) is None and engine.draft_name is None
            assert "none pays here" in line and "none pays here" in engine.not_drafting
            assert logs[[i for i, m in enumerate(logs) if m.startswith("decoding: ")][0]].startswith("decoding: plain (")
        else:
            name = MTP_DRAFT if chosen == MTP_DRAFT else str(mtp_pair[1])
            assert engine.draft_name == name and f"best: {name} (" in line
            assert f"decoding: drafting with {name} (measured to pay here)" in logs
            assert isinstance(engine.decoder.drafter, MTPDrafter) == (chosen == MTP_DRAFT)
            assert engine.decoder.break_even == min(mtp_cost, dspark_cost)
        finished = engine.run_request(GenerationRequest(tuple(PROMPT[:6]), max_tokens=10), engine.new_session())[1]
        want = plain(engine.model, PROMPT[:6], 10, stop_ids=engine.stop_ids).token_ids
        assert list(finished.token_ids) == want
        # a request may ask to be drafted whatever the choice (monolith.draft): the fastest
        # candidate where none pays; greedy output is the same, and its rounds draft
        assert engine.can_draft and engine.draft_decoder_name in (MTP_DRAFT, str(mtp_pair[1]))
        if chosen is None:
            assert engine.draft_decoder_name == MTP_DRAFT  # the cheaper round of the two
        drafted = engine.run_request(GenerationRequest(tuple(PROMPT[:6]), max_tokens=10, draft=True))[1]
        assert list(drafted.token_ids) == want and drafted.spec.drafts > 0
    finally:
        engine.close()


def test_one_draft_is_forced_and_nothing_is_measured_without_a_fallback(mtp_pair, monkeypatch):
    monkeypatch.setattr(drafter_choice, "measure_acceptance", lambda *a, **k: pytest.fail("measured"))
    engine, logs = start(mtp_pair, "--draft", MTP_DRAFT, "--spec-sched", "fixed")
    try:
        assert engine.draft_name == MTP_DRAFT and not any(line.startswith("drafters measured") for line in logs)
    finally:
        engine.close()
    engine, logs = start(mtp_pair, "--draft", str(mtp_pair[1]), "--draft", MTP_DRAFT, "--spec-sched", "fixed")
    try:  # a named scheduler always drafts: with the first drafter given
        assert engine.draft_name == str(mtp_pair[1])
        assert any("the first of 2 drafters" in line for line in logs)
    finally:
        engine.close()


def test_a_target_pack_with_an_mtp_head_offers_it_without_draft(mtp_pair, tmp_path):
    parser = build_parser()
    args = parser.parse_args(["--pack", str(mtp_pair[0])])
    assert resolve_sources(args, plan_model(args), lambda line: None).drafts == (MTP_DRAFT,)
    args = parser.parse_args(["--pack", str(mtp_pair[0]), "--no-draft"])
    assert resolve_sources(args, plan_model(args), lambda line: None).drafts == ()
    with pytest.raises(SetupError, match="names the same drafter twice"):
        plan_model(parser.parse_args(["--draft", "mtp", "--draft", "mtp"]))
    with pytest.raises(SetupError, match="--draft-pack is one draft's pack"):
        plan_model(parser.parse_args(["--draft", "a", "--draft", "b", "--draft-pack", str(tmp_path)]))
