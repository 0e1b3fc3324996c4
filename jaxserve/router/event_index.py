"""EventIndex: what one replica's prefix cache holds, from the replica's own KV events.

`--policy kv_events` routes on this instead of the PrefixIndex's guesses. The replica publishes
every block its cache stored or removed, in both tiers (jaxserve/kv_events/); a subscriber thread
applies them here, so the index knows what the replica evicted (which the PrefixIndex cannot see)
and what it cached for requests that never passed through this router.

The tree is keyed by tokens, as the router sees a request: a node is one block, its key the
block's tokens under its parent, or (namespace, tokens) for a prefix's first block, the namespace
being (cache salt, LoRA adapter name) as the events carry them (the first block's `extra_keys`,
`lora_name`); the events' hashes map onto nodes. A node can stand for more than one engine block
(an adapter registered again under its name caches new blocks with the same tokens): it counts
as cached while any of them is. The block size is learnt from the events.

The events of a request's prefill arrive after the replica scheduled it, so a burst of one new
prefix would all be routed by load before the first one's blocks are known. The index therefore
also remembers what it routed in the last `routed_s` to `2 x routed_s` seconds (two generations of
PrefixIndex, the older dropped as time passes), and a match is the longer of the two: exact where
the events have spoken, the router's own record for the moments before they do.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from jaxserve.router.prefix_index import PrefixIndex


@dataclass(frozen=True, slots=True)
class KVEventsSource:
    """Where a replica publishes its KV events (its --kv-events-config endpoints, as the router
    reaches them)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @staticmethod
    def parse(text: str) -> "KVEventsSource":
        """'tcp://host:5557' or 'tcp://host:5557,tcp://host:5558' (the replay endpoint)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) > 2 or not all("://" in p for p in parts):
            raise ValueError(f"--replica-kv-events {text!r} must be ENDPOINT or ENDPOINT,REPLAY_ENDPOINT "
                             "(ZeroMQ addresses like tcp://host:5557)")
        return KVEventsSource(parts[0], parts[1] if len(parts) == 2 else None)


class _Node:
    __slots__ = ("key", "parent", "children", "blocks")

    def __init__(self, key, parent: "_Node | None") -> None:
        self.key = key
        self.parent = parent
        self.children: dict = {}
        self.blocks: dict[int, set[str]] = {}   # engine block hash -> the media holding it


def namespace_key(namespace) -> tuple:
    """The router's cache namespace (servicer.cache_namespace: a salt, or (salt, adapter name)) as
    the events spell it: (salt, adapter name)."""
    return namespace if isinstance(namespace, tuple) else (namespace, None)


class EventIndex:
    def __init__(self, *, chunk_tokens: int = 16, routed_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if routed_s <= 0:
            raise ValueError(f"routed_s={routed_s} must be > 0")
        self.chunk_tokens = chunk_tokens
        self.routed_s = routed_s
        self._clock = clock
        self._lock = threading.Lock()      # the subscriber's thread writes, the event loop reads
        self._root = _Node(None, None)
        self._by_hash: dict[int, _Node] = {}
        self.block_size: int | None = None
        self.num_orphans = 0     # stored blocks whose parent the index never saw (events lost before it)
        self._routed = [PrefixIndex(chunk_tokens=chunk_tokens), PrefixIndex(chunk_tokens=chunk_tokens)]
        self._rotated_at = clock()
        self.subscriber = None   # the KVEventSubscriber feeding it (follow)

    # ---- what the replica's events say ----
    def follow(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        """Subscribe to the replica's KV events (a thread applies them here)."""
        from jaxserve.kv_events.subscriber import KVEventSubscriber

        self.subscriber = KVEventSubscriber(endpoint, lambda seq, batch: self.apply_batch(batch),
                                            replay_endpoint=replay_endpoint, topic=topic,
                                            on_restart=self._forget_blocks)

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()

    def apply_batch(self, batch) -> None:
        with self._lock:
            for event in batch.events:
                kind = type(event).__name__
                if kind == "BlockStored":
                    self._stored(event)
                elif kind == "BlockRemoved":
                    for h in event.block_hashes:
                        self._removed(h, event.medium)
                elif kind == "AllBlocksCleared":
                    self._clear_blocks()

    def _stored(self, event) -> None:
        n = self.block_size = event.block_size
        parent = self._root if event.parent_block_hash is None else self._by_hash.get(event.parent_block_hash)
        if parent is None:
            self.num_orphans += len(event.block_hashes)
            return
        extra = event.extra_keys or ()
        for i, h in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * n:(i + 1) * n])
            if parent is self._root:
                salt = extra[i][0] if i < len(extra) and extra[i] else None
                key = ((salt, event.lora_name), tokens)
            else:
                key = tokens
            node = parent.children.get(key)
            if node is None:
                node = parent.children[key] = _Node(key, parent)
            node.blocks.setdefault(h, set()).add(event.medium)
            self._by_hash[h] = node
            parent = node

    def _removed(self, h: int, medium: str | None) -> None:
        node = self._by_hash.get(h)
        if node is None:
            return
        media = node.blocks[h]
        media.discard(medium)
        if media:
            return
        del node.blocks[h]
        del self._by_hash[h]
        while node is not self._root and not node.blocks and not node.children:
            del node.parent.children[node.key]
            node = node.parent

    def _clear_blocks(self) -> None:
        self._root = _Node(None, None)
        self._by_hash.clear()

    def _forget_blocks(self) -> None:
        with self._lock:
            self._clear_blocks()

    # ---- what a policy asks (PrefixIndex's interface) ----
    @property
    def num_tokens(self) -> int:
        return len(self._by_hash) * (self.block_size or 0)

    def cached_tokens(self, namespace, ids: Sequence[int]) -> int:
        """Leading tokens of ids whose blocks the replica's events say it holds (either tier)."""
        with self._lock:
            n = self.block_size
            if not n:
                return 0
            node, matched = self._root, 0
            for i in range(len(ids) // n):
                tokens = tuple(ids[i * n:(i + 1) * n])
                node = node.children.get((namespace_key(namespace), tokens) if i == 0 else tokens)
                if node is None or not node.blocks:
                    break
                matched += n
            return matched

    def _rotate(self) -> None:
        now = self._clock()
        if now - self._rotated_at >= self.routed_s:
            older = self._routed[0] if now - self._rotated_at < 2 * self.routed_s else \
                PrefixIndex(chunk_tokens=self.chunk_tokens)
            self._routed = [PrefixIndex(chunk_tokens=self.chunk_tokens), older]
            self._rotated_at = now

    def peek(self, namespace, ids: Sequence[int]) -> int:
        self._rotate()
        return max(self.cached_tokens(namespace, ids), *(r.peek(namespace, ids) for r in self._routed))

    match = peek    # nothing here is ordered by use: the replica's own LRU decides what stays

    def insert(self, namespace, ids: Sequence[int]) -> None:
        """The router sent ids to this replica: remembered for a while, until its events tell."""
        self._rotate()
        self._routed[0].insert(namespace, ids)

    def clear(self) -> None:
        """The replica left SERVING: forget it all, and ask for its events again from the start."""
        self._forget_blocks()
        self._routed = [PrefixIndex(chunk_tokens=self.chunk_tokens), PrefixIndex(chunk_tokens=self.chunk_tokens)]
        if self.subscriber is not None:
            self.subscriber.resync()
