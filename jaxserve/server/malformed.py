"""Requests whose bytes do not parse as the method's message end with INVALID_ARGUMENT.

grpc.aio deserializes a request before any handler runs; a parse error there becomes UNKNOWN
("Unexpected <class 'google.protobuf.message.DecodeError'>: ...") with an ERROR traceback in the
log for every such call. This interceptor wraps each method's deserializer so that a parse error
becomes a marker the handler turns into INVALID_ARGUMENT with a one-line message, logged once as
one line: a client's bad bytes are the client's error, not the server's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import grpc
from grpc import aio

log = logging.getLogger("jaxserve.server")


class _Malformed:
    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


class MalformedRequestInterceptor(aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _guarded(handler, handler_call_details.method)


def _guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer

    def guarded_deserialize(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:   # noqa: BLE001 - any parse failure is the client's bad bytes
            return _Malformed(" ".join(str(e).split()) or type(e).__name__)

    async def reject(request: _Malformed, context):
        log.warning("malformed request to %s: %s", method, request.why)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.why}")

    async def checked(request_iterator, context):
        async for request in request_iterator:
            if isinstance(request, _Malformed):
                await reject(request, context)
            yield request

    def unary(inner):
        if inspect.isasyncgenfunction(inner):
            async def stream_out(request, context):
                if isinstance(request, _Malformed):
                    await reject(request, context)
                async with contextlib.aclosing(inner(request, context)) as responses:
                    async for response in responses:
                        yield response
            return stream_out

        async def call(request, context):
            if isinstance(request, _Malformed):
                await reject(request, context)
            return await inner(request, context)
        return call

    def streaming(inner):
        if inspect.isasyncgenfunction(inner):
            async def stream_out(request_iterator, context):
                async with contextlib.aclosing(inner(checked(request_iterator, context), context)) as responses:
                    async for response in responses:
                        yield response
            return stream_out

        async def call(request_iterator, context):
            return await inner(checked(request_iterator, context), context)
        return call

    kinds = {"unary_unary": unary, "unary_stream": unary, "stream_unary": streaming, "stream_stream": streaming}
    for kind, wrap in kinds.items():
        inner = getattr(handler, kind)
        if inner is not None:
            if not (inspect.iscoroutinefunction(inner) or inspect.isasyncgenfunction(inner)):
                return handler   # a synchronous handler: left as grpc runs it
            return handler._replace(request_deserializer=guarded_deserialize, **{kind: wrap(inner)})
    return handler
