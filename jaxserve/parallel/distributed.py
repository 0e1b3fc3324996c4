"""Several hosts, one mesh: `jax.distributed`, a leader that schedules, followers that mirror.

`join` calls `jax.distributed.initialize` (from --num-hosts, --host-rank, --coordinator-address,
or JAX's own JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID); after it
`jax.devices()` lists every host's devices and the mesh spans them all (mesh.py). The model's
collectives are XLA's (over Gloo on CPUs, NCCL on GPUs); nothing here carries tensors.

Who decides: rank 0 (the leader) runs the scheduler and the service; every other rank (a
follower) runs no scheduler at all. Each step the leader packs (runner/batch.py) and publishes
the step's inputs (`StepInputs`: block operations and packed arrays, a few KB) through the
coordination service's key-value store, and every follower runs the same compiled programs on
them in the same order. The alternative, the same deterministic scheduler on every rank fed the
same requests, would need every host-side input of a decision to agree across hosts: arrival
times, the step-time measurements the chunk policy and speculation planner use, stop strings
found by each host's detokenizer, aborts from clients. One scheduler has none of those to agree
on, and a follower needs no tokenizer, service or request state.

Failure: every rank increments its own counter in the same store every `HEARTBEAT_S`, and a
watchdog thread on each rank ends that rank (exit status 1, a message naming the rank that went
quiet) when another rank's counter has not moved for `timeout_s`, or when the store itself (the
coordination service, hosted by rank 0) stops answering. Before ending, the leader calls
`on_failure` (the server turns its health NOT_SERVING). A leader that dies ends its followers
sooner still: JAX's client polls the coordination service for errors and aborts the process (exit
status 134, JAX's message that the leader task died) as soon as the service is gone. JAX's own
heartbeat is set to twice the timeout, a backstop that ends a process stuck where no Python
thread runs.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
POLL_MS = 1000               # a follower's wait for the next step, between liveness checks
PREFIX = "jaxserve/"
STOP = "stop"


@dataclass(frozen=True, slots=True)
class HostConfig:
    num_hosts: int
    host_rank: int
    coordinator_address: str
    timeout_s: float

    @property
    def is_leader(self) -> bool:
        return self.host_rank == 0

    @classmethod
    def resolve(cls, num_hosts: int, host_rank: int | None, coordinator_address: str | None,
                timeout_s: float) -> "HostConfig | None":
        """From the flags, else JAX's environment variables; None for one host."""
        env = os.environ
        num_hosts = num_hosts if num_hosts > 1 else int(env.get("JAX_NUM_PROCESSES", "1"))
        if num_hosts <= 1:
            return None
        if host_rank is None and "JAX_PROCESS_ID" in env:
            host_rank = int(env["JAX_PROCESS_ID"])
        coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
        if host_rank is None or coordinator_address is None:
            raise ValueError(f"num_hosts={num_hosts} needs host_rank and coordinator_address (HOST:PORT, rank 0's "
                             f"address), as flags or JAX_PROCESS_ID / JAX_COORDINATOR_ADDRESS")
        if not 0 <= host_rank < num_hosts:
            raise ValueError(f"host_rank={host_rank} must be in [0, {num_hosts})")
        return cls(num_hosts, host_rank, coordinator_address, timeout_s)


_joined: "Hosts | None" = None


def join(config: HostConfig) -> "Hosts":
    """Initialise jax.distributed once per process (before anything starts jax's backend) and
    start the liveness watchdog."""
    global _joined
    if _joined is not None:
        if _joined.config != config:
            raise ValueError(f"this process already joined {_joined.config}")
        return _joined
    import jax

    # JAX's preemption service catches SIGTERM for its own sync points, which jaxserve does not use:
    # left on, a server's SIGTERM would never reach its graceful drain
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(config.coordinator_address, config.num_hosts, config.host_rank,
                               heartbeat_timeout_seconds=max(2, int(2 * config.timeout_s)),
                               initialization_timeout=max(60, int(config.timeout_s * 4)),
                               # at exit every rank waits for the others at a barrier: bounded, so a
                               # leader whose follower is gone still exits
                               shutdown_timeout_seconds=max(10, int(2 * config.timeout_s)))
    _joined = Hosts(config)
    _joined.start_watchdog()
    return _joined


class Hosts:
    """This process's view of the group: the store, the watchdog, the step channel."""

    def __init__(self, config: HostConfig):
        from jax._src import distributed

        self.config = config
        self._store = distributed.global_state.client
        self.on_failure: Callable[[str], None] | None = None
        self._stopped = threading.Event()
        self._published = 0

    # -- liveness --------------------------------------------------------------------------
    def start_watchdog(self) -> None:
        threading.Thread(target=self._watch, name="jaxserve-hosts-watchdog", daemon=True).start()

    def _watch(self) -> None:
        me, others = self.config.host_rank, [r for r in range(self.config.num_hosts) if r != self.config.host_rank]
        seen = {r: (None, time.monotonic()) for r in others}
        while not self._stopped.is_set():
            try:
                self._store.key_value_increment(f"{PREFIX}alive/{me}", 1)
                for r in others:
                    value = self._counter(r)
                    if value != seen[r][0]:
                        seen[r] = (value, time.monotonic())
                    elif time.monotonic() - seen[r][1] > self.config.timeout_s:
                        self.fail(f"host rank {r} stopped answering (no heartbeat for {self.config.timeout_s:.0f} s); "
                                  f"rank {me} ends, since the mesh spans every host")
                        return
            except Exception as e:  # noqa: BLE001 - the coordination service itself is gone
                if self._stopped.is_set():
                    return
                self.fail(f"the coordination service at {self.config.coordinator_address} (host rank 0) stopped "
                          f"answering ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                          f"rank {me} ends")
                return
            time.sleep(HEARTBEAT_S)

    def _counter(self, rank: int) -> str | None:
        """A rank's heartbeat counter; None before its first beat."""
        try:
            return self._store.key_value_try_get(f"{PREFIX}alive/{rank}")
        except Exception as e:  # noqa: BLE001 - not written yet reads as NOT_FOUND
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise

    def fail(self, message: str) -> None:
        """End this process: a rank the mesh needs is gone, so no step can finish."""
        log.error("%s", message)
        print(f"jaxserve: {message}", file=sys.stderr, flush=True)
        if self.on_failure is not None:
            try:
                self.on_failure(message)
                time.sleep(1.0)          # let a health watcher see NOT_SERVING before the port closes
            except Exception:  # noqa: BLE001
                pass
        os._exit(1)

    # -- steps -----------------------------------------------------------------------------
    def publish(self, inputs) -> None:
        """Leader: the next step's inputs (runner.model_runner.StepInputs), for every follower."""
        self._store.key_value_set_bytes(f"{PREFIX}step/{self._published}", pickle.dumps(inputs, protocol=5))
        if self._published >= 2:       # followers have long read it: keep the store small
            self._store.key_value_delete(f"{PREFIX}step/{self._published - 2}")
        self._published += 1

    def stop_followers(self) -> None:
        """Leader, at exit: followers leave their loop and exit 0."""
        if not self._stopped.is_set():
            self.publish(STOP)
            self._stopped.set()

    def follow_then_exit(self, runner) -> None:
        """Follower: run the leader's steps until it stops, then leave the group and end this process
        (status 0). A follower has nothing to save, and its caller (a server still "warming up", an
        LLM constructor) has nothing to return."""
        self.follow(runner)
        log.info("host rank %d: the leader stopped; exiting", self.config.host_rank)
        import jax

        try:
            jax.distributed.shutdown()          # the exit barrier the leader waits at
        finally:
            logging.shutdown()
            os._exit(0)

    def follow(self, runner) -> None:
        """Follower: run every step the leader publishes, in order, until it says stop."""
        n = 0
        while True:
            try:
                data = self._store.blocking_key_value_get_bytes(f"{PREFIX}step/{n}", POLL_MS)
            except Exception as e:  # noqa: BLE001 - a timeout: idle leader; the watchdog judges liveness
                if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                    continue
                raise
            inputs = pickle.loads(data)
            if inputs == STOP:
                self._stopped.set()
                return
            runner.run_inputs(inputs)
            n += 1


def lead(hosts: Hosts, runner) -> None:
    """Make `runner` (rank 0's) publish every step, and stop the followers when this process ends."""
    runner.mirror_steps_to(hosts)
    atexit.register(hosts.stop_followers)
