"""KVEventPublisher: one engine's KV event batches on a ZeroMQ PUB socket, with a replay buffer.

The step loop hands each step's events to `publish`, which numbers the batch and queues it; a
thread encodes and sends, so msgpack and the socket never run on the stepping thread. Each
message is (topic, sequence number, payload); the last `buffer_steps` payloads are kept, and a
subscriber that saw a gap in the numbers asks the ROUTER socket at `replay_endpoint` for every
batch from a number on (8 bytes, big-endian) and gets them one message each, then the end mark
(sequence -1, empty payload). That is vLLM's protocol, so its subscribers work here.

Sockets are bound (an address with `*`, `::`, ipc:// or inproc://) or connected (any other), as
vLLM decides; a bind that fails (the port is taken) fails the engine's start, not later.
Numbering starts at 0 in every process: a consumer that sees the numbers go back treats it as a
restart (its engine's cache is empty again).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.kv_events import wire
from jaxserve.sched.kv_events import KVEvent

log = logging.getLogger("jaxserve.kv_events")

END_OF_REPLAY = wire.seq_bytes(-1)


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local address is bound (the stable side), any other connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class NullPublisher:
    """publisher "null": the events are taken from the scheduler every step and dropped."""

    last_seq = -1

    def publish(self, events: list[KVEvent]) -> None:
        pass

    def close(self, timeout_s: float = 2.0) -> None:
        pass


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0,
                 context: zmq.Context | None = None) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._ctx = context or zmq.Context.instance()
        self._queue: queue.Queue = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._next_seq = 0
        self.num_dropped = 0   # batches dropped because the queue was full (their numbers are a gap)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {config.endpoint!r}"
                             f"{' / ' + repr(config.replay_endpoint) if config.replay_endpoint else ''}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="jaxserve-kv-events", daemon=True)
        self._thread.start()

    @property
    def last_seq(self) -> int:
        """The number of the last batch published (-1: none yet)."""
        return self._next_seq - 1

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events as a batch (nothing when there are none)."""
        if not events:
            return
        if self._queue.qsize() >= self.config.max_queue_size:
            try:
                self._queue.get_nowait()
                self.num_dropped += 1
            except queue.Empty:
                pass
        self._queue.put((self._next_seq, time.time(), events))
        self._next_seq += 1

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, events = item
            try:
                payload = wire.encode(wire.batch(events, ts, self.data_parallel_rank))
                self._pub.send_multipart((self._topic, wire.seq_bytes(seq), payload))
                self._buffer.append((seq, payload))
            except Exception:   # noqa: BLE001 - one bad batch must not end publishing
                log.exception("KV events: batch %d was not published", seq)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames was ignored (want identity, empty, seq)",
                        len(frames))
            return
        client, _, start = frames
        start_seq = wire.seq_of(start)
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", wire.seq_bytes(seq), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for up to timeout_s), then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
        self._pub.close(linger=200)   # what the thread sent last still reaches its subscribers
