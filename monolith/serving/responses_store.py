"""The Responses API's response store: what `previous_response_id` and GET
/v1/responses/{id} read. A response (unless sent with `store: false`) is kept with its
whole conversation as chat messages; the store holds the last `STORED_RESPONSES`."""

from __future__ import annotations

from collections import OrderedDict

from .errors import APIError

STORED_RESPONSES = 256


class ResponseStore:
    """The last `size` responses: id -> (response body, the conversation as chat messages)."""

    def __init__(self, size: int = STORED_RESPONSES):
        self.size = size
        self.entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, body: dict, messages: list[dict]) -> None:
        self.entries[body["id"]] = (body, messages)
        self.entries.move_to_end(body["id"])
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def get(self, response_id: str, param: str) -> tuple[dict, list[dict]]:
        entry = self.entries.get(response_id)
        if entry is None:
            raise APIError(404, f"no response with id {response_id!r}: this server keeps the last {self.size} "
                           "stored responses in memory (not those sent with store: false, nor any from before "
                           "a restart)", param, "response_not_found")
        return entry
