"""Errors the scheduler raises at the door, beyond ValueError for a bad request."""

from __future__ import annotations


class Overloaded(RuntimeError):
    """The waiting queue is full (`max_waiting_requests` beyond the free seats): try again later.
    The request was not queued. The gRPC service maps this to RESOURCE_EXHAUSTED, an HTTP front
    door to 503/429."""

    def __init__(self, num_waiting: int, max_waiting_requests: int, free_seats: int = 0) -> None:
        super().__init__(
            f"overloaded: {num_waiting} requests are waiting for {free_seats} free seat(s), so "
            f"{num_waiting - free_seats} cannot be admitted now, the limit is "
            f"max_waiting_requests={max_waiting_requests}; retry later"
        )
        self.num_waiting = num_waiting
        self.max_waiting_requests = max_waiting_requests
        self.free_seats = free_seats
