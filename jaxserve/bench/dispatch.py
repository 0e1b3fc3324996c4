"""Which requests are due to be sent, given send offsets, groups and a concurrency cap.

Shared by every driver that sends requests over time (the jaxserve step loop, transformers'
continuous batching, the gRPC load generator), so they all release requests by the same rules:

- a request is due at start + arrival_offset; with `after_group` set, at the moment every
  request of that group has its first token, plus arrival_offset;
- with `max_concurrency`, a due request waits until fewer than that many are in flight. As in
  vLLM's serving benchmark, its arrival time is when it is actually sent, so TTFT measures the
  engine, not the client's own queue.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from jaxserve.bench.workloads import BenchRequest


class Dispatcher:
    def __init__(self, requests: Sequence[BenchRequest], start: float, max_concurrency: int | None = None) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.start = start
        self.max_concurrency = max_concurrency
        self._waiting = list(requests)  # in send order
        self._group_pending: dict[str, set[str]] = {}
        for r in requests:
            if r.group:
                self._group_pending.setdefault(r.group, set()).add(r.request_id)
        self._group_done_at: dict[str, float] = {g: start for g, ids in self._group_pending.items() if not ids}
        self._in_flight: set[str] = set()
        # when each free seat became free: a request taking a seat arrives no earlier than that
        self._free_seats: list[float] = [start] * (max_concurrency or 0)
        self.sent_at: dict[str, float] = {}

    def _due_time(self, r: BenchRequest) -> float | None:
        if r.after_group is None:
            return self.start + r.arrival_offset
        base = self._group_done_at.get(r.after_group)
        if base is None and r.after_group not in self._group_pending:
            raise ValueError(f"{r.request_id}: after_group {r.after_group!r} names no group of this run")
        return None if base is None else base + r.arrival_offset

    def pop_due(self, now: float) -> list[BenchRequest]:
        """Requests to send now, marked in flight; `sent_at` gets the time each really arrived.

        A driver that was busy (inside an engine step) when a request fell due sends it late; the
        request's arrival is still its due time (or the time its seat freed), as it would be for a
        server whose clients do not wait for the step to end.
        """
        out, keep = [], []
        for r in self._waiting:
            due = self._due_time(r)
            room = self.max_concurrency is None or bool(self._free_seats)
            if due is not None and due <= now and room:
                out.append(r)
                self._in_flight.add(r.request_id)
                seat = heapq.heappop(self._free_seats) if self.max_concurrency is not None else due
                self.sent_at[r.request_id] = max(due, seat)
            else:
                keep.append(r)
        self._waiting = keep
        return out

    @property
    def has_free_seat(self) -> bool:
        """Whether a due request could be sent now (always, without a concurrency cap)."""
        return self.max_concurrency is None or bool(self._free_seats)

    def next_due(self) -> float | None:
        """Earliest known due time of a waiting request (None when none is known yet)."""
        times = [t for r in self._waiting if (t := self._due_time(r)) is not None]
        return min(times) if times else None

    def first_token(self, request_id: str, group: str, now: float) -> None:
        ids = self._group_pending.get(group)
        if ids is not None and request_id in ids:
            ids.discard(request_id)
            if not ids:
                self._group_done_at[group] = now

    def finished(self, request_id: str, now: float) -> None:
        if request_id in self._in_flight:
            self._in_flight.discard(request_id)
            if self.max_concurrency is not None:
                heapq.heappush(self._free_seats, now)

    @property
    def has_waiting(self) -> bool:
        return bool(self._waiting)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)
