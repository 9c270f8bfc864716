"""`--draft mtp`: the target's own MTP head as the drafter (runtime/mtp_drafter.py) on a
tiny synthetic target packed --with-mtp (float32).

Independent references: plain decoding (greedy speculative output equals it; sampled
output follows the target's own filtered distribution, chi-square), a fresh run of the
head over the whole committed sequence (each round's proposals are what the head gives
from exactly the committed rows), the same request served alone and on a cold engine
(batching, the prompt cache), the grammar's own masks (constrained output is legal and
equals the masked-argmax reference loop), and `generate --no-draft` (the CLI)."""

from __future__ import annotations

import functools
import json

import llguidance
import mlx.core as mx
import numpy as np
import pytest
from decoding import plain, speculate
from numeric import chi_square_ok, sequence_distribution
from oracles import NEAR_TIE

from monolith.engine_setup import load_engine
from monolith.generate import main
from monolith.model_flags import plan_model
from monolith.models import load_model, load_mtp
from monolith.models.qwen3_5 import FINAL_NORM_TAP
from monolith.pack import build_pack
from monolith.runtime.decoder import Decoder
from monolith.runtime.drafter import Forking, Guided
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.events import Finished, GenerationRequest
from monolith.runtime.generation import Generation
from monolith.runtime.grammar import Grammar, GrammarTokenizer
from monolith.runtime.mtp_drafter import MTPDrafter
from monolith.runtime.prompt_cache import PromptCache
from monolith.runtime.scheduler import CostScheduler
from monolith.runtime.session import Session
from monolith.sampling import SamplingParams, filtered_probs, mask_logits
from monolith.serve import build_parser as serve_parser
from monolith.synth import write_target
from monolith.tokenizer import load_tokenizer

PROMPTS = [[3, 17, 5, 9, 44, 12, 8, 1, 30], [100, 7], [5] * 20 + [61, 2, 90]]
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    """(model, head, pack) of the tiny target packed with its MTP head."""
    root = tmp_path_factory.mktemp("mtp-drafter")
    pack = build_pack(write_target(root / "ckpt"), root / "pack", role="target", with_mtp=True)
    model = load_model(pack, dtype="float32")
    return model, load_mtp(pack, model), pack


def test_the_mtp_drafter_is_a_forking_guided_drafter(mtp):
    drafter = MTPDrafter(mtp[1])
    assert isinstance(drafter, Forking) and isinstance(drafter, Guided)
    drafter.start(8)
    assert drafter.snapshot() is drafter.context and not drafter.restore(None, 3)


class Recording(MTPDrafter):
    """The MTP drafter, recording every round's anchor and greedy proposals."""

    def __init__(self, head):
        super().__init__(head)
        self.rounds = []

    def fork(self):
        return self  # one sequence at a time: the decoder's fork records here too

    def propose(self, anchor, gamma, params, key):
        rows = self.context.offset  # the anchor's position
        p = super().propose(anchor, gamma, params, key)
        self.rounds.append((rows, anchor, np.array(p.tokens).tolist()))
        return p


def reference_proposals(model, head, tokens: list[int], gamma: int) -> tuple[list[int], list[float]]:
    """The head's greedy chain after `tokens` (the last one the anchor) on fresh caches:
    (proposals, each step's top-1/top-2 margin)."""
    cache = model.make_cache(len(tokens) + 1)
    _, hidden = model(mx.array(tokens[:-1], dtype=mx.int32), cache, taps=[FINAL_NORM_TAP])
    steps = head.chain(hidden, tokens[1:], head.make_cache(len(tokens) + gamma), gamma)
    rows = [np.array(logits[-1]) for _, logits in steps]
    margins = [float(np.diff(np.sort(r)[-2:])[0]) for r in rows]
    return [int(np.argmax(r)) for r in rows], margins


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("mostly_plain", [False, True])  # plain rounds between probes: rows observed at once
def test_greedy_equals_plain_and_proposals_come_from_the_committed_rows(mtp, gamma, mostly_plain):
    model, head, _ = mtp
    break_even = gamma + 0.5 if mostly_plain else None  # only a round keeping every proposal pays: probes run
    for prompt in PROMPTS:
        want = plain(model, prompt, 24).token_ids
        drafter = Recording(head)
        got = speculate(model, drafter, prompt, 24, block_size=gamma, prefill_chunk_size=4,
                        break_even=break_even).token_ids
        assert got == want and drafter.rounds
        tokens = prompt + want
        for at, anchor, proposed in drafter.rounds:
            assert tokens[at] == anchor
            expected, margins = reference_proposals(model, head, tokens[:at + 1], len(proposed))
            for p, e, margin in zip(proposed, expected, margins):
                assert p == e or margin < NEAR_TIE
                if p != e:
                    break


@functools.cache
def _target_probs(model, prefix: tuple, params: SamplingParams) -> np.ndarray:
    logits = model(mx.array(prefix, dtype=mx.int32), model.make_cache(len(prefix) + 1))[0][-1]
    return np.array(filtered_probs(logits, params), np.float64)


def test_sampled_output_follows_the_target_distribution(mtp):
    """Chi-square of 4-token outputs over many seeds against the exact distribution of
    plain sampling (the product of the target's filtered next-token probabilities). The
    synthetic head's top 2 seldom meet the target's, so its proposals are mostly rejected
    here (the residual draws); test_speculative.py's oracles run the accepting branch."""
    model, head, _ = mtp
    params, prompt, n_tokens, draws = SamplingParams(temperature=1.0, top_k=2), PROMPTS[0][:5], 4, 300
    cells = sequence_distribution(lambda seq: _target_probs(model, tuple(prompt + seq), params), n_tokens)
    index = {seq: i for i, seq in enumerate(cells)}
    counts, proposed = np.zeros(len(cells)), 0
    drafter = MTPDrafter(head)
    for seed in range(draws):
        r = speculate(model, drafter, prompt, n_tokens, SamplingParams(temperature=1.0, top_k=2, seed=seed),
                      block_size=2)
        counts[index[tuple(r.token_ids)]] += 1
        proposed += sum(r.speculative.proposed_per_round)
    assert proposed > draws  # the drafter proposed round after round
    chi_square_ok(counts, np.array(list(cells.values())))


def test_batched_equals_alone(mtp):
    model, head, pack = mtp
    tok = load_tokenizer(pack)
    dec = Decoder(model, MTPDrafter(head), 256, prefill_chunk_size=8, gamma=3)
    requests = [GenerationRequest(tuple(p), max_tokens=n) for p, n in zip(PROMPTS, (20, 14, 9))]
    alone = Engine(model, tok, Limits(max_context=256, max_batch=1), decoder=dec)
    try:
        want = [alone.run_request(r, Session())[1].token_ids for r in requests]
    finally:
        alone.close()
    batched = Engine(model, tok, Limits(max_context=256, max_batch=3), decoder=dec)
    finished = [[] for _ in requests]
    try:
        jobs = [batched.submit(r, lambda e, out=out: out.append(e) if isinstance(e, Finished) else None)
                for r, out in zip(requests, finished)]
        assert all(job.done.wait(300) for job in jobs)
    finally:
        batched.close()
    assert [out[0].token_ids for out in finished] == want


def test_prompt_cache_warm_equals_cold(mtp):
    """The MTP drafter's context resumes from the prompt cache: a conversation's second
    turn on its session, and another session sharing a prefix (loaded from the cache's
    saved rows), give what a cold engine gives, having resumed cached tokens."""
    model, head, pack = mtp
    tok = load_tokenizer(pack)

    def engine(cache):
        dec = Decoder(model, MTPDrafter(head), 256, prefill_chunk_size=4, gamma=3)
        return Engine(model, tok, Limits(max_context=256), decoder=dec, prompt_cache=cache)

    warm = engine(PromptCache(64 << 20, 4))
    try:
        session = warm.new_session()
        reply = warm.run_request(GenerationRequest(tuple(PROMPTS[2]), max_tokens=10), session)[1].token_ids
        requests = [GenerationRequest(tuple(PROMPTS[2] + list(reply) + [7, 8, 9]), max_tokens=12),
                    GenerationRequest(tuple(PROMPTS[2][:17] + [40, 41]), max_tokens=12)]
        got = [warm.run_request(requests[0], session)[1], warm.run_request(requests[1], warm.new_session())[1]]
    finally:
        warm.close()
    assert all(f.usage.cached_tokens > 0 for f in got)
    cold = engine(None)
    try:
        want = [cold.run_request(r, Session())[1].token_ids for r in requests]
    finally:
        cold.close()
    assert [f.token_ids for f in got] == want


def test_greedy_under_a_grammar_equals_the_masked_reference(mtp):
    model, head, pack = mtp
    tok = load_tokenizer(pack)
    gt = GrammarTokenizer.of(tok, model.args.vocab_size)
    grammar = Grammar(llguidance.LLMatcher.grammar_from_lark('start: ("ab" | "cd" | "ef")+ " " /[0-9]{2,6}/'))
    prompt = PROMPTS[0]
    stops = frozenset(tok.eos_token_ids)
    guide, want = gt.guide(grammar), []
    while len(want) < 30:  # the reference: argmax over the allowed tokens, by full forwards
        logits = model(mx.array(prompt + want, dtype=mx.int32), model.make_cache(len(prompt) + len(want) + 1))[0]
        token = int(mx.argmax(mask_logits(logits[-1], guide.words())).item())
        if token in stops:
            break
        want.append(token)
        guide.push(token)
    dec = Decoder(model, MTPDrafter(head), 256, gamma=3)
    got = dec(Generation(prompt, 30, GREEDY, stops, guide=gt.guide(grammar)))
    assert got.token_ids == want
    sampled = dec(Generation(prompt, 30, SamplingParams(temperature=1.0, seed=2), stops, guide=gt.guide(grammar)))
    replay = gt.guide(grammar)
    for t in sampled.token_ids:  # each sampled token legal where it stands
        assert (int(replay.words()[t // 32]) >> (t % 32)) & 1
        replay.push(t)


def test_generate_draft_mtp_equals_no_draft(mtp, capsys):
    _, _, pack = mtp
    base = ["--model", str(pack), "--prompt-ids", "3,17,5,9", "--max-tokens", "16", "--dtype", "float32", "--json"]
    outs = []
    for flags in (["--draft", "mtp", "--draft-block-size", "4"], ["--no-draft"]):
        assert main(base + flags) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["token_ids"] == outs[1]["token_ids"]
    assert outs[0]["stats"]["proposed_per_round"] and outs[0]["stats"]["block_size"] == 4  # it drafted


def test_draft_mtp_errors(mtp, tmp_path, capsys):
    _, _, pack = mtp
    plain_pack = build_pack(write_target(tmp_path / "ckpt"), tmp_path / "plain", role="target")
    cases = [
        (["--model", str(pack), "--draft", "mtp", "--draft-quantization", "none"],
         "--draft-quantization does not apply to --draft mtp"),
        (["--model", str(pack), "--draft", "mtp", "--draft-revision", "main"], "--draft-revision does not apply"),
        (["--model", str(plain_pack), "--draft", "mtp"], "the pack has no MTP head"),
    ]
    for flags, needle in cases:
        assert main([*flags, "--prompt-ids", "1,2", "--max-tokens", "2"]) == 1
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err


def test_the_cost_model_counts_one_head_forward_per_proposal(mtp):
    """k MTP proposals cost k head forwards (a DSpark block costs one): the cost
    scheduler, calibrated on the MTP drafter, prices each proposal, and a round drafts
    only the proposals it verifies; the output stays plain's."""
    model, head, _ = mtp
    block, sequential = CostScheduler(max_positions=8), CostScheduler(max_positions=8)
    block.set_costs(8.0, [1.0] * 9)
    sequential.set_costs(8.0, [1.0] * 9, proposals=4)  # 2 s a proposal
    assert block.choose(4, None) == 4 and sequential.choose(4, None) == 1
    calibrated = Decoder(model, MTPDrafter(head), 128, gamma=4, scheduler=CostScheduler(max_positions=8))
    assert calibrated.scheduler.draft_seconds == 0 and calibrated.scheduler.draft_step_seconds > 0
    drafter = Recording(head)
    got = speculate(model, drafter, PROMPTS[0], 16, block_size=4, scheduler=sequential).token_ids
    assert got == plain(model, PROMPTS[0], 16).token_ids
    assert drafter.rounds and all(len(proposed) == 1 for _, _, proposed in drafter.rounds)


def test_serve_loads_draft_mtp_with_its_break_even(mtp):
    """serve's flags with --draft mtp: the break-even is measured on MTP rounds (and the
    batch's costs), and a request gives plain's output."""
    model, _, pack = mtp
    args = serve_parser().parse_args(["--model", str(pack), "--draft", "mtp", "--dtype", "float32",
                                      "--max-context", "256", "--max-batch", "2", "--no-warmup"])
    logged = []
    engine = load_engine(args, plan_model(args), logged.append, max_batch=2)
    try:
        finished = engine.run_request(GenerationRequest(tuple(PROMPTS[0]), max_tokens=12), engine.new_session())[1]
    finally:
        engine.close()
    assert any("a drafted round costs" in line for line in logged)
    assert list(finished.token_ids) == plain(model, PROMPTS[0], 12).token_ids
