"""The completions that are more than one generation (requests.CompletionRequest.batched):
several prompts in one request (one choice each, `index` its position), `echo` (the
prompt before the completion; with `logprobs`, its tokens' own logprobs, the first one
null, as OpenAI's and vLLM's legacy completions give them) and `max_tokens: 0` (no
generation). What lm-eval's `local-completions` sends for loglikelihood and perplexity
tasks: `{"prompt": [[ids], ...], "echo": true, "logprobs": 1, "max_tokens": 1}`.

The prompt's logprobs come from one forward of the target over it on the engine's
worker thread (runtime/scoring.py); the completion, when there is one, from the engine
as any request's. A completion ended by a stop token counts that token (usage) but
does not show it; with echo and logprobs its entry is given too, from a forward over
prompt and completion (the likeliest stop token at the last row: the one chosen, under
greedy decoding), so that a client that drops the last entry as the generated one
(lm-eval does) keeps the whole prompt.
"""

from __future__ import annotations

import asyncio

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...runtime.events import RequestError
from ...runtime.scoring import Scores, check_scored, score
from ..driving import Prompt, end
from ..errors import bad
from .reply import CompletionFormat, completion_logprobs, reason_of, usage_of
from .requests import CompletionRequest


async def complete(handlers, request: Request, model, name: str, req: CompletionRequest,
                   started: float) -> Response:
    """The text_completion of a batched request: its choices in prompt order, the usage
    summed over them. The prompts run at once (their completions batch in the engine);
    one that fails cancels the others."""
    engine = model.engine
    formats = [CompletionFormat(name, model.token_text, req.logprobs is not None) for _ in req.prompts]

    async def one(prompt, fmt: CompletionFormat) -> tuple[dict, dict]:
        ids = await prompt_ids(handlers, engine, prompt)
        return await _choice(handlers, request, model, req, ids, fmt, started)

    tasks = [asyncio.ensure_future(one(prompt, fmt)) for prompt, fmt in zip(req.prompts, formats)]
    try:
        answers = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
             "prompt_tokens_details": {"cached_tokens": 0}}
    for _, used in answers:
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            usage[key] += used[key]
        usage["prompt_tokens_details"]["cached_tokens"] += used["prompt_tokens_details"]["cached_tokens"]
    first = formats[0]
    return JSONResponse({"id": first.id, "object": "text_completion", "created": first.created, "model": name,
                         "choices": [{"index": i, **choice} for i, (choice, _) in enumerate(answers)],
                         "usage": usage})


async def prompt_ids(handlers, engine, prompt: str | list[int]) -> list[int]:
    """A completion prompt's token ids (a string is encoded as the tokenizer does by default)."""
    if not isinstance(prompt, str):
        return prompt
    handlers.fits(engine, prompt, "prompt")
    return await anyio.to_thread.run_sync(engine.tokenizer.encode, prompt)


async def _choice(handlers, request, model, req: CompletionRequest, ids: list[int], fmt: CompletionFormat,
                  started: float) -> tuple[dict, dict]:
    """One prompt's choice (without its index) and usage."""
    engine = model.engine
    try:
        ids = check_scored(ids, engine.vocab_size, engine.max_context)
    except RequestError as e:
        raise bad(str(e), "prompt") from None
    text, lps, finished = "", [], None
    if not req.score_only:
        job, events = await handlers.start(engine, req, fmt, Prompt(ids, "prompt"), started, request)
        try:
            finished = await handlers.collect(request, job, events, fmt)
            text, lps = "".join(fmt.texts), fmt.lps
        finally:
            end(job, fmt)
    generated = () if finished is None else finished.token_ids
    stopped = finished is not None and finished.usage.completion_tokens > len(generated)
    if req.echo:
        text = engine.tokenizer.decode(ids, skip_special_tokens=False) + text
        if req.logprobs is not None:
            stop_ids = sorted(engine.stop_ids) if stopped else ()
            scores = await _score(engine, ids + list(generated), req.logprobs, stop_ids)
            tail = [scores.after] if scores.after is not None else []
            lps = [ids[0]] + scores.tokens[:len(ids) - 1] + list(lps) + tail
    logprobs = None if req.logprobs is None else completion_logprobs(model.token_text, lps)
    if finished is None:
        usage = {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                 "prompt_tokens_details": {"cached_tokens": 0}}
        return {"text": text, "logprobs": logprobs, "finish_reason": "length"}, usage
    return {"text": text, "logprobs": logprobs, "finish_reason": reason_of(finished)}, usage_of(finished)


async def _score(engine, ids: list[int], k: int, after) -> Scores:
    """runtime/scoring.score of `ids` on the engine's worker thread."""
    return await anyio.to_thread.run_sync(engine.call, lambda: score(engine.model, ids, k, after))
