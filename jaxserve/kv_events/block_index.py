"""BlockIndex: an engine's cached blocks, rebuilt from its KV events alone.

The reference consumer of the events: block hash -> its parent's hash, its tokens and the media
(tiers) holding it. Applying an engine's events in order gives exactly its prefix cache's nodes
(tests/kv_events/ check it against the engine after random workloads with evictions and host-tier
moves); the router's index (router/event_index.py) keys the same events by tokens instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class IndexedBlock:
    parent: int | None
    tokens: tuple[int, ...]
    media: set[str] = field(default_factory=set)


class BlockIndex:
    def __init__(self) -> None:
        self.blocks: dict[int, IndexedBlock] = {}

    def apply_batch(self, batch) -> None:
        for event in batch.events:
            self.apply(event)

    def apply(self, event) -> None:
        """One event, as sched/kv_events.py records it or as wire.py decodes it (the same fields)."""
        kind = type(event).__name__
        if kind == "BlockStored":
            n = event.block_size
            for i, h in enumerate(event.block_hashes):
                parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
                block = self.blocks.setdefault(h, IndexedBlock(parent, tuple(event.token_ids[i * n:(i + 1) * n])))
                block.media.add(event.medium)
        elif kind == "BlockRemoved":
            for h in event.block_hashes:
                block = self.blocks.get(h)
                if block is not None:
                    block.media.discard(event.medium)
                    if not block.media:
                        del self.blocks[h]
        elif kind == "AllBlocksCleared":
            self.blocks.clear()
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def snapshot(self) -> dict[int, tuple[int | None, tuple[int, ...], frozenset[str]]]:
        """hash -> (parent hash, tokens, media): what equality with an engine is checked on."""
        return {h: (b.parent, b.tokens, frozenset(b.media)) for h, b in self.blocks.items()}
