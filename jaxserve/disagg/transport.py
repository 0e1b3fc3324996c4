"""The receiver's side of the wire: gRPC calls to a sending engine's internal KVTransfer service
(proto/kv_transfer.proto: GetKVLayout, PullKV, KVLeaseControl), one channel per peer.

Why gRPC streams of block bytes and not `jax.experimental.transfer`: the transfer library's pull
could not be bounded here (its timeout did not fire for an id never registered, and a not-ready
array blocks whoever reads it, for ever), nor cancelled, and it needs a second server and port per
engine. A gRPC call has a deadline that fires, fails fast with UNAVAILABLE when the peer is gone,
and rides the engine's existing server and its TLS and API key. On the CPU backend both copy
through host memory; on GPUs a device-to-device transport (the transfer library, NIXL) is the
faster choice and fits behind the same KVReceiver, with the same deadlines and generation checks.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np

from jaxserve.disagg.handshake import KVLayout
from jaxserve.runner.kv_transfer import BlockLayout
from jaxserve.sched.kv_connector import RemoteKV
from jaxserve.disagg.proto import kv_transfer_pb2 as kv_pb
from jaxserve.disagg.proto import kv_transfer_pb2_grpc as kv_pb_grpc

MAX_MESSAGE_BYTES = 64 << 20


class KVPullError(RuntimeError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _reason(code: grpc.StatusCode) -> str:
    return {grpc.StatusCode.NOT_FOUND: "lease_gone", grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
            grpc.StatusCode.FAILED_PRECONDITION: "other_tokens",
            grpc.StatusCode.UNAVAILABLE: "unavailable"}.get(code, "error")


class KVClient:
    def __init__(self, metadata: tuple = ()):
        self._metadata = tuple(metadata)
        self._stubs: dict[str, kv_pb_grpc.KVTransferStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def _stub(self, peer: str) -> kv_pb_grpc.KVTransferStub:
        with self._lock:
            stub = self._stubs.get(peer)
            if stub is None:
                ch = grpc.insecure_channel(peer, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
                self._channels.append(ch)
                stub = self._stubs[peer] = kv_pb_grpc.KVTransferStub(ch)
            return stub

    def layout(self, peer: str, timeout: float) -> KVLayout:
        try:
            return KVLayout.from_proto(self._stub(peer).GetKVLayout(kv_pb.GetKVLayoutRequest(), timeout=timeout,
                                                                        metadata=self._metadata))
        except grpc.RpcError as e:
            raise KVPullError(_reason(e.code()), f"handshake with {peer}: {e.code().name} {e.details()}") from None

    def pull(self, remote: RemoteKV, first_block: int, num_blocks: int, block: BlockLayout,
             timeout: float, num_tokens: int = 0, tokens_sha256: bytes = b"") -> np.ndarray:
        """Blocks [first_block, first_block + num_blocks) of the lease, as [n, *block_shape]."""
        out = np.empty((num_blocks,) + block.block_shape, block.np_dtype)
        got = 0
        req = kv_pb.PullKVRequest(transfer_id=remote.transfer_id, generation=remote.generation,
                                  first_block=first_block, num_blocks=num_blocks, num_tokens=num_tokens,
                                  tokens_sha256=tokens_sha256)
        try:
            for msg in self._stub(remote.peer).PullKV(req, timeout=timeout, metadata=self._metadata):
                if msg.generation != remote.generation:
                    raise KVPullError("generation", f"asked for generation {remote.generation}, got {msg.generation}")
                i = msg.first_block - first_block
                if i != got or msg.num_blocks < 1 or got + msg.num_blocks > num_blocks:
                    raise KVPullError("error", f"blocks out of order: {msg.first_block}+{msg.num_blocks} after {got}")
                part = np.frombuffer(msg.data, block.np_dtype)
                if part.size != msg.num_blocks * int(np.prod(block.block_shape)):
                    raise KVPullError("error", f"{len(msg.data)} bytes for {msg.num_blocks} blocks")
                out[i:i + msg.num_blocks] = part.reshape((msg.num_blocks,) + block.block_shape)
                got += msg.num_blocks
        except grpc.RpcError as e:
            raise KVPullError(_reason(e.code()), f"pull from {remote.peer}: {e.code().name} {e.details()}") from None
        if got != num_blocks:
            raise KVPullError("error", f"the stream ended after {got} of {num_blocks} blocks")
        return out

    def lease(self, remote: RemoteKV, *, release: bool, timeout: float) -> bool:
        """A heartbeat (release=False) or acknowledgement; False when the lease is gone."""
        reply = self._stub(remote.peer).KVLeaseControl(
            kv_pb.KVLeaseRequest(transfer_id=remote.transfer_id, generation=remote.generation, release=release),
            timeout=timeout, metadata=self._metadata)
        return reply.live

    def close(self) -> None:
        with self._lock:
            for ch in self._channels:
                ch.close()
            self._channels.clear()
            self._stubs.clear()
