"""Which heads and columns each tensor-parallel shard holds, and the sizes that divide.

Shard s of a tensor_parallel_size = S engine holds query heads [s N/S, (s+1) N/S), the KV heads
those query heads read, and columns [s F/S, (s+1) F/S) of the MLP. The fused projections are
stored shard-major (the columns shard s multiplies sit together):

    qkv_proj  [D, S * (N/S + 2 K'/S) * H]   per shard: its q heads | its k heads | its v heads
    gate_up   [D, S * 2 F/S]                per shard: its gate columns | its up columns
                                            (any fused projection cut evenly: split_columns_order)

so a plain column split of the fused kernel gives every shard whole heads, and with S = 1 the
layout is the single-device one. K' is the KV head count after replication: when S exceeds K,
each KV head is copied S/K times at load (K' = S, one per shard), so attention never repeats a
head at run time and the arena's head axis splits evenly (each shard holds the one head its
query heads read). Replicating is exact: query head i of a K'-head model reads head
i // (N/K'), whose original is i // (N/K).

Sizes that do not divide are refused, not padded: padding the embedded model's 9 query heads
to 12 for S = 2 or 4 would add a third to every shard's attention and, with 3 KV heads padded
to 4, to its KV arena, for a model that runs unpadded at S = 3. The error names the sizes that
work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class HeadLayout:
    shards: int                 # tensor_parallel_size
    num_heads: int              # N, query heads of the model
    num_kv_heads: int           # K, KV heads of the checkpoint
    head_dim: int               # H
    intermediate_size: int      # F

    @classmethod
    def for_model(cls, config: ModelConfig, shards: int) -> "HeadLayout":
        problem = _problem(config, shards)
        if problem:
            working = supported_sizes(config)
            raise ValueError(
                f"tensor_parallel_size={shards} does not fit the model ({problem}; "
                f"{config.num_attention_heads} query heads, {config.num_key_value_heads} KV heads, "
                f"intermediate size {config.intermediate_size}): sizes that work are "
                f"{', '.join(map(str, working))}")
        return cls(shards, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                   config.intermediate_size)

    @property
    def kv_heads(self) -> int:
        """K': KV heads after replication (the arena's head axis, over all shards)."""
        return max(self.num_kv_heads, self.shards)

    @property
    def kv_replicas(self) -> int:
        return self.kv_heads // self.num_kv_heads

    @property
    def heads_per_shard(self) -> int:
        return self.num_heads // self.shards

    @property
    def kv_heads_per_shard(self) -> int:
        return self.kv_heads // self.shards

    def original_kv_head(self) -> np.ndarray:
        """[K'] the checkpoint KV head each replicated head copies."""
        return np.arange(self.kv_heads) // self.kv_replicas

    def qkv_columns(self) -> np.ndarray:
        """Indices into the single-device fused q | k | v columns ([(N + 2K) H]) that give the
        shard-major layout ([S (N/S + 2 K'/S) H]); KV heads repeat when replicated."""
        n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
        kv_source = self.original_kv_head()
        cols = []
        for s in range(self.shards):
            q_heads = range(s * self.heads_per_shard, (s + 1) * self.heads_per_shard)
            kv_heads = kv_source[s * self.kv_heads_per_shard:(s + 1) * self.kv_heads_per_shard]
            cols += [np.arange(i * h, (i + 1) * h) for i in q_heads]
            cols += [n * h + np.arange(i * h, (i + 1) * h) for i in kv_heads]
            cols += [(n + k) * h + np.arange(i * h, (i + 1) * h) for i in kv_heads]
        return np.concatenate(cols)



def split_columns_order(parts: tuple[int, ...], shards: int) -> np.ndarray:
    """Indices into a fused projection's columns (parts side by side) that give the shard-major
    layout: shard s holds columns [s p/S, (s+1) p/S) of every part p, in part order (gate | up
    per shard for an MLP's gate_up)."""
    offsets = np.cumsum((0,) + tuple(parts))
    return np.concatenate([offsets[i] + np.arange(s * (p // shards), (s + 1) * (p // shards))
                           for s in range(shards) for i, p in enumerate(parts)])


def _problem(config: ModelConfig, shards: int) -> str:
    n, k, f = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if shards < 1:
        return "it must be >= 1"
    if n % shards:
        return f"{shards} does not divide the {n} query heads"
    if k % shards and shards % k:
        return f"{shards} neither divides the {k} KV heads nor is a multiple of them"
    if f % shards:
        return f"{shards} does not divide the intermediate size {f}"
    return ""


def supported_sizes(config: ModelConfig) -> list[int]:
    return [s for s in range(1, config.num_attention_heads + 1) if not _problem(config, s)]
