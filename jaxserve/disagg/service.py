"""The sending engine's side of the wire: GetKVLayout, PullKV and KVLeaseControl, served by the
engine's Generation service (server/servicer.py delegates here), and the task that expires leases
while the engine is idle. Every touch of the leases and the arena runs on the step thread
(AsyncEngine.call); the device-to-host copy and the stream run here, off it."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import numpy as np

from jaxserve.disagg.attach import local_layout
from jaxserve.disagg.sender import KVOfOtherTokens, LeaseGone
from jaxserve.server.proto import generation_pb2 as pb

log = logging.getLogger(__name__)
MESSAGE_BYTES = 1 << 20     # block bytes per streamed message (at least one block)


def _sender(engine):
    conn = getattr(engine, "kv_connector", None)
    return conn.sender if conn is not None else None


async def get_kv_layout(aengine, context) -> pb.KVLayout:
    e = aengine.engine
    return local_layout(e, getattr(e, "role", "both")).to_proto()


async def pull_kv(aengine, request: pb.PullKVRequest, context, metrics=None):
    engine = aengine.engine
    if _sender(engine) is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"this engine's role is {getattr(engine, 'role', 'both')!r}: it holds no KV for others")
    tid, gen, first, n = request.transfer_id, request.generation, request.first_block, request.num_blocks
    num_tokens, digest = request.num_tokens, request.tokens_sha256

    try:
        # the lease's buffer was gathered when the prefill ended: no wait for the step loop
        buf = engine.kv_connector.sender.pulled(tid, gen, first, n, num_tokens, digest)
    except LeaseGone as e:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
    except KVOfOtherTokens as e:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    data = await asyncio.to_thread(lambda: np.ascontiguousarray(np.asarray(buf)[first:first + n]))
    per_block = data[0].nbytes
    step = max(1, MESSAGE_BYTES // per_block)
    for i in range(0, n, step):
        part = data[i:i + step]
        yield pb.KVBlocks(generation=gen, first_block=first + i, num_blocks=len(part), data=part.tobytes())
    engine.kv_connector.sender.bytes_sent += data.nbytes


async def kv_lease_control(aengine, request: pb.KVLeaseRequest, context) -> pb.KVLeaseReply:
    if _sender(aengine.engine) is None:
        return pb.KVLeaseReply(live=False)
    tid, gen = request.transfer_id, request.generation
    if request.release:
        live = await aengine.call(lambda e: e.kv_connector.sender.release(tid, gen))
    else:
        live = await aengine.call(lambda e: e.kv_connector.sender.heartbeat(tid, gen))
    return pb.KVLeaseReply(live=live)


def lease_of(engine, transfer_id: str) -> pb.KVLease | None:
    """The lease a finished `kv_transfer.send` request left (step thread)."""
    sender = _sender(engine)
    lease = sender.lease_of(transfer_id) if sender is not None else None
    if lease is None:
        return None
    return pb.KVLease(transfer_id=lease.transfer_id, generation=lease.generation,
                      num_tokens=lease.held.num_tokens, lease_s=sender.leases.lease_s)


async def reap_leases(aengine, every_s: float) -> None:
    """Expire leases on time even while the engine is idle (its step loop then sleeps)."""
    while True:
        await asyncio.sleep(every_s)
        with contextlib.suppress(Exception):   # a stopped engine: nothing left to free
            await aengine.call(lambda e: e.kv_connector.sender.expire())
