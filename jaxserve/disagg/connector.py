"""The scheduler's KVConnector (sched/kv_connector.py) of a disaggregated engine: the sending
side (sender.py) on a prefill engine, the receiving side (receiver.py) on a decode engine, both
on an engine that is told to do both. Also the metrics both sides count."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from jaxserve.disagg.receiver import KVReceiver
from jaxserve.disagg.sender import KVSender
from jaxserve.sched.kv_connector import HeldBlocks, KVConnectorOps, KVLoad, KVLoadResult, RemoteKV

# transfer-time histogram buckets (seconds), loopback to cross-host
TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class TransferMetrics:
    """Counted on the step thread and the pull workers; read by Prometheus scrapes."""

    transfers: int = 0
    bytes: int = 0
    seconds_buckets: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_SECONDS_BUCKETS) + 1))
    seconds_sum: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.transfers += 1
            self.bytes += nbytes
            self.seconds_sum += seconds
            i = next((i for i, b in enumerate(TRANSFER_SECONDS_BUCKETS) if seconds <= b), len(TRANSFER_SECONDS_BUCKETS))
            self.seconds_buckets[i] += 1

    def seconds_histogram(self) -> tuple[list[int], float]:
        """(count per bucket, sum of seconds), read together under the lock."""
        with self._lock:
            return list(self.seconds_buckets), self.seconds_sum


class DisaggConnector:
    def __init__(self, sender: KVSender | None, receiver: KVReceiver | None, metrics: TransferMetrics):
        self.sender = sender
        self.receiver = receiver
        self.metrics = metrics

    @property
    def can_send(self) -> bool:
        return self.sender is not None

    @property
    def can_load(self) -> bool:
        return self.receiver is not None

    # ---- receiving ----
    def num_matched_tokens(self, request) -> int:
        """Tokens whose KV this connector can supply for `request` (side-effect free): what its
        remote lease says it holds."""
        remote = getattr(request, "remote_kv", None)
        return remote.num_tokens if remote is not None and self.receiver is not None else 0

    def start_load(self, load: KVLoad) -> None:
        self._receiving().start_load(load)

    def poll(self) -> list[KVLoadResult]:
        if self.sender is not None:
            self.sender.expire()
        return self.receiver.poll() if self.receiver is not None else []

    def cancel_load(self, request_id: str, generation: int) -> None:
        self._receiving().cancel_load(request_id, generation)

    def release_remote(self, remote: RemoteKV) -> None:
        self._receiving().release_remote(remote)

    def wait(self, timeout: float) -> None:
        if self.receiver is not None:
            self.receiver.wait(timeout)

    def _receiving(self) -> KVReceiver:
        if self.receiver is None:
            raise RuntimeError("this engine's role cannot load remote KV (it is a prefill engine)")
        return self.receiver

    # ---- sending ----
    def hold(self, held: HeldBlocks) -> None:
        if self.sender is None:
            raise RuntimeError("this engine's role cannot hold KV for a receiver (it is a decode engine)")
        self.sender.hold(held)

    # ---- the runner side (KVConnectorWorker) ----
    def apply(self, ops: KVConnectorOps) -> None:
        """A step's connector work, at its dispatch: pulled bytes into their blocks, held blocks
        gathered for their leases."""
        for load in ops.loads:
            self._receiving().apply_load(load)
        for held in ops.saves:
            self.sender.gather_held(held)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
