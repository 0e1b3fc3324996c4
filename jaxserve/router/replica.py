"""Replica: one `jaxserve serve` behind the router, as the router sees it.

Its channel and stubs, its health (watched with grpc.health.v1 Watch, so a change arrives as it
happens; a broken watch means unreachable and is retried every `retry_s`), what the router has on
it now (in-flight requests, their uncached prompt tokens before their first token) and its
PrefixIndex. A replica that leaves SERVING (dies, drains, restarts) loses its index: when it comes
back its prefix cache may be empty, and an index that claims otherwise would pull requests to it
for nothing.

SUSPECT: a replica that stopped answering while its health watch stayed silent (a stopped or
partitioned host keeps its sockets and sends nothing; router/disagg.py marks a prefill engine
whose hop ran past its deadline). It is not serving, so requests skip it at once; after
`suspect_s` it is probed with a health Check every `retry_s` (each bounded by `probe_timeout_s`),
and the first answer, or any message of its health watch, ends it. Its index is kept: a stopped
process resumes with its prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.router.policy import ReplicaView
from jaxserve.router.prefix_index import PrefixIndex
from jaxserve.proto import generation_pb2_grpc as pb_grpc

log = logging.getLogger("jaxserve.router")

SERVING = "SERVING"
NOT_SERVING = "NOT_SERVING"
UNREACHABLE = "UNREACHABLE"
SUSPECT = "SUSPECT"


@dataclass(frozen=True, slots=True)
class ReplicaAddress:
    host: str
    port: int

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @staticmethod
    def parse(text: str) -> "ReplicaAddress":
        host, sep, port = text.strip().rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--replica {text!r} must be HOST:PORT with a port in [1, 65535]")
        return ReplicaAddress(host, int(port))


@dataclass(frozen=True, slots=True)
class ReplicaClientConfig:
    """How the router talks to its replicas."""

    api_key: str | None = None             # the replicas' bearer token
    tls_root_cert: bytes | None = None     # PEM; None: plaintext
    max_message_bytes: int = 64 << 20
    retry_s: float = 0.5                   # between health-watch attempts of an unreachable replica
    probe_timeout_s: float = 1.0           # a SUSPECT replica's health Check


class Replica:
    def __init__(self, address: ReplicaAddress, config: ReplicaClientConfig, index: PrefixIndex,
                 on_health: Callable[["Replica"], None] = lambda r: None):
        self.address = address
        self.target = address.target
        self.config = config
        self.index = index
        self.health = UNREACHABLE
        self.in_flight = 0
        self.pending_prefill_tokens = 0
        self.routed_requests = 0
        self._on_health = on_health
        options = [("grpc.max_receive_message_length", config.max_message_bytes),
                   ("grpc.max_send_message_length", config.max_message_bytes),
                   # a dead replica is noticed by the health watch, not by a long reconnect backoff
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
        if config.tls_root_cert is not None:
            self.channel = aio.secure_channel(self.target, grpc.ssl_channel_credentials(config.tls_root_cert), options)
        else:
            self.channel = aio.insecure_channel(self.target, options)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self._health_stub = health_pb2_grpc.HealthStub(self.channel)
        self._watch: asyncio.Task | None = None
        self._probe: asyncio.Task | None = None

    @property
    def metadata(self) -> tuple:
        return (("authorization", f"Bearer {self.config.api_key}"),) if self.config.api_key else ()

    @property
    def serving(self) -> bool:
        return self.health == SERVING

    def view(self, salt: str | None, ids) -> ReplicaView:
        return ReplicaView(self.pending_prefill_tokens, self.in_flight,
                           self.index.peek(salt, ids) if ids else 0, self.index.num_tokens)

    def start(self) -> None:
        self._watch = asyncio.ensure_future(self._watch_health())

    async def close(self) -> None:
        for task in (self._watch, self._probe):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.channel.close()

    def mark_suspect(self, why: str, suspect_s: float) -> bool:
        """Not serving until it answers a health Check (probed after `suspect_s`) or its watch speaks.
        False when it was not serving anyway (already suspect: another hop that was in flight)."""
        if self.health != SERVING:
            return False   # already out of the pool, and something else decides when it is back
        log.warning("replica %s: %s; skipped until it answers again", self.target, why)
        self.set_health(SUSPECT)
        if self._probe is not None:
            self._probe.cancel()      # one that saw its answer come by the watch instead
        self._probe = asyncio.ensure_future(self._probe_until_answered(suspect_s))
        return True

    async def _probe_until_answered(self, suspect_s: float) -> None:
        await asyncio.sleep(suspect_s)
        while self.health == SUSPECT:
            try:
                msg = await self._health_stub.Check(health_pb2.HealthCheckRequest(service=""),
                                                    timeout=self.config.probe_timeout_s)
            except grpc.RpcError:
                await asyncio.sleep(self.config.retry_s)
                continue
            if self.health == SUSPECT:
                self.set_health(SERVING if msg.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING)

    def set_health(self, status: str) -> None:
        if status == self.health:
            return
        was = self.health
        self.health = status
        if status not in (SERVING, SUSPECT):
            self.index.clear()
        log.info("replica %s: %s -> %s", self.target, was, status)
        self._on_health(self)

    async def _watch_health(self) -> None:
        while True:
            try:
                call = self._health_stub.Watch(health_pb2.HealthCheckRequest(service=""))
                async for msg in call:
                    self.set_health(SERVING if msg.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING)
                self.set_health(UNREACHABLE)      # the watch ended: the replica is shutting down
            except asyncio.CancelledError:
                raise
            except grpc.RpcError:
                self.set_health(UNREACHABLE)
            await asyncio.sleep(self.config.retry_s)

