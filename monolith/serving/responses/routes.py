"""The Responses API's HTTP endpoints (app.py routes them; the WebSocket transport:
websocket.py).

`ResponsesRoutes`: POST /v1/responses (the chat path, its reply: reply.py),
POST /v1/responses/input_tokens (the prompt tokens a request would take) and POST
/v1/responses/compact (compact.py), on the app's handlers (their access checks,
engine, model names, body reading and engine driving).

`StoredResponses`, the endpoints on stored responses (OpenAI's shapes; the store:
store.py): GET /v1/responses/{id} (status `in_progress` while it is being
generated); DELETE /v1/responses/{id} ({"id", "object": "response", "deleted": true}); GET
/v1/responses/{id}/input_items (a cursor page of the request's input items: `limit`
1-100, default 20; `order` asc or desc, default desc; `after` an item id; `include`
values are accepted, and `reasoning.encrypted_content` keeps a reasoning item's
encrypted_content, which is left out otherwise); POST /v1/responses/{id}/cancel: a
response being generated (streamed or not, from another connection) is cancelled, its
engine job freeing its slot, and answered with status `cancelled`; a finished one is a
400. Every unknown id is a 404 naming `response_id`.

"compact" and "input_tokens" name POST endpoints (/v1/responses/compact,
/v1/responses/input_tokens), never a response: other methods on them are a 405.

Each stored-response handler takes the request (its path_params, query_params and
method, as starlette's Request has them) and returns the JSON body."""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from ..errors import APIError, bad
from . import compact, reply, requests
from .store import ResponseStore
from .websocket import ResponsesSocket

log = logging.getLogger("monolith.serve")

ENDPOINTS = ("compact", "input_tokens")  # POST /v1/responses/NAME: not response ids
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs")
LIST_PARAMS = ("limit", "order", "after", "include", "include[]")
CANCEL_WAIT = 30.0  # seconds a cancel waits for the response's handler to finish it


def routes(handlers) -> list[BaseRoute]:
    """The routes of the Responses API's endpoints and its WebSocket on the app's handlers
    (handlers.Handlers)."""
    posted, stored, config = ResponsesRoutes(handlers), StoredResponses(handlers.state.responses), handlers.state.config
    return [
        Route("/v1/responses", handlers.endpoint("responses", posted.responses), methods=["POST"]),
        Route("/v1/responses/input_tokens", handlers.endpoint("responses", posted.input_tokens), methods=["POST"]),
        Route("/v1/responses/compact", handlers.endpoint("responses", posted.compact), methods=["POST"]),
        *[Route(path, handlers.endpoint("responses", _json(handler)), methods=[method])
          for path, method, handler in (("/v1/responses/{response_id}", "GET", stored.get),
                                        ("/v1/responses/{response_id}", "DELETE", stored.delete),
                                        ("/v1/responses/{response_id}/input_items", "GET", stored.input_items),
                                        ("/v1/responses/{response_id}/cancel", "POST", stored.cancel))],
        WebSocketRoute("/v1/responses", ResponsesSocket(handlers, config.websocket_limit_seconds,
                                                        config.websocket_clock).serve),
    ]


def _json(handler):
    """A handler that returns a JSON body, as a starlette endpoint."""

    async def run(request: Request) -> Response:
        return JSONResponse(await handler(request))

    return run


class ResponsesRoutes:
    """The POST endpoints of the Responses API, on the app's handlers (handlers.Handlers)."""

    def __init__(self, handlers):
        self.handlers = handlers

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API on the chat path (requests.py, reply.py)."""
        handlers = self.handlers
        state = handlers.state
        started, body, model, name = await handlers.arrive(request)
        engine = model.engine
        call = requests.parse_request(body, model.defaults, state.responses)
        make_format = reply.format_maker(name, call, state.responses, engine.tokenizer)
        response = await handlers.generate_chat(request, engine, call.request, make_format, started, "input")
        if call.tools.omitted:  # hosted tools this server cannot run: left out, and said so
            omitted = ", ".join(dict.fromkeys(call.tools.omitted))
            log.info("responses: hosted tools left out of what the model sees: %s", omitted)
            response.headers["x-monolith-omitted-tools"] = omitted
        return response

    async def input_tokens(self, request: Request) -> Response:
        """POST /v1/responses/input_tokens: the prompt tokens a Responses request would take."""
        handlers = self.handlers
        state = handlers.state
        _, body, model, _ = await handlers.arrive(request)
        engine = model.engine
        call = requests.parse_request(body, model.defaults, state.responses)
        prompt = await handlers.encode_chat(engine, call.request, handlers.prompt_images(engine, count_only=True))
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prompt.ids)})

    async def compact(self, request: Request) -> Response:
        """POST /v1/responses/compact: the conversation summarized by the model (compact.py)."""
        handlers = self.handlers
        started, body, model, _ = await handlers.arrive(request)
        engine = model.engine
        req, kept = compact.parse_compact(body, model.defaults, handlers.state.responses)
        return await handlers.generate_chat(request, engine, req, partial(compact.CompactFormat, kept), started,
                                            "input")


class StoredResponses:
    def __init__(self, store: ResponseStore):
        self.store = store

    def _id(self, request) -> str:
        response_id = request.path_params["response_id"]
        if response_id in ENDPOINTS:
            raise APIError(405, f"{request.method} /v1/responses/{response_id}: it takes POST only "
                                "(it is an endpoint, not a response id)", code="method_not_allowed")
        return response_id

    async def get(self, request) -> dict:
        response_id = self._id(request)
        running = self.store.running.get(response_id)
        body = running.body("in_progress") if running is not None else None
        if body is not None and body["store"]:  # as it will be stored once it is done
            return body
        return self.store.get(response_id, "response_id").body

    async def delete(self, request) -> dict:
        response_id = self._id(request)
        if not self.store.delete(response_id):
            if response_id in self.store.running:
                raise bad(f"response {response_id!r} is still being generated: cancel it first "
                          f"(POST /v1/responses/{response_id}/cancel), then delete it", "response_id")
            raise self.store.not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, request) -> dict:
        stored = self.store.get(self._id(request), "response_id")
        query = request.query_params
        unknown = sorted(set(query) - set(LIST_PARAMS))
        if unknown:
            raise bad(f"unsupported query parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                      f"(this endpoint takes limit, order, after and include)", unknown[0])
        limit = query.get("limit", "20")
        if not (limit.isdigit() and 1 <= int(limit) <= 100):
            raise bad(f"limit must be an integer from 1 to 100, got {limit!r}", "limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad(f"order must be \"asc\" or \"desc\", got {order!r}", "order")
        include = query.getlist("include") + query.getlist("include[]")
        for value in include:
            if value not in INCLUDABLE:
                raise bad(f"include: unknown value {value!r}; one of {', '.join(INCLUDABLE)}", "include")
        items = stored.input if order == "asc" else stored.input[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad(f"after: response {stored.body['id']!r} has no input item {after!r}", "after")
            items = items[ids.index(after) + 1:]
        page = [_included(item, include) for item in items[:int(limit)]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}

    async def cancel(self, request) -> dict:
        response_id = self._id(request)
        running = self.store.running.get(response_id)
        if running is None:
            body = self.store.get(response_id, "response_id").body  # 404 when unknown
        else:
            running.job.cancel()  # frees its slot (a no-op once done); its handler finishes the response
            try:
                body = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(running.outcome)), CANCEL_WAIT)
            except asyncio.TimeoutError:
                log.warning("response %s was cancelled, but its handler did not finish it in %g s", response_id,
                            CANCEL_WAIT)
                body = running.body("cancelled")
        if body["status"] != "cancelled":  # it ended before the cancel took effect
            raise bad(f"response {response_id!r} is {body['status']}: only a response in progress can be "
                      "cancelled", "response_id")
        return body


def _included(item: dict, include: list[str]) -> dict:
    if item.get("type") == "reasoning" and "encrypted_content" in item \
            and "reasoning.encrypted_content" not in include:
        return {k: v for k, v in item.items() if k != "encrypted_content"}
    return item
