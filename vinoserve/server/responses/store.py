"""Finished responses kept in memory for previous_response_id, GET and DELETE: at most
`--max-stored-responses` of them, the least recently used dropped first. Nothing is written to
disk; a restart forgets them all (a later previous_response_id is then a 404)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from vinoserve.server.errors import APIError


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as it was returned
    input_items: list[dict]  # this request's own input items, with ids
    conversation: list  # every item up to and including this response's output, as input items


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[stored.response["id"]] = stored
        self._items.move_to_end(stored.response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response (now the most recently used), or a 404 in OpenAI's words."""
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(404, f"No response found with id '{response_id}'.", param, "not_found")
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]
