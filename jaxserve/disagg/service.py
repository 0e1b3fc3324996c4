"""The sending engine's side of the wire: the internal `jaxserve.kv.v1.KVTransfer` service
(proto/kv_transfer.proto: GetKVLayout, PullKV, KVLeaseControl), which `jaxserve serve` registers
beside the public Generation service with --role prefill or decode; the lease a finished
`kv_transfer.send` request left; and the task that expires leases while the engine is idle.

Every touch of the leases and the arena runs on the step thread (AsyncEngine.call); the
device-to-host copy and the stream run here, off it. Nothing here knows the server: the server
hands in its gate (`engine_for`), the same one its Generate calls pass, so these calls are refused
with UNAVAILABLE while it warms up, drains or has failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc
import numpy as np

from jaxserve.disagg.attach import local_layout
from jaxserve.disagg.proto import kv_transfer_pb2 as kv_pb
from jaxserve.disagg.proto import kv_transfer_pb2_grpc as kv_pb_grpc
from jaxserve.disagg.sender import KVOfOtherTokens, LeaseGone

log = logging.getLogger(__name__)
MESSAGE_BYTES = 1 << 20     # block bytes per streamed message (at least one block)
SERVICE_NAME = kv_pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name   # "jaxserve.kv.v1.KVTransfer"


def _sender(engine):
    conn = engine.kv_connector
    return conn.sender if conn is not None else None


class KVTransferServicer(kv_pb_grpc.KVTransferServicer):
    def __init__(self, engine_for: Callable[[object], Awaitable[object]]):
        """engine_for(context): the serving AsyncEngine, or the call aborted (the server's gate)."""
        self._engine_for = engine_for

    async def GetKVLayout(self, request: kv_pb.GetKVLayoutRequest, context) -> kv_pb.KVLayout:
        e = (await self._engine_for(context)).engine
        return local_layout(e, e.role).to_proto()

    async def PullKV(self, request: kv_pb.PullKVRequest, context):
        engine = (await self._engine_for(context)).engine
        sender = _sender(engine)
        if sender is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this engine's role is {engine.role!r}: it holds no KV for others")
        tid, gen, first, n = request.transfer_id, request.generation, request.first_block, request.num_blocks
        # the lease's buffer is gathered at the step after the prefill ended: a pull that comes
        # first waits for it (off the event loop), never for the step loop itself
        await asyncio.to_thread(sender.wait_gathered, tid)
        try:
            buf = sender.pulled(tid, gen, first, n, request.num_tokens, request.tokens_sha256)
        except LeaseGone as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except KVOfOtherTokens as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        data = await asyncio.to_thread(lambda: np.ascontiguousarray(np.asarray(buf)[first:first + n]))
        step = max(1, MESSAGE_BYTES // data[0].nbytes)
        for i in range(0, n, step):
            part = data[i:i + step]
            yield kv_pb.KVBlocks(generation=gen, first_block=first + i, num_blocks=len(part), data=part.tobytes())
        sender.bytes_sent += data.nbytes

    async def KVLeaseControl(self, request: kv_pb.KVLeaseRequest, context) -> kv_pb.KVLeaseReply:
        aengine = await self._engine_for(context)
        if _sender(aengine.engine) is None:
            return kv_pb.KVLeaseReply(live=False)
        tid, gen = request.transfer_id, request.generation
        if request.release:
            live = await aengine.call(lambda e: e.kv_connector.sender.release(tid, gen))
        else:
            live = await aengine.call(lambda e: e.kv_connector.sender.heartbeat(tid, gen))
        return kv_pb.KVLeaseReply(live=live)


def add_kv_transfer_service(server, engine_for: Callable[[object], Awaitable[object]]) -> None:
    """Serve jaxserve.kv.v1.KVTransfer on `server` (a grpc.aio server), through the server's gate."""
    kv_pb_grpc.add_KVTransferServicer_to_server(KVTransferServicer(engine_for), server)


@dataclass(frozen=True, slots=True)
class HeldLease:
    """What a Complete names of a finished `kv_transfer.send` request's held KV (the public
    KVLease message, built by the server)."""

    transfer_id: str
    generation: int
    num_tokens: int
    lease_s: float


def lease_of(engine, transfer_id: str) -> HeldLease | None:
    """The lease a finished `kv_transfer.send` request left (step thread); None when nothing is
    held (the request was aborted, or this engine holds no KV for others)."""
    sender = _sender(engine)
    lease = sender.lease_of(transfer_id) if sender is not None else None
    if lease is None:
        return None
    return HeldLease(lease.transfer_id, lease.generation, lease.held.num_tokens, sender.leases.lease_s)


async def reap_leases(aengine, every_s: float) -> None:
    """Expire leases on time even while the engine is idle (its step loop then sleeps)."""
    while True:
        await asyncio.sleep(every_s)
        with contextlib.suppress(Exception):   # a stopped engine: nothing left to free
            await aengine.call(lambda e: e.kv_connector.sender.expire())
