"""Grammar-constrained decoding (runtime/grammar.py) on the demo pair: the output under
a grammar is distributed as plain constrained sampling, through speculation too (chi-
square against the exact distribution computed from the target's own rows and
llguidance's masks); forced tokens are emitted without sampling and without a draft
slot (jump-forward); greedy speculative == greedy plain == a reference loop of full
forwards; the constraint starts after </think>; Qwen3.5/3.6's XML tool calls."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import llguidance
import mlx.core as mx
import numpy as np
import pytest
from numeric import chi_square_ok

from monolith.runtime.decoder import Decoder
from monolith.runtime.generation import Generation, Tokens
from monolith.runtime.grammar import Grammar, GrammarTokenizer
from monolith.sampling import SamplingParams, filtered_probs, mask_logits
from monolith.serving import structured
from monolith.serving.tools.calls import parse_tool_calls
from monolith.serving.tools.specs import forced_calls

MAX_CONTEXT = 512


@pytest.fixture(scope="module")
def demo(demo_f32):
    model, drafter, tok = demo_f32
    return model, drafter, tok, GrammarTokenizer.of(tok, model.args.vocab_size)


def stops(tok):
    return frozenset(tok.eos_token_ids)


def lark(text: str) -> Grammar:
    return Grammar(llguidance.LLMatcher.grammar_from_lark(text))


def run(decoder, prompt, max_tokens, params, tok, guide):
    out = decoder(Generation(prompt, max_tokens, params, stops(tok), guide=guide))
    return out


def last_logits(model, tokens) -> mx.array:
    logits, _ = model(mx.array(tokens, dtype=mx.int32), model.make_cache(MAX_CONTEXT))
    return logits[-1]


def reference_greedy(model, tok, gt, grammar, prompt, max_tokens) -> list[int]:
    """Greedy constrained decoding by full forwards: argmax over the allowed tokens."""
    guide, out = gt.guide(grammar), []
    while len(out) < max_tokens:
        token = int(mx.argmax(mask_logits(last_logits(model, prompt + out), guide.words())).item())
        if token in stops(tok):
            break
        guide.push(token)
        out.append(token)
    return out


FORCED = "start: <[2005]> <[2006]> <[2007]> WORD\nWORD: /[a-e ]{1,40}/"


class CountingForwards:
    """The model, counting the decode forwards (those whose every row's logits are read)."""

    def __init__(self, model):
        self.model, self.decode_forwards = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, tokens, cache, taps=None, logits="all"):
        self.decode_forwards += logits == "all"
        return self.model.forward(tokens, cache, taps=taps, logits=logits)


def test_forced_tokens_jump_forward_and_greedy_equals_reference(demo):
    model, drafter, tok, gt = demo
    grammar = lark(FORCED)
    prompt = tok.encode_chat([{"role": "user", "content": "Write letters."}])
    want = reference_greedy(model, tok, gt, grammar, prompt, 24)
    assert want[:3] == [2005, 2006, 2007]
    counted = CountingForwards(model)
    plain = run(Decoder(counted, None, MAX_CONTEXT), prompt, 24, SamplingParams(), tok, gt.guide(grammar))
    assert plain.token_ids == want
    # the first token comes from the prefill; the two forced after it are verified with
    # it in one forward, which also gives the next; then a forward a token, the stop token
    # included (6 tokens and the stop: 4 forwards), none after the last when the budget ends it
    assert counted.decode_forwards == len(want) - 2 - (len(want) == 24)
    spec = run(Decoder(model, drafter, MAX_CONTEXT), prompt, 24, SamplingParams(), tok, gt.guide(grammar))
    assert spec.token_ids == want
    text = tok.decode(want[3:])
    assert set(text) <= set("abcde ")


def test_a_forced_position_costs_no_draft_slot(demo):
    model, drafter, tok, gt = demo
    guide = gt.guide(lark(FORCED))
    prompt = tok.encode_chat([{"role": "user", "content": "Write letters."}])
    drafter.start(MAX_CONTEXT)
    _, features = model.forward(mx.array(prompt, dtype=mx.int32), model.make_cache(MAX_CONTEXT), taps=drafter.taps)
    drafter.observe(features)
    proposal = drafter.propose_guided(int(prompt[-1]), 1, SamplingParams(), None, guide, limit=6)
    tokens = np.array(proposal.tokens).tolist()
    assert tokens[:3] == [2005, 2006, 2007] and len(tokens) == 4  # 3 forced + the one drafted (gamma 1)
    q = np.array(proposal.q)
    assert (q[np.arange(3), tokens[:3]] == 1).all() and (q[:3].sum(axis=1) == 1).all()
    assert len(guide.history) == 4
    guide.rollback(4)
    assert guide.forced() == 2005


def test_sampled_output_under_a_grammar_follows_plain_constrained_sampling(demo):
    """Chi-square of 3-token outputs over seeds, speculative (the real draft, proposals
    along the grammar) and plain, against the exact distribution: the product of the
    target's rows masked by the grammar and filtered (temperature 1, top-k 3)."""
    model, drafter, tok, gt = demo
    grammar = lark("start: <[2005]> WORD\nWORD: /[a-e ]{1,40}/")
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = tok.encode_chat([{"role": "user", "content": "Letters:"}])
    n_tokens = 3
    cells: dict[tuple, float] = {}

    def expand(seq, prob):
        if len(seq) == n_tokens or (seq and seq[-1] in stops(tok)):
            cells[tuple(t for t in seq if t not in stops(tok))] = prob
            return
        guide = gt.guide(grammar)
        for t in seq:
            guide.push(t)
        p = np.array(filtered_probs(mask_logits(last_logits(model, prompt + seq), guide.words()), params), np.float64)
        for t in np.flatnonzero(p):
            expand(seq + [int(t)], prob * p[t])

    expand([], 1.0)
    assert 3 <= len(cells) <= 9 and abs(sum(cells.values()) - 1) < 1e-5
    index = {seq: i for i, seq in enumerate(cells)}
    expected = np.array(list(cells.values()))
    spec_counts, plain_counts = np.zeros(len(cells)), np.zeros(len(cells))
    spec_decoder, plain_decoder = Decoder(model, drafter, MAX_CONTEXT), Decoder(model, None, MAX_CONTEXT)
    proposed = accepted = 0
    for seed in range(240):
        seeded = SamplingParams(temperature=1.0, top_k=3, seed=seed)
        r = run(spec_decoder, prompt, n_tokens, seeded, tok, gt.guide(grammar))
        spec_counts[index[tuple(r.token_ids)]] += 1
        proposed += sum(r.speculative.proposed_per_round)
        accepted += sum(r.speculative.accepted_per_round)
        if seed % 2 == 0:
            plain_counts[index[tuple(run(plain_decoder, prompt, n_tokens, seeded, tok, gt.guide(grammar)).token_ids)]] += 1
    assert 0 < accepted < proposed  # acceptance and rejection both ran
    chi_square_ok(spec_counts, expected)
    chi_square_ok(plain_counts, expected)


def test_the_constraint_starts_after_the_reasoning(demo):
    _, _, tok, gt = demo
    think_end = tok.token_to_id("</think>")
    form = structured.response_format({"type": "json_object"})
    grammar = structured.grammar(form, tok, reasoning_open=True)
    assert grammar.starts_after == think_end
    guide = gt.guide(grammar)
    free = tok.encode("anything at all, even { or ]", add_special_tokens=False)
    for t in free:
        assert guide.words() is None
        guide.push(t)
    guide.push(think_end)
    body = tok.encode('\n\n{"a": [1, 2]}', add_special_tokens=False)
    for t in body:
        words = guide.words()
        assert words is not None and (int(words[t // 32]) >> (t % 32)) & 1
        guide.push(t)
    assert (int(guide.words()[tok.eos_token_ids[0] // 32]) >> (tok.eos_token_ids[0] % 32)) & 1
    guide.rollback(len(body) + 1)  # back before </think>: free again
    assert guide.words() is None
    with pytest.raises(RuntimeError, match="not allowed"):
        guide.push(think_end)
        guide.push(tok.encode("x", add_special_tokens=False)[0])


def test_qwen35_xml_tool_calls(demo):
    """A template that writes <function=...> (Qwen3.5/3.6) gets calls in that format, which
    serving/tools/calls.py reads back into arguments valid for the schema."""
    _, _, tok, gt = demo
    xml_tok = SimpleNamespace(chat_template="... <function=NAME> ...", token_to_id=tok.token_to_id)
    tools = [{"type": "function", "function": {"name": "move", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "steps": {"type": "integer", "minimum": 1, "maximum": 5},
        "force": {"type": "boolean"}}, "required": ["path", "steps"]}}}]
    grammar = structured.grammar(forced_calls(tools), xml_tok, reasoning_open=False)
    gt.check(grammar)

    def accepts(text):
        guide = gt.guide(grammar)
        for t in tok.encode(text, add_special_tokens=False):
            words = guide.words()
            if not (int(words[t // 32]) >> (t % 32)) & 1:
                return False
            guide.push(t)
        return bool((int(guide.words()[tok.eos_token_ids[0] // 32]) >> (tok.eos_token_ids[0] % 32)) & 1)

    good = "<tool_call>\n<function=move>\n<parameter=path>\na/b <c>.txt\n</parameter>\n" \
           "<parameter=steps>\n3\n</parameter>\n</function>\n</tool_call>"
    assert accepts(good)
    assert not accepts(good.replace("3", "9"))  # steps above its maximum
    assert not accepts(good.replace("function=move", "function=jump"))
    assert not accepts(good.replace("<parameter=steps>\n3\n</parameter>\n", ""))  # a required parameter missing
    _, calls = parse_tool_calls(good, tools)
    assert [c.name for c in calls] == ["move"]
    jsonschema.validate(json.loads(calls[0].arguments), tools[0]["function"]["parameters"])


@pytest.mark.parametrize("fmt, head, vocab", [("speculators", "vanilla", 460), ("deepspec", "gated", None),
                                              ("deepspec", "rnn", None)])
def test_greedy_speculation_under_a_grammar_equals_reference_for_draft_kinds(tmp_path, fmt, head, vocab):
    """A reduced draft vocabulary (d2t) and the gated / rnn Markov heads under a JSON
    schema: greedy speculative output equals the reference loop of full forwards."""
    from dataclasses import replace

    from monolith.engine_setup import load_drafter, load_target
    from monolith.synth import write_draft, write_target
    from monolith.synth.draft_config import draft_sizes
    from monolith.tokenizer import load_tokenizer

    target_dir = write_target(tmp_path / "target", format="bf16", seed=0)
    sizes = draft_sizes(json.loads((target_dir / "config.json").read_text())["text_config"])
    if vocab is not None:
        sizes = replace(sizes, draft_vocab_size=vocab)
    draft_dir = write_draft(tmp_path / "draft", target_dir, format=fmt, seed=3, markov_head_type=head, sizes=sizes)
    model = load_target(target_dir, dtype="float32", cache_dir=tmp_path / "cache")
    drafter = load_drafter(draft_dir, model, dtype="float32", quantization="none", cache_dir=tmp_path / "cache")
    tok = load_tokenizer(target_dir)
    gt = GrammarTokenizer.of(tok, model.args.vocab_size)
    schema = {"type": "object", "properties": {"k": {"enum": ["ab", "cd", "ef"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 50}},
              "required": ["k", "n"], "additionalProperties": False}
    grammar = structured.grammar(structured.Structure("json", "test", schema), tok, reasoning_open=False)
    prompt = tok.encode_chat([{"role": "user", "content": "json"}])
    want = reference_greedy(model, tok, gt, grammar, prompt, 40)
    spec = run(Decoder(model, drafter, MAX_CONTEXT), prompt, 40, SamplingParams(), tok, gt.guide(grammar))
    assert spec.token_ids == want
    sampled = run(Decoder(model, drafter, MAX_CONTEXT), prompt, 40,
                  SamplingParams(temperature=0.9, seed=1), tok, gt.guide(grammar))
    replay = gt.guide(grammar)  # every sampled token was legal where it stands
    for t in sampled.token_ids:
        assert (int(replay.words()[t // 32]) >> (t % 32)) & 1
        replay.push(t)
    if sampled.finish_reason == "stop":
        jsonschema.validate(json.loads(tok.decode(sampled.token_ids)), schema)


@pytest.mark.parametrize("width", [33, 64, 2048, 2050])
def test_bitmask_layout_matches_numpy_packbits(width):
    """sampling.allowed reads llguidance's layout (bit i % 32 of word i // 32, little
    endian), checked against numpy's packbits; Guide.forced finds a lone bit anywhere."""
    from monolith.runtime.grammar import Guide
    from monolith.sampling import allowed

    rng = np.random.default_rng(width)
    bits = rng.integers(0, 2, (3, width)).astype(bool)
    padded = np.zeros((3, -(-width // 32) * 32), bool)
    padded[:, :width] = bits
    words = np.packbits(padded, axis=-1, bitorder="little").view(np.int32)
    assert (np.array(allowed(words, width)) == bits).all()
    guide = Guide(None, width, ())
    for token in (0, 31, width - 1):
        one = np.zeros(padded.shape[1], bool)
        one[token] = True
        guide._words = np.packbits(one, bitorder="little").view(np.int32)
        assert guide.forced() == token
    guide._words = words[0]
    assert guide.forced() is None


def test_logprobs_under_a_grammar_are_the_raw_rows_plain_and_speculative(demo):
    """Logprobs report the model's raw distribution (as without a grammar), for sampled
    and forced tokens alike, equal between plain and speculative decoding."""
    model, drafter, tok, gt = demo
    grammar = lark(FORCED)
    prompt = tok.encode_chat([{"role": "user", "content": "Write letters."}])
    got = {}
    for name, decoder in (("plain", Decoder(model, None, MAX_CONTEXT)),
                          ("speculative", Decoder(model, drafter, MAX_CONTEXT))):
        seen = []
        decoder(Generation(prompt, 12, SamplingParams(), stops(tok), logprobs=2, guide=gt.guide(grammar),
                           emitter=Tokens(lambda t, lp, seen=seen: seen.append(lp) or True)))
        got[name] = seen
    tokens = [lp.token_id for lp in got["plain"]]
    assert [lp.token_id for lp in got["speculative"]] == tokens and tokens[:3] == [2005, 2006, 2007]
    for i, (a, b) in enumerate(zip(got["plain"], got["speculative"])):
        row = last_logits(model, prompt + tokens[:i])
        want = float((row - mx.logsumexp(row))[tokens[i]].item())
        assert abs(a.logprob - want) < 1e-4 and abs(b.logprob - want) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_masks_work_on_any_thread():
    """The engine samples on its worker thread: masking must not use an MLX array made
    on the importing thread (MLX streams are per thread)."""
    import threading

    from monolith.sampling import mask_logits

    words = np.packbits(np.arange(64) % 3 == 0, bitorder="little").view(np.int32)
    out = {}

    def work():
        out["row"] = np.array(mask_logits(mx.zeros((64,)), words))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert (np.isfinite(out["row"]) == (np.arange(64) % 3 == 0)).all()


def counting(calls: dict, name: str, method):
    def counted(self, *args, **kw):
        calls[name] += 1
        return method(self, *args, **kw)
    return counted


CALL_TOOLS = [{"type": "function", "function": {"name": name, "description": text, "parameters": {
    "type": "object", "properties": {key: {"type": "string"}}, "required": [key]}}}
    for name, text, key in (("open_file", "Show the contents of a file.", "file"),
                            ("get_weather", "Get the current weather for a location.", "location"))]


@pytest.mark.parametrize("case", ["reasoning, then a JSON object", "a call under tool_choice auto"])
def test_a_guide_waiting_for_its_start_token_engages_there(demo, monkeypatch, case):
    """A guide that starts after a token (`</think>` before a response format, a call's
    `<tool_call>` under tool_choice "auto") leaves the rounds unguided until the model
    emits that token (plain steps pipelined, proposals drawn by `propose`), cuts the round
    there and constrains the rest: greedy plain and speculative output equal the reference
    loop, which consults the guide at every token."""
    model, drafter, tok, gt = demo
    if case.startswith("reasoning"):
        prompt = tok.encode_chat([{"role": "user", "content": "What does json.dumps do?"}])
        grammar = structured.grammar(structured.response_format({"type": "json_object"}), tok, reasoning_open=True)
    else:
        prompt = tok.encode_chat([{"role": "user", "content": "Open lib/logging.py and tell me what it defines."}],
                                 CALL_TOOLS)
        grammar = structured.grammar(structured.calls_once_opened(CALL_TOOLS, tok), tok, reasoning_open=False)
    want = reference_greedy(model, tok, gt, grammar, prompt, 48)
    assert grammar.starts_after in want  # the demo model writes the start token here
    assert gt.guide(grammar).waiting and gt.guide(grammar).budget is None
    plain = run(Decoder(model, None, MAX_CONTEXT), prompt, 48, SamplingParams(), tok, gt.guide(grammar))
    assert plain.token_ids == want
    calls = {"propose": 0, "propose_guided": 0}
    kind = type(drafter.fork())  # each sequence drafts on a fork of the drafter
    for name in calls:
        monkeypatch.setattr(kind, name, counting(calls, name, getattr(kind, name)))
    spec = run(Decoder(model, drafter, MAX_CONTEXT), prompt, 48, SamplingParams(), tok, gt.guide(grammar))
    assert spec.token_ids == want
    assert calls["propose_guided"] >= 1
    assert calls["propose"] >= (want.index(grammar.starts_after) > 0)  # unguided proposals before the start token
    text = tok.decode(want[want.index(grammar.starts_after) + 1:])
    if case.startswith("reasoning"):
        assert text.lstrip().startswith("{")  # (the object runs past 48 tokens)
    else:
        (call,) = parse_tool_calls(tok.decode(want), CALL_TOOLS)[1]  # an offered tool (unconstrained: get_time)
        assert call.whole and call.name in {"open_file", "get_weather"} and json.loads(call.arguments)
