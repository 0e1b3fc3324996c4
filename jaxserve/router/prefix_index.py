"""PrefixIndex: what the router believes one replica holds in its prefix cache.

A radix tree over the token ids the router sent that replica, in chunks of `chunk_tokens` ids (a
node is one chunk; its path from the root spells the prefix). The cache salt is part of the first
chunk's key, as in the replica's own PrefixCache (sched/prefix_cache.py), so two tenants never
match each other's prefixes and a salt costs only its own nodes. The "salt" here is the request's
cache namespace (router/servicer.py cache_namespace: the salt, with the LoRA adapter when the
request names one), so prefixes under different adapters never match either.

It is an estimate: the replica evicts by its own LRU, which the router cannot see. So the index is
bounded (`max_tokens`) and evicts its least recently used leaves, and a replica that restarts (or
goes away) has its index cleared. Only whole chunks are indexed, like the replica's whole blocks.

LRU order: every match or insert touches the path leaf-first, so a parent is always more recent
than each of its children, and the least recent node is always a leaf: eviction pops the front of
one OrderedDict, never searches.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(eq=False, slots=True)
class _Node:
    key: tuple
    parent: "_Node | None"
    children: dict = field(default_factory=dict)


class PrefixIndex:
    def __init__(self, *, chunk_tokens: int = 16, max_tokens: int = 1 << 20):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
        if max_tokens < chunk_tokens:
            raise ValueError(f"max_tokens={max_tokens} must be >= chunk_tokens={chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.max_nodes = max_tokens // chunk_tokens
        self._root = _Node((), None)
        self._lru: OrderedDict[int, _Node] = OrderedDict()   # id(node) -> node, least recent first

    @property
    def num_tokens(self) -> int:
        return len(self._lru) * self.chunk_tokens

    def clear(self) -> None:
        self._root = _Node((), None)
        self._lru.clear()

    def _keys(self, salt: str | None, ids: Sequence[int]):
        c = self.chunk_tokens
        for i in range(len(ids) // c):
            chunk = tuple(ids[i * c:(i + 1) * c])
            # the salt keys the first chunk only: later chunks live under it
            yield (salt, chunk) if i == 0 else chunk

    def _walk(self, salt: str | None, ids: Sequence[int]) -> list[_Node]:
        path, node = [], self._root
        for key in self._keys(salt, ids):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def _touch(self, path: list[_Node]) -> None:
        for node in reversed(path):       # leaf first: parents end up more recent than children
            self._lru.move_to_end(id(node))

    def match(self, salt: str | None, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` (under `salt`) the replica is believed to hold."""
        path = self._walk(salt, ids)
        self._touch(path)
        return len(path) * self.chunk_tokens

    def peek(self, salt: str | None, ids: Sequence[int]) -> int:
        """match() without making the path recent: for scoring replicas not chosen."""
        return len(self._walk(salt, ids)) * self.chunk_tokens

    def insert(self, salt: str | None, ids: Sequence[int]) -> None:
        """The replica was sent `ids`: it will hold their whole chunks (until it evicts them)."""
        path, node = [], self._root
        for key in self._keys(salt, ids):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, node)
                node.children[key] = child
                self._lru[id(child)] = child
            path.append(child)
            node = child
        self._touch(path)
        self._evict(keep=set(map(id, path)))

    def _evict(self, keep: set[int]) -> None:
        while len(self._lru) > self.max_nodes:
            nid, node = next(iter(self._lru.items()))
            if nid in keep:            # the path just inserted is longer than the whole bound
                break
            del self._lru[nid]
            del node.parent.children[node.key]
