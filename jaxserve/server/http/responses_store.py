"""The responses kept for `GET /v1/responses/{id}` and `previous_response_id`: in memory, the most
recently stored or read `max_entries` (least recently used go first), lost on restart.

Each entry keeps the conversation as chat messages (the earlier inputs and answers, without any
instructions: OpenAI does not carry instructions over), so continuing a conversation renders its
whole history again; the prefix cache then finds most of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from jaxserve.server.http.responses_schemas import ResponseObject

DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[dict[str, Any]]    # the chat messages up to and including this response's answer
    input_items: list[dict[str, Any]]     # the request's own input, as GET .../input_items lists it


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES):
        if max_entries < 0:
            raise ValueError(f"max_entries={max_entries} must be >= 0")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()    # the routes run on one loop; the lock keeps a threaded caller safe too

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.max_entries == 0:
            return
        with self._lock:
            self._entries[entry.response.id] = entry
            self._entries.move_to_end(entry.response.id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None
