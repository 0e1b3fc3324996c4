"""The gRPC front of the server process: the Generation service, health, reflection and the
interceptors on one grpc.aio server; with a prefill or decode role also the engines' internal
jaxserve.kv.v1.KVTransfer service (jaxserve/disagg/service.py), on the same port behind the same
TLS and API key. Imported only when gRPC is served (the HTTP front never
imports it), so `jaxserve serve --no-grpc` runs without loading grpc.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from jaxserve.server.auth import BearerTokenInterceptor
from jaxserve.server.malformed import MalformedRequestInterceptor
from jaxserve.server.metrics import ServerMetrics
from jaxserve.proto import generation_pb2 as pb
from jaxserve.proto import generation_pb2_grpc as pb_grpc
from jaxserve.server.reflection import enable_server_reflection
from jaxserve.server.servicer import GenerationServicer
from jaxserve.server.state import ServerState

if TYPE_CHECKING:
    from jaxserve.server.server import ServerConfig

log = logging.getLogger("jaxserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name   # "jaxserve.v1.Generation"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def server_interceptors(api_key: str | None) -> list[aio.ServerInterceptor]:
    """Authentication first (a refusal needs no parsing), then malformed bytes -> INVALID_ARGUMENT."""
    return ([BearerTokenInterceptor(api_key)] if api_key else []) + [MalformedRequestInterceptor()]


@dataclass
class GRPCFront:
    server: aio.Server
    health: health_aio.HealthServicer
    port: int

    async def set_serving(self, serving: bool) -> None:
        """Health SERVING or NOT_SERVING, for the whole server and the Generation service."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, SERVING if serving else NOT_SERVING)


async def start_grpc(config: "ServerConfig", max_message_bytes: int, state: ServerState,
                      metrics: ServerMetrics, *, kv_transfer: bool = False) -> GRPCFront:
    """kv_transfer: also serve KVTransfer (a prefill or decode engine; a colocated one has no KV to
    hand over or take, so it does not expose the service at all)."""
    server = aio.server(interceptors=server_interceptors(config.api_key), options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ])
    servicer = GenerationServicer(state, max_concurrent_streams=config.max_concurrent_streams,
                                  limits=config.limits, metrics=metrics, tool_call_parser=config.tool_call_parser,
                                  reasoning_parser=config.reasoning_parser)
    servicer.content_special_tokens = config.chat_content_special_tokens
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    if kv_transfer:   # the same gate as Generate: UNAVAILABLE while warming up, draining or failed
        from jaxserve.disagg.service import add_kv_transfer_service

        add_kv_transfer_service(server, servicer.serving_engine)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    enable_server_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server)
    front = GRPCFront(server, health, 0)
    await front.set_serving(False)

    address = f"{config.host}:{config.port}"
    try:
        if config.tls_cert:
            with open(config.tls_key, "rb") as k, open(config.tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            front.port = server.add_secure_port(address, creds)
        else:
            front.port = server.add_insecure_port(address)
    except RuntimeError as e:   # grpc's "failed to bind"; the CLI reports ValueErrors without a traceback
        raise ValueError(f"cannot listen on {address}: {e}") from e
    await server.start()
    log.info("listening on %s:%d (%s), warming up", config.host, front.port, "TLS" if config.tls_cert else "plaintext")
    return front
