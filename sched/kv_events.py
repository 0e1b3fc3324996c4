"""KV events: what the prefix cache stored and removed, per block, for a cluster router to read.

A router that places requests where their prefix is cached (llm-d's precise prefix-cache scorer,
NVIDIA Dynamo's KV router, `jaxserve router --policy kv_events`) needs to know what each engine's
cache holds. The prefix cache (prefix_cache.py) reports every change of its tree here, in the
terms vLLM's KV events use, so the engine publishes them in vLLM's wire format
(jaxserve/kv_events/): `BlockStored` (blocks that entered a tier, as one chain: each block's
hash, the hash of the block before the first, their tokens), `BlockRemoved` (blocks that left a
tier) and `AllBlocksCleared`.

A tier is a `medium`: "GPU" for the engine's own KV arena (vLLM's name for it, whatever the
backend: on a CPU it is the arena in host memory all the same) and "CPU" for the host tier blocks
the arena evicted move to. A block that moves between tiers is removed from one and stored in the
other, in that order, so a consumer that applies the events in order holds exactly the engine's
tree.

Block hashes are cumulative over the sequence: a block's hash covers its parent's hash and its
own tokens, and a prefix's first block covers its namespace (the cache salt, and the LoRA
adapter's registered weights), so equal hashes mean equal K/V. They are 64-bit (blake2b), stable
across processes and machines; a consumer that keys by tokens instead reads `token_ids`, the
first block's salt in `extra_keys` and the adapter's name in `lora_name`.

Recording is off unless the engine asks for it (`PrefixCache(events=KVEventLog())`): without it
no hash is computed and the prefix cache's paths do one `is None` test more.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

MEDIUM_DEVICE = "GPU"   # the engine's KV arena (vLLM's medium name)
MEDIUM_HOST = "CPU"     # the prefix cache's host tier
ROOT_HASH = 0           # the parent hash a prefix's first block is hashed under


class AdapterNamespace(NamedTuple):
    """A prefix namespace under a LoRA adapter (Request.prefix_namespace): the key names the
    registered weights, so K/V under old weights of a name is never served to new ones."""

    cache_salt: str | None
    lora_name: str
    lora_key: str


def namespace_parts(namespace: object) -> tuple[str | None, str | None]:
    """(cache salt, LoRA adapter name) of a prefix namespace: a salt (or None) or an AdapterNamespace."""
    if isinstance(namespace, AdapterNamespace):
        return namespace.cache_salt, namespace.lora_name
    return namespace, None


def block_hash(parent_hash: int, namespace: object, tokens: tuple[int, ...], first: bool) -> int:
    """A block's 64-bit hash: its parent's hash and its tokens, and for a prefix's first block
    (`first`) the namespace the cache keys it under."""
    h = hashlib.blake2b(parent_hash.to_bytes(8, "big"), digest_size=8)
    if first:
        salt, key = (namespace.cache_salt, namespace.lora_key) if isinstance(namespace, AdapterNamespace) \
            else (namespace, None)
        h.update(json.dumps([salt, key]).encode())
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "big")


@dataclass(slots=True)
class BlockStored:
    """Blocks that entered `medium`, a chain: block i + 1's parent is block i, block 0's parent is
    `parent_block_hash` (None: block 0 begins a prefix, its salt in `extra_keys[0]`)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str
    lora_name: str | None = None
    # per block: (cache_salt,) for a block that begins a prefix under a salt, else None
    extra_keys: list[tuple | None] = field(default_factory=list)


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The prefix cache's changes since the last `drain`, in order. Consecutive stores of one
    chain in one tier, and consecutive removals from one tier, share one event (a prefill's blocks
    are one BlockStored)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []
        self.num_events = 0   # events drained so far, plus those pending

    def stored(self, block: int, parent: int | None, tokens: tuple[int, ...], medium: str,
               namespace: object) -> None:
        """A block (hash `block`) entered `medium`; `parent` is its parent's hash, None for a
        prefix's first block (whose namespace then rides in extra_keys)."""
        salt, lora = namespace_parts(namespace)
        last = self._events[-1] if self._events else None
        if (parent is not None and isinstance(last, BlockStored) and last.medium == medium
                and last.lora_name == lora and last.block_hashes[-1] == parent):
            last.block_hashes.append(block)
            last.token_ids.extend(tokens)
            if last.extra_keys:
                last.extra_keys.append(None)
            return
        extra = [(salt,)] if parent is None and salt is not None else []
        self._append(BlockStored([block], parent, list(tokens), self.block_size, medium, lora, extra))

    def removed(self, block: int, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block)
        else:
            self._append(BlockRemoved([block], medium))

    def cleared(self) -> None:
        self._events = []   # nothing before a clear matters to a consumer that applies it
        self._append(AllBlocksCleared())

    def _append(self, event: KVEvent) -> None:
        self._events.append(event)
        self.num_events += 1

    def drain(self) -> list[KVEvent]:
        out, self._events = self._events, []
        return out
