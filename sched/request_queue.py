"""The waiting queue: requests without a seat, in the order they should be admitted.

Order is by a key fixed when the request arrives (its arrival sequence number), so a preempted
request, which keeps its key, goes back in front of every request that arrived after it. Fork
children take their parent's sequence number, so they sit right behind it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from jaxserve.sched.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._keys: list[tuple] = []
        self._reqs: list[Request] = []

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._reqs))

    def __getitem__(self, i: int) -> Request:
        return self._reqs[i]

    def push(self, req: Request, key: tuple) -> None:
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, req)

    def index(self, req: Request) -> int:
        for i, r in enumerate(self._reqs):
            if r is req:
                return i
        raise ValueError(f"request {req.request_id!r} is not waiting")

    def remove(self, req: Request) -> None:
        for i, r in enumerate(self._reqs):
            if r is req:
                del self._keys[i]
                del self._reqs[i]
                return
        raise ValueError(f"request {req.request_id!r} is not waiting")
