"""The Responses API over a WebSocket at /v1/responses (Open Responses' WebSocket
transport). The client sends `{"type": "response.create", ...}` messages, each the body of
POST /v1/responses without its HTTP-only fields (`stream`, `stream_options`,
`background`); each turn answers with the same events the SSE stream sends (numbered
from 0 per response), ending with its response.completed / incomplete / failed. One
response at a time: messages that arrive meanwhile wait their turn, in order. The
connection keeps its most recent response (store: false ones too) for
`previous_response_id`; older ones come from the store. A turn that fails (a 4xx or 5xx)
drops the response it continued from that memory. Failures before the stream starts are
`{"type": "error", "status", "error": {message, type, param, code}}` events, after which
the socket stays usable; a generation that fails mid-stream ends with response.failed, as
over HTTP. After `limit_seconds` (60 minutes) the connection answers the error
`websocket_connection_limit_reached` and closes. The handshake is checked as an HTTP
request is (Host, Origin, API key): a refused one is answered with that HTTP error (or,
where the server cannot send one, closed with the policy-violation code). A client that
goes away cancels its response in flight."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from contextlib import aclosing

import anyio
from starlette.responses import JSONResponse
from starlette.status import WS_1008_POLICY_VIOLATION
from starlette.websockets import WebSocket, WebSocketDisconnect

from .. import access
from ..errors import APIError, ContextOverflow, bad, log_refusal
from ..requests import parse_json_body
from . import reply, requests

log = logging.getLogger("monolith.serve")
LIMIT_SECONDS = 3600.0  # Open Responses: WebSocket connections are limited to 60 minutes
TRANSPORT_FIELDS = ("stream", "stream_options", "background")  # HTTP only: never sent over a WebSocket


class ResponsesSocket:
    """The WebSocket endpoint (`serve`) on the app's handlers; `clock` (seconds) measures a
    connection's age."""

    def __init__(self, handlers, limit_seconds: float = LIMIT_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.handlers = handlers
        self.limit_seconds = limit_seconds
        self.clock = clock

    async def serve(self, websocket: WebSocket) -> None:
        try:
            access.check_origin(self.handlers.state.config, websocket)
            access.authorize(self.handlers.state.config, websocket)
        except APIError as e:
            log_refusal("WebSocket /v1/responses (handshake)", e)
            if "websocket.http.response" in websocket.scope.get("extensions", {}):
                await websocket.send_denial_response(JSONResponse(e.body(), status_code=e.status))
            else:
                await websocket.close(WS_1008_POLICY_VIOLATION, e.message[:120])
            return
        opened = self.clock()  # before the client can see the handshake answered
        await websocket.accept()
        await _Connection(self, websocket, opened).run()


class _Connection:
    def __init__(self, socket: ResponsesSocket, websocket: WebSocket, opened: float):
        self.socket = socket
        self.handlers = socket.handlers
        self.websocket = websocket
        self.opened = opened
        self.last: tuple[dict, list[dict]] | None = None  # the most recent response: (body, conversation)

    async def run(self) -> None:
        """Messages are read as they come (a disconnect cancels the turn in flight) and
        handled one at a time, in order."""
        put, messages = anyio.create_memory_object_stream(math.inf)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._read, put, tasks.cancel_scope)
            try:
                await self._work(messages)
            except WebSocketDisconnect:  # gone while we were sending
                pass
            tasks.cancel_scope.cancel()

    async def _read(self, put, everything) -> None:
        try:
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                await put.send(text if text is not None else message.get("bytes") or b"")
        finally:
            everything.cancel()

    def _left(self) -> float:
        return self.socket.limit_seconds - (self.socket.clock() - self.opened)

    async def _work(self, messages) -> None:
        while True:
            raw = None
            with anyio.move_on_after(max(self._left(), 0)):
                raw = await messages.receive()
            if raw is None or self._left() <= 0:
                minutes = self.socket.limit_seconds / 60
                await self._send(_error(APIError(
                    400, f"this WebSocket connection reached its limit of {minutes:g} minutes: open a new one "
                    "(continue with previous_response_id if the response was stored, else send the whole "
                    "conversation)", code="websocket_connection_limit_reached")))
                await self.websocket.close(1000, "websocket_connection_limit_reached")
                return
            await self._turn(raw)

    async def _turn(self, raw: str | bytes) -> None:
        """One response.create: its events, or an error event."""
        previous = failure = None
        try:
            body = _create_body(raw, self.handlers.state.config.max_request_bytes)
            previous = body.get("previous_response_id")
            failure = await self._respond(body)
        except WebSocketDisconnect:
            raise
        except Exception as e:  # noqa: BLE001 - our own failures are logged by _api_error
            failure = _api_error(e)
            await self._send(_error(failure))
        finally:
            self.handlers.release(self.websocket)  # the turn's model (handlers.model_for)
        if failure is not None:
            self._forget(previous)
        self.handlers.state.metrics.requests.labels("responses", str(failure.status if failure else 200)).inc()

    async def _respond(self, body: dict) -> APIError | None:
        """Generate the response of a create body, sending its events; the error if it
        failed mid-stream (its response.failed was sent)."""
        handlers = self.handlers
        started = time.monotonic()
        model, name = await handlers.model_for(self.websocket, body)
        engine = model.engine
        call = requests.parse_request(body, model.defaults, self)
        make_format = reply.format_maker(name, call, handlers.state.responses, engine.tokenizer)
        job, events, fmt = await handlers.start_chat(engine, call.request, make_format, started, "input")
        final = None
        try:
            async with aclosing(handlers.progress(events, fmt, False)) as chunks:
                async for chunk in chunks:
                    if isinstance(chunk, APIError):
                        # response.failed alone: over a socket an `error` message is the
                        # transport's envelope, which clients take as the end of the turn
                        await self._send(fmt.number(fmt.failed(chunk)[-1]))
                        return chunk
                    if chunk is not None:  # None: a keep-alive tick, which a WebSocket needs not
                        await self._send(fmt.number(chunk))
                        final = chunk.get("response", final)
        finally:
            job.cancel()  # a no-op once finished
            fmt.ended()  # no longer cancellable by id
        self.last = (final, fmt.conversation())
        return None

    def get(self, response_id: str, param: str) -> tuple[dict, list[dict]]:
        """The response `previous_response_id` names (as ResponseStore.get): this
        connection's most recent, else a stored one."""
        if self.last is not None and self.last[0]["id"] == response_id:
            return self.last
        try:
            return self.handlers.state.responses.get(response_id, param)
        except APIError:
            raise APIError(400, f"Previous response with id {response_id!r} not found: neither this connection's "
                           "most recent response nor a stored one (a store: false response lives only on the "
                           "connection that made it, until a turn continuing it fails)", param,
                           "previous_response_not_found") from None

    def _forget(self, response_id) -> None:
        if self.last is not None and self.last[0]["id"] == response_id:
            self.last = None

    async def _send(self, event: dict) -> None:
        await self.websocket.send_text(json.dumps(event, ensure_ascii=False))


def _create_body(raw: str | bytes, limit: int) -> dict:
    """The create body of a response.create message (text or binary JSON)."""
    data = raw.encode() if isinstance(raw, str) else raw
    if len(data) > limit:
        raise APIError(413, f"the message exceeds the limit of {limit} bytes", code="request_too_large")
    message = parse_json_body(data)
    kind = message.get("type")
    if kind != "response.create":
        raise bad(f"unsupported message type {json.dumps(kind)[:60]}: send {{\"type\": \"response.create\", ...}}",
                  "type")
    for field in TRANSPORT_FIELDS:
        if field in message:
            raise bad(f"{field} is an HTTP field, not sent over a WebSocket (where every response streams)", field)
    return {key: value for key, value in message.items() if key != "type"}


def _api_error(e: Exception) -> APIError:
    if isinstance(e, ContextOverflow):
        return log_refusal("WebSocket /v1/responses", e.worded_for("responses"))
    if isinstance(e, APIError):
        return log_refusal("WebSocket /v1/responses", e)
    log.error("WebSocket /v1/responses failed", exc_info=e)
    return APIError(500, "internal server error (the server log has the details)", code="internal_error")


def _error(error: APIError) -> dict:
    """The transport's error envelope; its `error.code` is never null (the specification's
    schema): the error's type stands in where it has no code of its own."""
    body = error.body()
    body["error"]["code"] = body["error"]["code"] or body["error"]["type"]
    return {"type": "error", "status": error.status, **body}
