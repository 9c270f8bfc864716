"""The decoders as the tests call them: one request on a fresh Session through
monolith.runtime.engine.run_decoder, the call the engine's worker makes."""

from __future__ import annotations

from monolith.runtime.decoder import Decoder
from monolith.runtime.engine import run_decoder
from monolith.sampling import SamplingParams


def plain(model, prompt, max_tokens, params=SamplingParams(), stop_ids=(), max_context=128,
          prefill_chunk_size=512, on_token=None):
    return run_decoder(Decoder(model, None, max_context, prefill_chunk_size), prompt, max_tokens, params, stop_ids,
                       on_token)


def speculate(model, drafter, prompt, max_tokens, params=SamplingParams(), stop_ids=(), max_context=128,
              prefill_chunk_size=512, block_size=None, scheduler=None, on_token=None, on_round=None,
              profile=False, break_even=None):
    decoder = Decoder(model, drafter, max_context, prefill_chunk_size, block_size, scheduler, break_even)
    decoder.profile, decoder.on_round = profile, on_round
    return run_decoder(decoder, prompt, max_tokens, params, stop_ids, on_token)
