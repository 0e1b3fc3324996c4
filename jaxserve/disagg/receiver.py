"""The receiving side: loads of remote KV into this engine's blocks, with deadlines it owns.

`start_load` (step thread) registers the load in `LiveLoads` with a deadline on this engine's
clock and hands the pull to a worker thread; the step loop never waits on the wire. `poll` (step
thread, every schedule()) takes what the workers finished and

  - keeps a pulled buffer for the load's op only if the load is still live (request id and
    generation): a load cancelled meanwhile (deadline, abort) gave its blocks back, and another
    request may own them now, so its late bytes are dropped and counted, never written. The write
    itself is the runner side's (`apply_load`, at the dispatch of the step the scheduler put the
    load in: sched/kv_connector.py), so poll never touches the arena;
  - fails every live load past its deadline, whatever the wire is doing: the library or the peer
    is never trusted to time out. The pull itself is left to end on its own bounded timeout (it
    cannot be recalled in general: RDMA writes and the transfer library's pulls cannot), which is
    exactly the late arrival the generation check is for.

Every load that ends, and every late arrival, acknowledges the sender's lease (best effort), so
its blocks go back as soon as the sender hears; a heartbeat thread extends the leases of loads
still in flight. A peer that is gone costs the load its deadline at most, then the policy.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from jaxserve.disagg.handshake import KVLayout, KVLayoutMismatch, check_compatible
from jaxserve.disagg.transport import KVClient, KVPullError
from jaxserve.sched.kv_connector import KVLoad, KVLoadResult, LiveLoads, RemoteKV

log = logging.getLogger(__name__)
CONTROL_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class _Pulled:
    load: KVLoad
    data: np.ndarray | None
    error: KVPullError | None
    seconds: float


class KVReceiver:
    def __init__(self, transfer, local: KVLayout, client: KVClient, *, timeout_s: float, lease_s: float,
                 clock: Callable[[], float] = time.monotonic, workers: int = 8, on_transfer=None):
        self.transfer = transfer        # runner/kv_transfer.py (None in pure-logic tests)
        self.local = local
        self.client = client
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        self._clock = clock
        self.live = LiveLoads()
        self._live_lock = threading.Lock()       # the step thread and the workers both consult it
        self._deadlines: dict[tuple[str, int], float] = {}
        self._done: queue.SimpleQueue[_Pulled] = queue.SimpleQueue()
        self._ready: dict[tuple[str, int], _Pulled] = {}   # pulled, live, waiting for their op
        self._arrived = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jaxserve-kv-pull")
        self._layouts: dict[str, KVLayout] = {}    # peers whose layout matched
        self._layouts_lock = threading.Lock()
        self._on_transfer = on_transfer           # (bytes, seconds) of each applied load: metrics
        self.bytes_received = 0
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeats, name="jaxserve-kv-heartbeat", daemon=True)
        self._heartbeat.start()

    # ---- step thread ----
    def start_load(self, load: KVLoad) -> None:
        with self._live_lock:
            self.live.add(load)
        self._deadlines[(load.request_id, load.generation)] = self._clock() + self.timeout_s
        self._pool.submit(self._pull, load)

    def poll(self) -> list[KVLoadResult]:
        results = []
        while True:
            try:
                p = self._done.get_nowait()
            except queue.Empty:
                break
            with self._live_lock:
                load = self.live.take(p.load.request_id, p.load.generation)
            if load is None:
                log.info("dropped a late KV transfer for %s (generation %d): its load was cancelled",
                         p.load.request_id, p.load.generation)
                self._release(p.load.remote)
                continue
            self._deadlines.pop((load.request_id, load.generation), None)
            self._release(load.remote)
            if p.error is not None:
                results.append(KVLoadResult(load.request_id, load.generation, False, p.error.reason, p.error.detail))
                continue
            self._ready[(load.request_id, load.generation)] = p
            results.append(KVLoadResult(load.request_id, load.generation, True))
        now = self._clock()
        for load in self.live:
            if now >= self._deadlines.get((load.request_id, load.generation), now):
                self.cancel_load(load.request_id, load.generation)
                results.append(KVLoadResult(load.request_id, load.generation, False, "timeout",
                                            f"no KV from {load.remote.peer} within {self.timeout_s:g} s"))
        self._arrived.clear()
        return results

    def apply_load(self, load: KVLoad) -> None:
        """Runner side (at dispatch): write a load's pulled bytes into its blocks."""
        p = self._ready.pop((load.request_id, load.generation))
        if self.transfer is not None:
            self.transfer.scatter(load.dst_block_ids, p.data)
        self.bytes_received += p.data.nbytes
        if self._on_transfer is not None:
            self._on_transfer(p.data.nbytes, p.seconds)

    def cancel_load(self, request_id: str, generation: int) -> None:
        self._ready.pop((request_id, generation), None)   # pulled but not to be written after all
        with self._live_lock:
            load = self.live.cancel(request_id, generation)
        if load is not None:
            self._deadlines.pop((request_id, generation), None)
            self._release(load.remote)

    def release_remote(self, remote: RemoteKV) -> None:
        self._release(remote)

    def wait(self, timeout: float) -> None:
        """Block until a pull ends or `timeout` passes (the step loop has nothing else to do)."""
        self._arrived.wait(timeout)

    @property
    def num_stale(self) -> int:
        return self.live.num_stale

    # ---- worker threads ----
    def _pull(self, load: KVLoad) -> None:
        t = time.perf_counter()
        data = error = None
        try:
            block = self._checked_layout(load.remote.peer)
            # bounded on its own, longer than the deadline: the deadline is enforced in poll(),
            # and a pull that ends after it is dropped there by its generation
            data = self.client.pull(load.remote, load.first_block, len(load.dst_block_ids), block,
                                    timeout=self.timeout_s + self.lease_s, num_tokens=load.num_tokens,
                                    tokens_sha256=load.tokens_sha256)
        except KVPullError as e:
            error = e
        except KVLayoutMismatch as e:
            error = KVPullError("layout", str(e))
        except Exception as e:   # noqa: BLE001 - a bug must fail the load, not lose it
            log.exception("KV pull failed")
            error = KVPullError("error", f"{type(e).__name__}: {e}")
        with self._live_lock:
            late = self.live.get(load.request_id, load.generation) is None
            if late:
                self.live.num_stale += 1
        if late:   # cancelled while on the wire (an idle engine may not poll for a long time)
            log.info("dropped a late KV transfer for %s (generation %d): its load was cancelled",
                     load.request_id, load.generation)
            self._release(load.remote)
            return
        self._done.put(_Pulled(load, data, error, time.perf_counter() - t))
        self._arrived.set()

    def _checked_layout(self, peer: str):
        with self._layouts_lock:
            known = self._layouts.get(peer)
        if known is None:
            known = self.client.layout(peer, timeout=min(CONTROL_TIMEOUT_S, self.timeout_s))
            check_compatible(self.local, known, peer)
            with self._layouts_lock:
                self._layouts[peer] = known
        return known.block

    def _release(self, remote: RemoteKV) -> None:
        self._pool.submit(self._control, remote, True)

    def _control(self, remote: RemoteKV, release: bool) -> None:
        try:
            self.client.lease(remote, release=release, timeout=CONTROL_TIMEOUT_S)
        except Exception as e:   # noqa: BLE001 - best effort: the lease expires on its own
            log.info("KV lease %s to %s failed: %s", "release" if release else "heartbeat", remote.peer, e)

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            for load in self.live:
                self._pool.submit(self._control, load.remote, False)

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
