"""The KV cache: block size and element type, the device arena's size, prefix caching, and the
one host pool that swap preemption and the prefix cache's host tier share."""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxserve.config.options import check_choice, check_positive_int, choices, option


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = option(16, "tokens per KV block")
    kv_cache_dtype: str = option(
        "auto", "KV cache element type: auto (the model dtype), fp8_e4m3 or int8 (per-layer per-head scales "
                "calibrated on real text; half the bytes of bfloat16)", choices=("auto", "fp8_e4m3", "int8"))
    kv_cache_memory: int | None = option(None, "bytes for the KV arena (default 1 GiB unless num_kv_blocks is set)")
    num_kv_blocks: int | None = option(None, "KV blocks in the arena (overrides kv_cache_memory)")
    usable_kv_blocks: int | None = option(
        None, "cap on the blocks the scheduler may use (tests create pressure this way)", per_engine=True)
    enable_prefix_caching: bool = option(True, "share KV blocks of common prompt prefixes", per_engine=True)
    swap_space: int = option(256 << 20, "bytes of host memory for swapped-out KV blocks")
    kv_offload_gib: float = option(
        0.0, "GiB of host memory for a second prefix-cache tier: blocks the device evicts move there (least "
             "recently used go first) and a later hit loads them back instead of recomputing; one host pool with "
             "swap_space (0: off)")

    def __post_init__(self) -> None:
        check_choice(self, "kv_cache_dtype", choices(self, "kv_cache_dtype"))
        check_positive_int(self, "block_size")
        check_positive_int(self, "kv_cache_memory", "num_kv_blocks", "usable_kv_blocks", optional=True)
        if not isinstance(self.swap_space, int) or self.swap_space < 0:
            raise ValueError(f"swap_space={self.swap_space!r} must be an integer >= 0")
        if not (isinstance(self.kv_offload_gib, (int, float)) and not isinstance(self.kv_offload_gib, bool)
                and math.isfinite(self.kv_offload_gib) and self.kv_offload_gib >= 0):
            raise ValueError(f"kv_offload_gib={self.kv_offload_gib!r} must be a finite number >= 0")
        if self.kv_offload_gib and not self.enable_prefix_caching:
            raise ValueError("kv_offload_gib is a tier of the prefix cache: it needs enable_prefix_caching")
        if (self.usable_kv_blocks is not None and self.num_kv_blocks is not None
                and self.usable_kv_blocks > self.num_kv_blocks):
            raise ValueError(f"usable_kv_blocks={self.usable_kv_blocks} exceeds num_kv_blocks={self.num_kv_blocks}")

    def host_pool_bytes(self) -> int:
        """Bytes of the one host pool (swap space and the host tier share it)."""
        return int(self.swap_space + self.kv_offload_gib * (1 << 30))
