"""One batch from inside (runtime/batch.py): a Peers question gets the other sequences
and their rows, and a forward that fails fails only its own sequence; the target forward,
the draft blocks, their proposal chains and the draft context appends run with every
sequence packed into one call; each sequence's Fallback decides with its peers, and
greedy outputs stay those served alone."""

from __future__ import annotations

from batch_rig import MAX_CONTEXT, alone, decoder, prompts, together

from monolith.runtime.decoder import Decoder
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.events import GenerationRequest


def test_a_batch_answers_peers_and_keeps_a_failure_to_its_sequence(demo_f32):
    """Batch.step: a Peers question gets (the other sequences, their rows in the latest
    forward); a forward that fails (its cache is full) fails only its own sequence, the
    others get their rows."""
    import mlx.core as mx

    from monolith.runtime.batch import Batch, Forward, Peers

    model = demo_f32[0]
    seen = {}

    def steps(name, rows, context):
        cache = model.make_cache(context)
        logits, _ = yield Forward(model, mx.zeros((rows,), mx.int32), cache)
        seen[name] = ("peers", (yield Peers()))
        logits, _ = yield Forward(model, mx.zeros((rows,), mx.int32), cache)
        seen[name] += ("rows", logits.shape[0])

    def failing():
        cache = model.make_cache(4)
        try:
            yield Forward(model, mx.zeros((20,), mx.int32), cache)  # 20 rows do not fit 4 (+ 8 spare)
        except ValueError as e:
            seen["failing"] = type(e).__name__

    batch = Batch()
    for name, rows in (("a", 1), ("b", 3), ("c", 8)):
        batch.add(steps(name, rows, 64))
    batch.add(failing())
    ended = []
    while len(batch):
        ended += batch.step()
    assert seen == {"a": ("peers", (2, 11), "rows", 1), "b": ("peers", (2, 9), "rows", 3),
                    "c": ("peers", (2, 4), "rows", 8), "failing": "CacheError"}
    assert len(ended) == 4 and all(s.error is None for s in ended)


def test_a_batch_packs_the_target_forward_the_draft_blocks_and_the_context_appends(demo_f32, monkeypatch):
    """Three speculative sequences in one batch: target forwards, draft blocks, their
    proposal chains and draft context appends each ran with all three sequences packed
    into one call."""
    model, drafter, tok = demo_f32
    sizes = {"target": [], "draft": [], "chain": [], "append": []}
    draft = drafter.draft
    for name, obj, method in (("target", type(model), "forward_batch"), ("draft", type(draft), "forward_batch"),
                              ("chain", type(draft), "propose_batch"), ("append", type(draft), "append_batch")):
        real = getattr(obj, method)

        def counted(self, items, *args, real=real, name=name):
            sizes[name].append(len(items))
            return real(self, items, *args)

        monkeypatch.setattr(obj, method, counted)
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_batch=3),
                    decoder=decoder("speculative", model, drafter))
    try:
        together(engine, [GenerationRequest(p, max_tokens=24) for p in prompts(tok)[:3]])
    finally:
        engine.close()
    assert {name: max(n) for name, n in sizes.items()} == {"target": 3, "draft": 3, "chain": 3, "append": 3}


def test_the_fallback_sees_the_batch_around_it(demo_f32, monkeypatch):
    """In a batch, each sequence's Fallback decides with its peers (the other sequences
    and their rows in the latest forward); alone it sees none. Greedy outputs stay those
    served alone whatever it decides."""
    from monolith.runtime.fallback import Fallback
    from monolith.runtime.scheduler import StepCosts

    model, drafter, tok = demo_f32
    seen = []
    real = Fallback.speculate

    def speculate(self, peers=(0, 0), context=None):
        seen.append(peers)
        return real(self, peers, context)

    monkeypatch.setattr(Fallback, "speculate", speculate)
    costs = StepCosts(one_row=1.0, per_row=0.4, per_sequence=0.2)
    dec = Decoder(model, drafter, MAX_CONTEXT, prefill_chunk_size=32, break_even=2.5)
    dec.step_costs = costs
    ps = prompts(tok)[:3]
    want = [alone(model, tok, dec, p, 30)[0] for p in ps]
    assert seen and set(seen) == {(0, 0)}
    seen.clear()
    engine = Engine(model, tok, Limits(max_context=MAX_CONTEXT, max_batch=3), decoder=dec)
    try:
        got = together(engine, [GenerationRequest(p, max_tokens=30) for p in ps])
    finally:
        engine.close()
    assert [f.token_ids for f in got] == want
    assert max(others for others, _ in seen) == 2 and max(rows for _, rows in seen) >= 2
