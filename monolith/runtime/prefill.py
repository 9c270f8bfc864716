"""The one prefill: a prompt's rows through the target in chunks, as a generator of its
forwards (batch.py), so the engine packs a newcomer's prefill chunk by chunk into the
rounds of the sequences already running."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from .batch import Forward, Steps, drive
from .drafter import Drafter
from .generation import Generation


def prefill_rows(model, tokens: Sequence[int] | mx.array, cache, chunk_size: int = 512, stops: Sequence[int] = (),
                 drafter: Drafter | None = None, on_stop: Callable[[int], None] | None = None,
                 generation: Generation | None = None) -> Steps:
    """The one prefill: `tokens` through `model` after the rows `cache` holds, in chunks
    ending on multiples of chunk_size from row 0 and at `stops` (positions in the
    sequence), so a prompt prefilled from a saved state runs the same chunks as a cold
    prefill that saved it. Each chunk's tap features go to the `drafter` (`observe`);
    between chunks the state (the cache's, and the drafter's) is evaluated (it bounds the
    graph) and `on_stop(position)` runs once the cache holds the rows up to each stop.
    Returns the last row's logits [vocab], or None when the `generation`'s emitter says
    it was cancelled, between chunks. The generation's images (images.PromptImages of
    the whole prompt, whose real ids `tokens` are) give each chunk its image features and
    multimodal positions."""
    begin = cache.offset
    ids = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.int32)
    total = begin + ids.shape[0]
    images = None if generation is None else generation.images
    taps = () if drafter is None else tuple(drafter.taps)
    done, logits = begin, None
    for end in chunk_ends(begin, total, chunk_size, stops):
        last = end == total
        extras = (None, None) if images is None else images.chunk(done, end)
        logits, features = yield Forward(model, ids[done - begin:end - begin], cache, taps,
                                         "last" if last else "none", *extras)
        if drafter is not None:
            drafter.observe(features)
        done = end
        if not last:
            mx.eval(cache.arrays(), *(() if drafter is None else (drafter.arrays(),)))
        if end in stops and on_stop is not None:
            on_stop(end)
        if not last and generation is not None and generation.emitter.cancelled():
            return None
    return logits[-1]


def prefill(model, tokens, cache, chunk_size: int = 512) -> mx.array:
    """`prefill_rows` alone, on the calling thread: the last row's logits (CacheError
    before any work when the tokens do not fit the cache's context)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    cache.check(len(tokens), limit=cache.max_context)
    return drive(prefill_rows(model, tokens, cache, chunk_size))


def chunk_ends(start: int, end: int, chunk_size: int, stops=()) -> list[int]:
    """Where the prefill chunks of rows [start, end) end: at the multiples of chunk_size
    (counted from row 0) and at `stops`, each chunk at most chunk_size rows."""
    ends = set(range((start // chunk_size + 1) * chunk_size, end, chunk_size))
    ends.update(s for s in stops if start < s < end)
    ends.add(end)
    return sorted(ends) if end > start else []
