"""The KV arena: one preallocated pytree of per-layer (k, v) caches, donated to every step.

Per layer k and v are [num_blocks, block_size, K, H] (the layout pallas_kernels documents).
Block 0 is the null block: padding rows write there and padding table entries point there.
The element dtype is the model's, or float8_e4m3fn / int8 for a quantized KV cache
(kv_cache_dtype; runner/kv_write.py): one byte per element, so the same `kv_cache_memory` holds
twice the blocks of bfloat16 and four times those of float32.

Under tensor parallelism (jaxserve/parallel/) the arena is split on its KV-head axis, each device
holding every block for its heads (blocks stay logical: the scheduler is unchanged), and is
allocated split: no device ever holds the whole arena. K then counts the KV heads after
replication (parallel/layout.py), and `kv_cache_memory` is the bytes each device gives it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxserve.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class ArenaSpec:
    num_layers: int
    num_blocks: int          # including the null block
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    shards: int = 1          # devices the head axis is split over (tensor_parallel_size)

    @property
    def bytes_per_block(self) -> int:
        # k and v, every layer, all heads (over all devices)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

    @property
    def bytes_per_block_per_device(self) -> int:
        return self.bytes_per_block // self.shards

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def shape_dtype(self, sharding=None):
        s = jax.ShapeDtypeStruct(self.layer_shape, jnp.dtype(self.dtype), sharding=sharding)
        return [(s, s) for _ in range(self.num_layers)]


def plan_arena(model: ModelConfig, *, block_size: int, dtype: str, num_kv_blocks: int | None,
               kv_cache_memory: int | None, shards: int = 1) -> ArenaSpec:
    """`model` as the runner sees it (KV heads after replication when shards > 1);
    `kv_cache_memory` is per device."""
    spec = ArenaSpec(model.num_hidden_layers, 2, block_size, model.num_key_value_heads, model.head_dim, dtype,
                     shards)
    if num_kv_blocks is not None:
        blocks = num_kv_blocks + 1
    else:
        blocks = kv_cache_memory // spec.bytes_per_block_per_device
        if blocks < 2:
            raise ValueError(
                f"kv_cache_memory={kv_cache_memory} bytes holds no KV block "
                f"({spec.bytes_per_block_per_device} bytes per block of {block_size} tokens)")
    return ArenaSpec(model.num_hidden_layers, int(blocks), block_size, model.num_key_value_heads,
                     model.head_dim, dtype, shards)


def allocate_arena(spec: ArenaSpec, device=None, sharding=None):
    """Zeroed per-layer (k, v) caches on `device`, or split as `sharding` says (each device
    allocating only its own slice: zeros created by a compiled function with that output sharding).
    That function is kept per shape and sharding, so allocating again (wake_up after sleep,
    runner/sleep.py) compiles nothing."""
    if sharding is not None:
        zeros_split = _zeros_split(spec.layer_shape, spec.dtype, sharding)
        return [(zeros_split(), zeros_split()) for _ in range(spec.num_layers)]

    def zeros():
        return jnp.zeros(spec.layer_shape, jnp.dtype(spec.dtype), device=device)
    return [(zeros(), zeros()) for _ in range(spec.num_layers)]


@functools.lru_cache(maxsize=16)
def _zeros_split(shape: tuple[int, ...], dtype: str, sharding):
    return jax.jit(lambda: jnp.zeros(shape, jnp.dtype(dtype)), out_shardings=sharding)
