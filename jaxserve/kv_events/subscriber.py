"""KVEventSubscriber: one engine's KV event batches, in order, with what was missed replayed.

A thread receives (topic, seq, payload) from the engine's PUB socket and calls `on_batch(seq,
batch)` for each batch in sequence order. A gap in the numbers (a slow joiner, a full queue) is
filled from the engine's replay endpoint when it has one (and a stream quiet for a second asks it
too: batches sent before the subscription took effect leave no gap to see); what the replay buffer no longer holds
is counted in `num_missed` and the next batch is applied anyway (the consumer's view then lacks
those changes: an index that misses a store under-counts, a missed removal over-counts until the
block is stored again or the cache is cleared). Numbers that go back on the live stream mean the
engine restarted: `on_restart()` runs (its cache is empty), and its batches are taken from 0. `resync()` forgets the position: the
next batches are asked for from the replay buffer's start (the router calls it when a replica was
away and its index was cleared).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import zmq

from jaxserve.kv_events import wire

log = logging.getLogger("jaxserve.kv_events")

REPLAY_TIMEOUT_MS = 2000
IDLE_REPLAY_S = 1.0     # a quiet stream asks the replay endpoint for anything after the last batch this often


class KVEventSubscriber:
    def __init__(self, endpoint: str, on_batch: Callable[[int, wire.KVEventBatch], None], *,
                 replay_endpoint: str | None = None, topic: str = "",
                 on_restart: Callable[[], None] = lambda: None, context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._on_batch = on_batch
        self._on_restart = on_restart
        self._ctx = context or zmq.Context.instance()
        self._topic = topic.encode()
        # with a replay endpoint every batch from 0 is wanted; without one, whatever comes first
        self._start = 0 if replay_endpoint is not None else None
        self._expected: int | None = self._start   # the next number to apply
        self._sub_last = -1                 # the last number the live stream brought
        self._resync = threading.Event()
        self._stop = threading.Event()
        self._seen = threading.Condition()
        self.last_seq = -1        # the last batch applied
        self.num_missed = 0       # batches neither received nor replayed
        self.num_restarts = 0
        self._thread = threading.Thread(target=self._run, name="jaxserve-kv-events-sub", daemon=True)
        self._thread.start()

    def resync(self) -> None:
        self._resync.set()

    def wait_for(self, seq: int, timeout_s: float) -> bool:
        """Whether batch `seq` was applied within timeout_s (for tests and tools)."""
        with self._seen:
            return self._seen.wait_for(lambda: self.last_seq >= seq, timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    # ---- the thread ----
    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self.endpoint)
        self._replay_from(0)   # what the engine did before this subscriber joined
        quiet_since = time.monotonic()
        try:
            while not self._stop.is_set():
                if self._resync.is_set():
                    self._resync.clear()
                    self._expected, self._sub_last = self._start, -1
                    self._replay_from(0)
                if not sub.poll(100):
                    if time.monotonic() - quiet_since >= IDLE_REPLAY_S:
                        self._check_quiet_stream()
                        quiet_since = time.monotonic()
                    continue
                quiet_since = time.monotonic()
                _, seq_frame, payload = sub.recv_multipart()
                seq = wire.seq_of(seq_frame)
                if seq <= self._sub_last:
                    # one publisher's numbers only grow on the live stream: this is a new process
                    self._restarted(f"numbers went back ({seq} after {self._sub_last})")
                self._sub_last = seq
                if self._expected is not None and seq > self._expected:
                    self._replay_from(self._expected)
                if self._expected is not None and seq < self._expected:
                    continue   # a replay brought it already
                self._apply(seq, payload)
        finally:
            sub.close(linger=0)

    def _restarted(self, why: str) -> None:
        self.num_restarts += 1
        log.info("KV events from %s: %s: the engine restarted", self.endpoint, why)
        self._on_restart()
        self._expected = 0

    def _check_quiet_stream(self) -> None:
        """Batches sent before the subscription reached the publisher (ZeroMQ's slow joiner), or by
        a restarted engine before the socket reconnected, leave no gap to see until another comes:
        a quiet stream asks for everything from the last batch applied. An engine that no longer
        has that batch, when it keeps its latest ones, numbers from 0 again: it restarted."""
        if self.replay_endpoint is None:
            return
        if not self._expected:
            self._replay_from(0)
        elif self._replay_from(self._expected - 1) == 0:
            self._restarted("its replay buffer lacks the last batch applied")
            self._replay_from(0)

    def _replay_from(self, start: int) -> int | None:
        """Apply the engine's buffered batches from `start` on, if it has a replay endpoint that
        answers; returns how many it sent (None: no answer). A socket per replay: an unanswered
        request must not leave a late answer behind."""
        if self.replay_endpoint is None:
            return None
        sent = 0
        replay = self._ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        try:
            replay.connect(self.replay_endpoint)
            replay.send_multipart((b"", wire.seq_bytes(start)))
            while replay.poll(REPLAY_TIMEOUT_MS):
                _, seq_frame, payload = replay.recv_multipart()
                seq = wire.seq_of(seq_frame)
                if seq < 0:
                    return sent
                sent += 1
                if self._expected is None or seq >= self._expected:
                    self._apply(seq, payload)
            log.info("KV events: the replay endpoint %s did not answer in %d ms", self.replay_endpoint,
                     REPLAY_TIMEOUT_MS)
            return None
        finally:
            replay.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        if self._expected is not None and seq > self._expected:
            self.num_missed += seq - self._expected
            log.warning("KV events from %s: batches %d..%d were lost", self.endpoint, self._expected, seq - 1)
        try:
            self._on_batch(seq, wire.decode(payload))
        except Exception:   # noqa: BLE001 - a consumer's error must not end the subscription
            log.exception("KV events from %s: batch %d was not applied", self.endpoint, seq)
        self._expected = seq + 1
        with self._seen:
            self.last_seq = seq
            self._seen.notify_all()
