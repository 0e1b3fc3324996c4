"""Leases on the sending side: a finished prefill's blocks are held for the receiver until it
acknowledges (release) or the lease runs out; each receiver heartbeat extends it.

Every lease has a generation, unique in this engine's life. A pull names (transfer id,
generation): a lease that was released or expired, and a later one under the same transfer id,
never answer it, so a receiver can never read blocks that were freed and handed to another
request. Pure Python with an injected clock; the sender (sender.py) frees what `expire()` returns.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from jaxserve.sched.kv_connector import HeldBlocks


@dataclass(slots=True)
class Lease:
    transfer_id: str
    generation: int
    held: HeldBlocks
    expires_at: float
    granted_at: float = field(default=0.0)
    buffer: object = None   # the held blocks' contents, gathered at the next step's dispatch (sender.py)
    gathered: threading.Event = field(default_factory=threading.Event)   # set once `buffer` is there


class LeaseTable:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic):
        if not lease_s > 0:
            raise ValueError(f"lease_s={lease_s} must be > 0")
        self.lease_s = lease_s
        self._clock = clock
        self._generations = itertools.count(1)
        self._leases: dict[str, Lease] = {}
        self.num_granted = 0
        self.num_released = 0
        self.num_expired = 0

    def grant(self, transfer_id: str, held: HeldBlocks) -> tuple[Lease, Lease | None]:
        """A new lease; and the one it replaces under the same transfer id, if any (to be freed:
        the ids came from a client, and a reused id must not extend someone else's blocks)."""
        old = self._leases.pop(transfer_id, None)
        now = self._clock()
        lease = Lease(transfer_id, next(self._generations), held, now + self.lease_s, now)
        self._leases[transfer_id] = lease
        self.num_granted += 1
        return lease, old

    def get(self, transfer_id: str, generation: int) -> Lease | None:
        lease = self._leases.get(transfer_id)
        return lease if lease is not None and lease.generation == generation else None

    def now(self) -> float:
        return self._clock()

    def current(self, transfer_id: str) -> Lease | None:
        return self._leases.get(transfer_id)

    def extend(self, transfer_id: str, generation: int) -> bool:
        lease = self.get(transfer_id, generation)
        if lease is None:
            return False
        lease.expires_at = max(lease.expires_at, self._clock() + self.lease_s)
        return True

    def release(self, transfer_id: str, generation: int) -> Lease | None:
        lease = self.get(transfer_id, generation)
        if lease is not None:
            del self._leases[transfer_id]
            self.num_released += 1
        return lease

    def expire(self) -> list[Lease]:
        now = self._clock()
        gone = [l for l in self._leases.values() if l.expires_at <= now]
        for lease in gone:
            del self._leases[lease.transfer_id]
        self.num_expired += len(gone)
        return gone

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def num_blocks_held(self) -> int:
        return sum(len(l.held.block_ids) for l in self._leases.values())
