"""The router process: the same gRPC surface as `jaxserve serve` (Generation, grpc.health.v1,
reflection, bearer auth, TLS, Prometheus metrics), in front of replicas.

Health: SERVING while at least one replica is SERVING, NOT_SERVING only when none is; it follows
the replicas' own health watches. Shutdown (SIGTERM/SIGINT): NOT_SERVING, new calls UNAVAILABLE,
streams in flight get `grace_period` seconds, then the rest are cancelled (which aborts them on
their replicas), then local child replicas are stopped.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.policy import POLICIES, CacheAwareConfig, make_policy
from jaxserve.router.prefill_deadline import PrefillHopConfig
from jaxserve.router.event_index import EventIndex, KVEventsSource
from jaxserve.router.prefix_index import PrefixIndex
from jaxserve.router.replica import Replica, ReplicaAddress, ReplicaClientConfig
from jaxserve.router.servicer import RouterServicer, RouterState
from jaxserve.router.tokenize import PromptTokenizer
from jaxserve.server.reflection import enable_server_reflection
from jaxserve.server.grpc_front import SERVICE_NAME, server_interceptors

log = logging.getLogger("jaxserve.router")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[ReplicaAddress, ...]
    host: str = "127.0.0.1"
    port: int = 50051
    policy: str = "cache_aware"
    cache_aware: CacheAwareConfig = CacheAwareConfig()
    index_chunk_tokens: int = 16
    index_max_tokens: int = 1 << 20          # per replica
    metrics_port: int | None = None
    api_key: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_concurrent_streams: int = 1024
    grace_period: float = 30.0
    max_message_bytes: int = 64 << 20
    replica_client: ReplicaClientConfig = field(default_factory=ReplicaClientConfig)
    # disaggregated serving (router/disagg.py): the prefill engines; `replicas` are then the decode ones
    prefill: tuple[ReplicaAddress, ...] = ()
    prefill_threshold_tokens: int = 0     # shorter prompts skip the prefill engines
    prefill_hop: PrefillHopConfig = PrefillHopConfig()   # the hop's deadline, suspicion, failure policy
    # policy kv_events: where each replica (in `replicas`' order) publishes its KV events
    replica_kv_events: tuple[KVEventsSource, ...] = ()
    kv_events_routed_s: float = 2.0       # kv_events: what the router sent counts this long before events tell

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("no replicas: give --replica HOST:PORT (repeatable) or --replicas N"
                             + (" (--prefill needs at least one --decode)" if self.prefill else ""))
        if self.prefill_threshold_tokens < 0:
            raise ValueError(f"--prefill-threshold-tokens {self.prefill_threshold_tokens} must be >= 0")
        targets = [r.target for r in self.replicas + self.prefill]
        if len(set(targets)) != len(targets):
            raise ValueError(f"a replica is given twice: {targets}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy {self.policy!r} must be one of {', '.join(POLICIES)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.max_concurrent_streams < 1:
            raise ValueError(f"max_concurrent_streams={self.max_concurrent_streams} must be >= 1")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key is empty; leave it unset to disable auth")
        if self.policy == "kv_events" and len(self.replica_kv_events) != len(self.replicas):
            raise ValueError(f"--policy kv_events reads each replica's KV events: give --replica-kv-events once per "
                             f"replica ({len(self.replicas)}), got {len(self.replica_kv_events)}")
        if self.replica_kv_events and self.policy != "kv_events":
            raise ValueError("--replica-kv-events is read by --policy kv_events only")
        if not self.kv_events_routed_s > 0:
            raise ValueError(f"--kv-events-routed-s {self.kv_events_routed_s} must be > 0")


class Router:
    """The router's parts, built in the running event loop; `start()` listens, `stop()` drains."""

    def __init__(self, config: RouterConfig, tokenizer=None):
        self.config = config
        self.health = health_aio.HealthServicer()
        self.replicas = [Replica(a, config.replica_client, self._index(i), on_health=self._replica_health_changed)
                         for i, a in enumerate(config.replicas)]
        self.prefill = [Replica(a, config.replica_client,
                                PrefixIndex(chunk_tokens=config.index_chunk_tokens, max_tokens=config.index_max_tokens))
                        for a in config.prefill]
        self.state = RouterState(self.replicas, self.prefill)
        self.metrics = RouterMetrics(lambda: self.replicas)
        self.tokenizer = PromptTokenizer(tokenizer) if tokenizer is not None else None
        self.servicer = RouterServicer(self.state, make_policy(config.policy, config.cache_aware), self.tokenizer,
                                       max_concurrent_streams=config.max_concurrent_streams, metrics=self.metrics,
                                       prefill_threshold_tokens=config.prefill_threshold_tokens,
                                       prefill_hop=config.prefill_hop)
        self.server: aio.Server | None = None
        self.port = 0
        self._serving: bool | None = None

    def _index(self, i: int):
        """Replica i's index: its own KV events (policy kv_events), else the router's record."""
        c = self.config
        if c.policy != "kv_events":
            return PrefixIndex(chunk_tokens=c.index_chunk_tokens, max_tokens=c.index_max_tokens)
        source = c.replica_kv_events[i]
        index = EventIndex(chunk_tokens=c.index_chunk_tokens, routed_s=c.kv_events_routed_s)
        index.follow(source.endpoint, source.replay_endpoint, source.topic)
        return index

    def _replica_health_changed(self, replica: Replica) -> None:
        serving = bool(self.state.serving()) and not self.state.draining
        if serving != self._serving:
            self._serving = serving
            log.info("router health: %s (%d of %d replicas serving)", "SERVING" if serving else "NOT_SERVING",
                     len(self.state.serving()), len(self.replicas))
            asyncio.ensure_future(self._set_health(SERVING if serving else NOT_SERVING))

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> int:
        c = self.config
        server = aio.server(interceptors=server_interceptors(c.api_key), options=[
            ("grpc.max_receive_message_length", c.max_message_bytes),
            ("grpc.max_send_message_length", c.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ])
        from jaxserve.proto import generation_pb2_grpc as pb_grpc

        pb_grpc.add_GenerationServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_server_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server)
        await self._set_health(NOT_SERVING)
        address = f"{c.host}:{c.port}"
        try:
            if c.tls_cert:
                with open(c.tls_key, "rb") as k, open(c.tls_cert, "rb") as f:
                    creds = grpc.ssl_server_credentials([(k.read(), f.read())])
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as e:
            raise ValueError(f"cannot listen on {address}: {e}") from e
        await server.start()
        self.server = server
        if c.metrics_port is not None:
            from prometheus_client import start_http_server
            start_http_server(c.metrics_port, addr=c.host, registry=self.metrics.registry)
            log.info("metrics on http://%s:%d/metrics", c.host, c.metrics_port)
        for r in self.replicas + self.prefill:
            r.start()
        log.info("jaxserve router listening on %s:%d (%s), policy %s, replicas %s%s", c.host, self.port,
                 "TLS" if c.tls_cert else "plaintext", c.policy, ", ".join(r.target for r in self.replicas),
                 f"; prefill engines {', '.join(r.target for r in self.prefill)}" if self.prefill else "")
        return self.port

    async def stop(self) -> None:
        log.info("draining: %d streams in flight, grace period %.1f s", self.state.active_streams,
                 self.config.grace_period)
        self.state.draining = True
        await self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + self.config.grace_period
        while self.state.active_streams > 0 and time.monotonic() < deadline:
            self.state.streams_changed.clear()
            try:
                await asyncio.wait_for(self.state.streams_changed.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
        if self.server is not None:
            await self.server.stop(1.0)     # cancels what is left: their replica calls are cancelled
        for r in self.replicas + self.prefill:
            await r.close()
            if isinstance(r.index, EventIndex):
                r.index.close()
        if self.tokenizer is not None:
            self.tokenizer.close()
        log.info("stopped")


async def run_router(config: RouterConfig, tokenizer=None) -> int:
    router = Router(config, tokenizer)
    await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await router.stop()
    return 0
