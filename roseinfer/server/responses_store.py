"""The Responses API's stored responses (`store`, `previous_response_id`, `GET` / `DELETE
/v1/responses/{id}`): in the server's memory, bounded by a count and by the JSON text each entry
keeps alive, least recently used evicted first.

Touched only from the event loop (the route handlers, never `run_blocking`), so it needs no lock.
An entry keeps the whole conversation a follow-up continues (the earlier turns' items, shared with
the entry it followed, then its own input and output items); its size is charged with the earlier
entry's whole size, so the bound holds on what every entry keeps alive even where entries share.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

Item = dict[str, Any]
RESPONSE_NOT_FOUND = "response_not_found"  # the error code of an id not in the store (and the refusal's reason)
_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was sent
    input_items: list[Item]  # its own input, each item with an id (GET .../input_items)
    conversation: tuple[Item, ...]  # what a follow-up continues: earlier turns, its input, its output
    size: int  # bytes of JSON text charged against the store's bound

    @classmethod
    def of(cls, response: dict[str, Any], input_items: list[Item], earlier: StoredResponse | None) -> StoredResponse:
        history = earlier.conversation if earlier is not None else ()
        size = (earlier.size if earlier is not None else 0) + len(_json.encode(input_items)) + \
            len(_json.encode(response))
        return cls(response, input_items, (*history, *input_items, *response["output"]), size)


class ResponseStore:
    """At most `max_responses` entries and `max_bytes` of their JSON text; 0 responses: disabled."""

    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.size = 0

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used; None when it was never stored, evicted or deleted."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep `entry`, evicting the least recently used until both bounds hold; an entry past the
        byte bound alone is not kept (False)."""
        if not self.enabled or entry.size > self.max_bytes:
            return False
        self.delete(response_id)
        self._entries[response_id] = entry
        self.size += entry.size
        while len(self._entries) > self.max_responses or self.size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.size -= evicted.size
        return True

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.size -= entry.size
        return entry is not None
