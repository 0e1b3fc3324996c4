"""The sending side: blocks of finished prefills held under leases.

`hold` (the scheduler side, when the request ends) grants the lease; the gather of its blocks is
the runner side's (`gather_held`, at the dispatch of the next step, which the engine runs at once:
sched/kv_connector.py), behind the step that wrote them, with the copy to the host started. A pull
then reads that buffer from the server's threads (`pulled`) without waiting for the step loop,
which on a prefill engine is usually in the middle of the next prompt's chunk; one that comes
before the gather waits for it (`wait_gathered`, bounded). Leases are granted, released
and expired on the step thread only (the server hops there with AsyncEngine.call), so the
scheduler's pool is never touched from two threads; a pull only reads the table."""

from __future__ import annotations

import time
from typing import Callable

from jaxserve.disagg.lease import Lease, LeaseTable
from jaxserve.sched.kv_connector import HeldBlocks, tokens_digest

GATHER_WAIT_S = 10.0   # a pull that arrives before its lease's gather waits this long at most


class LeaseGone(LookupError):
    """No live lease of that transfer id and generation (released, expired, or never granted)."""


class KVOfOtherTokens(ValueError):
    """A pull for a lease whose KV is of other tokens than the receiver's prompt."""


class KVSender:
    def __init__(self, transfer, free_held: Callable[[HeldBlocks], None], lease_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.transfer = transfer          # runner/kv_transfer.py
        self._free_held = free_held       # Scheduler.free_held_blocks
        self.leases = LeaseTable(lease_s, clock)
        self.bytes_sent = 0

    def hold(self, held: HeldBlocks) -> Lease:
        lease, old = self.leases.grant(held.request_id, held)
        if old is not None:
            self._free_held(old.held)
        if self.transfer is None or not held.block_ids:
            lease.gathered.set()   # nothing to gather (pure-logic tests, an empty prompt)
        return lease

    def gather_held(self, held: HeldBlocks) -> None:
        """Runner side (at dispatch): gather the held blocks into their lease's buffer."""
        lease = self.leases.current(held.request_id)
        if lease is None or lease.held is not held or lease.gathered.is_set():
            return   # released, expired or re-granted before its step: nobody will pull this
        lease.buffer = self.transfer.gather(held.block_ids)
        lease.buffer.copy_to_host_async()
        lease.gathered.set()

    def wait_gathered(self, transfer_id: str, timeout: float = GATHER_WAIT_S) -> None:
        """Block (a server thread) until the current lease of transfer_id has its buffer."""
        lease = self.leases.current(transfer_id)
        if lease is not None:
            lease.gathered.wait(timeout)

    def pulled(self, transfer_id: str, generation: int, first_block: int, num_blocks: int,
               num_tokens: int | None = None, tokens_sha256: bytes = b""):
        """The gathered buffer of a live lease, checked as `gather` checks (any thread: the lease
        is read once; a release racing with it cannot matter, the buffer is the lease's own copy)."""
        lease = self._checked(transfer_id, generation, first_block, num_blocks, num_tokens, tokens_sha256)
        if lease.buffer is None:
            raise LeaseGone(f"KV lease {transfer_id!r} has no gathered buffer")
        return lease.buffer

    def lease_of(self, transfer_id: str) -> Lease | None:
        return self.leases.current(transfer_id)

    def gather(self, transfer_id: str, generation: int, first_block: int, num_blocks: int,
               num_tokens: int | None = None, tokens_sha256: bytes = b""):
        """Start copying blocks [first_block, first_block + num_blocks) of a live lease into a
        contiguous device buffer (padded to its bucket). Raises LeaseGone, or KVOfOtherTokens when
        the receiver expects the KV of other tokens than the lease holds (`tokens_sha256` of its
        first `num_tokens`)."""
        lease = self._checked(transfer_id, generation, first_block, num_blocks, num_tokens, tokens_sha256)
        return self.transfer.gather(lease.held.block_ids[first_block:first_block + num_blocks])

    def _checked(self, transfer_id, generation, first_block, num_blocks, num_tokens, tokens_sha256) -> Lease:
        lease = self.leases.get(transfer_id, generation)
        if lease is None:
            raise LeaseGone(f"no live KV lease {transfer_id!r} generation {generation} (released or expired)")
        if tokens_sha256:
            held = lease.held.token_ids
            if num_tokens is None or num_tokens > len(held) or tokens_digest(held[:num_tokens]) != tokens_sha256:
                raise KVOfOtherTokens(f"KV lease {transfer_id!r} holds {len(held)} tokens that differ from the "
                                      f"{num_tokens} the receiver expects")
        ids = lease.held.block_ids
        if first_block < 0 or num_blocks < 1 or first_block + num_blocks > len(ids):
            raise ValueError(f"blocks [{first_block}, {first_block + num_blocks}) of a lease of {len(ids)} blocks")
        lease.expires_at = max(lease.expires_at, self.leases.now() + self.leases.lease_s)   # a pull is a sign of life
        return lease

    def heartbeat(self, transfer_id: str, generation: int) -> bool:
        return self.leases.extend(transfer_id, generation)

    def release(self, transfer_id: str, generation: int) -> bool:
        lease = self.leases.release(transfer_id, generation)
        if lease is not None:
            self._free_held(lease.held)
        return lease is not None

    def expire(self) -> int:
        """Free the blocks of every lease past its time; returns how many expired."""
        gone = self.leases.expire()
        for lease in gone:
            self._free_held(lease.held)
        return len(gone)
