"""The wire format: vLLM's KV event batch, msgpack via msgspec.

`KVEventBatch(ts, events, data_parallel_rank)` is encoded as an array (the rank is 0 for an
engine that is not one of several data-parallel ranks, as vLLM sends it), and each event as an array
whose first element is its tag (the class name): `["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys]`,
`["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`, every field in its place. That
is the layout the field's consumers decode (vLLM's own subscriber example, llm-d's KV-cache
indexer, Dynamo's ZMQ relay; TensorRT-LLM publishes the same). Hashes are unsigned 64-bit ints.
A ZeroMQ message is three frames: topic, sequence number (8 bytes, big-endian), payload.
"""

from __future__ import annotations

from typing import Any

import msgspec

from jaxserve.sched import kv_events as sched_events


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change of an engine's KV cache."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None       # vLLM's deprecated integer adapter id: jaxserve names adapters
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None   # per block: (cache_salt,) where a salted prefix begins


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(event: sched_events.KVEvent) -> KVCacheEvent:
    """The scheduler's record of a change as its wire event."""
    if isinstance(event, sched_events.BlockStored):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                           medium=event.medium, lora_name=event.lora_name,
                           extra_keys=list(event.extra_keys) or None)
    if isinstance(event, sched_events.BlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    if isinstance(event, sched_events.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a KV event: {event!r}")


def batch(events: list[sched_events.KVEvent], ts: float, data_parallel_rank: int | None = None) -> KVEventBatch:
    return KVEventBatch(ts, [to_wire(e) for e in events], data_parallel_rank)


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def encode(b: KVEventBatch) -> bytes:
    return _encoder.encode(b)


def decode(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
