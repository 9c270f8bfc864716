"""How much a server may hold: the memory one running sequence's caches take
(`sequence_bytes`), the context it serves (`choose_context`: --max-context, or the
model's own capped by memory) and whether `--max-batch` sequences fit
(`batch_memory`). engine_setup.load_engine asks these after loading the models."""

from __future__ import annotations

from .prompt_cache import available_memory

CONTEXT_MEMORY_SHARE = 0.5  # a default context's --max-batch caches take at most this share of the free memory
CONTEXT_STEP = 1024  # a default context capped by memory is a multiple of this


class SizingError(ValueError):
    """The caches asked for do not fit the memory free after loading (or the model states
    no context of its own): one line for the user."""


def choose_context(asked: int | None, model, drafter, max_batch: int, log) -> int:
    """The context the engine serves, logged in one line with why: --max-context as given
    (`asked`; past the model's own context with a warning: those positions are untrained),
    else the model's own (its config's max_position_embeddings), capped so that
    `max_batch` sequences' caches at it (the target's and the draft's) take at most
    CONTEXT_MEMORY_SHARE of the memory free after loading: the rest is for the prompt
    cache's default budget (a share of what the sequences leave) and the forwards'
    working memory. Caches grow as they fill, so the cap bounds what they may reach."""
    own = model.args.max_position_embeddings
    if asked is not None:
        past = own is not None and asked > own
        log(f"context: {asked} tokens (--max-context)" + (
            f"; warning: past the model's own context of {own} tokens (max_position_embeddings), where it was "
            "never trained: expect worse output there" if past else ""))
        return asked
    if own is None:
        raise SizingError("the model's config states no max_position_embeddings (its own context): give --max-context")
    one = sequence_bytes(model, drafter, 1)
    per_token = sequence_bytes(model, drafter, 2) - one
    free = available_memory()
    room = CONTEXT_MEMORY_SHARE * free / max_batch - (one - per_token)  # bytes for the rows of one sequence
    fits = int(room // per_token) if per_token else own
    batch = f"{max_batch} sequence{'s' if max_batch > 1 else ''}" + kv_note(model)
    if fits >= own:
        log(f"context: {own} tokens, the model's own (max_position_embeddings); the caches of {batch} at it take "
            f"{max_batch * sequence_bytes(model, drafter, own) / 2**30:.2f} GiB of the {free / 2**30:.2f} GiB free")
        return own
    context = fits - fits % CONTEXT_STEP if fits >= CONTEXT_STEP else fits
    if context < 2:
        raise SizingError(f"{free / 2**30:.2f} GiB is free after loading the model: too little for the caches of "
                         f"{batch} of even 2 tokens; free memory, lower --max-batch or give --max-context")
    log(f"context: {context} tokens, capped by memory: the model's own {own} would take "
        f"{max_batch * sequence_bytes(model, drafter, own) / 2**30:.2f} GiB of cache for {batch}, more than "
        f"{CONTEXT_MEMORY_SHARE:.0%} of the {free / 2**30:.2f} GiB free after loading (--max-context sets it)")
    return context


def kv_note(model) -> str:
    """What the sizing log says of --kv-bits (its bytes are counted by sequence_bytes)."""
    bits = model.kv_bits
    return f" ({bits}-bit KV, {per_token_bytes(model)} bytes a token in the target's cache)" if bits else ""


def per_token_bytes(model) -> int:
    """The bytes one token of context takes in the target's KV caches."""
    return sum(layer.row_nbytes for layer in model.make_cache(1).row_layers)


def sequence_bytes(model, drafter, max_context: int) -> int:
    """The memory one running sequence's caches take once they hold `max_context` rows:
    the target's cache and the draft's context (KV rows are allocated as they are written:
    nothing is allocated to count them; quantized ones, --kv-bits, count their packed
    words, scales and biases)."""
    layers = list(model.make_cache(max_context).layers)
    context = None if drafter is None else drafter.make_context(max_context)
    if context is not None:
        layers += context.layers
    return sum(layer.max_nbytes for layer in layers)


def batch_memory(model, drafter, max_context: int, max_batch: int, log) -> int:
    """The bytes `max_batch` sequences' caches take; SetupError if they do not fit the
    memory free now (after loading the model)."""
    each = sequence_bytes(model, drafter, max_context)
    need, free = each * max_batch, available_memory()
    if need > free:
        raise SizingError(f"--max-batch {max_batch} sequences of --max-context {max_context} tokens need "
                         f"{need / 2**30:.2f} GiB of cache ({each / 2**30:.2f} GiB each), but "
                         f"{free / 2**30:.2f} GiB is free after loading the model: lower --max-batch or --max-context")
    if max_batch > 1:
        log(f"batch: up to {max_batch} sequences at once, {need / 2**30:.2f} GiB of cache at "
            f"--max-context {max_context}")
    return need
