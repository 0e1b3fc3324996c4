"""Bearer-token authentication of the gRPC front: every call but the health check must carry
`authorization: Bearer <key>` metadata, or it ends with UNAUTHENTICATED before any handler runs.
The scheme is case-insensitive (`bearer`, `BEARER`; RFC 9110 section 11.1), the key is not.

Health stays open so that load balancers and orchestrators can probe without the key; it tells
nothing but SERVING / NOT_SERVING.
"""

from __future__ import annotations

import hmac

import grpc
from grpc import aio

from jaxserve.server.bearer import bearer_token

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


class BearerTokenInterceptor(aio.ServerInterceptor):
    def __init__(self, api_key: str):
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self._key = api_key.encode()

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        given = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                break
        token = bearer_token(given)
        if token is not None and hmac.compare_digest(token, self._key):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        why = ("missing bearer token" if not given else
               "wrong bearer token" if token is not None else "the authorization scheme is not Bearer")
        return _refusal(handler, why)


def _refusal(handler, why: str):
    """A handler of the same kind as the real one that only says UNAUTHENTICATED."""
    async def refuse_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # pragma: no cover - makes this an async generator

    if handler is None:
        return None
    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse_unary, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, des, ser)
    return grpc.unary_unary_rpc_method_handler(refuse_unary, des, ser)

