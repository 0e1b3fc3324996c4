"""KV memory use over a run, next to what a reserve-max-length allocator would have needed.

The step loop samples the engine after every step: blocks in use (total - free - evictable
cached), the tokens live in those blocks, and the requests running. A paged cache holds only
the live tokens (rounded up to blocks); an allocator that reserves `max_model_len` tokens for
every running sequence (HF's static cache, early serving systems) would have needed
running x max_model_len tokens at the same moment, and one that reserves each request's
prompt + max_tokens would have needed the sum of those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class KVSample:
    time: float
    used_blocks: int          # blocks referenced by running requests
    live_tokens: int          # tokens whose K/V running requests hold
    running: int              # requests holding KV
    reserve_request_blocks: int  # sum over running requests of ceil((prompt_len + max_tokens) / block_size)


class KVTrace:
    def __init__(self, block_size: int, max_model_len: int) -> None:
        if block_size < 1 or max_model_len < 1:
            raise ValueError(f"need block_size >= 1 and max_model_len >= 1, got {block_size}, {max_model_len}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.samples: list[KVSample] = []

    def add(self, sample: KVSample) -> None:
        self.samples.append(sample)

    def summary(self) -> dict[str, Any]:
        busy = [s for s in self.samples if s.running > 0]
        if not busy:
            return {"num_samples": 0}
        bs = self.block_size
        capacity = [s.used_blocks * bs for s in busy]
        util = [s.live_tokens / c for s, c in zip(busy, capacity) if c > 0]
        peak_running = max(s.running for s in busy)
        return {
            "num_samples": len(busy),
            "block_size": bs,
            "max_model_len": self.max_model_len,
            "utilization_mean": sum(util) / len(util) if util else float("nan"),
            "utilization_min": min(util) if util else float("nan"),
            "peak_used_blocks": max(s.used_blocks for s in busy),
            "peak_live_tokens": max(s.live_tokens for s in busy),
            "peak_running": peak_running,
            # what the alternatives would have needed at their own peaks, in blocks of the same size
            "reserve_max_model_len_blocks": peak_running * math.ceil(self.max_model_len / bs),
            "reserve_request_max_blocks": max(s.reserve_request_blocks for s in busy),
        }
