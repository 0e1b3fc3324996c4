"""Moving a request's KV blocks out of the arena and into another engine's arena.

`gather` copies blocks (any ids, any order) into one contiguous buffer `[n, L, 2, block_size, K, H]`
(block, layer, k/v, ...), in the arena's element type, so a quantized arena moves its stored bytes
(the scales are the checkpoint's, equal on both sides: the handshake checks the checkpoint). The
receiving side `scatter`s a buffer into its *own* newly allocated blocks: ids are remapped by the
caller, never assumed equal across engines.

Both run in fixed buckets of blocks (powers of two up to a request's most blocks), compiled by
`compile_all()` before the engine takes traffic; padding entries read or write the null block
(block 0, which padding rows of every step write anyway), so serving compiles nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.kv_arena import ArenaSpec


def _gather_impl(kv_caches, ids):
    # -> [n, L, 2, block_size, K, H]
    return jnp.stack([jnp.stack([k[ids], v[ids]], axis=1) for k, v in kv_caches], axis=1)


def _scatter_impl(kv_caches, ids, buf):
    return [(k.at[ids].set(buf[:, i, 0]), v.at[ids].set(buf[:, i, 1])) for i, (k, v) in enumerate(kv_caches)]


def bucket_sizes(max_blocks: int) -> tuple[int, ...]:
    sizes, b = [], 1
    while b < max_blocks:
        sizes.append(b)
        b *= 2
    sizes.append(max(1, max_blocks))
    return tuple(sizes)


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """What one transferred block is: the two sides must agree on all of it (disagg/handshake.py)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, spec: ArenaSpec) -> "BlockLayout":
        return cls(spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim, str(jnp.dtype(spec.dtype)))

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(jnp.dtype(self.dtype))

    @property
    def bytes_per_block(self) -> int:
        return int(np.prod(self.block_shape)) * self.np_dtype.itemsize


class KVTransfer:
    """Gather and scatter of whole blocks on one runner's arena (`runner.kv_caches`, replaced by
    scatter: the arena is donated)."""

    def __init__(self, runner, max_blocks: int):
        self.runner = runner
        self.layout = BlockLayout.of(runner.arena_spec)
        self.buckets = bucket_sizes(max_blocks)
        self._gather: dict[int, object] = {}
        self._scatter: dict[int, object] = {}

    def compile_all(self) -> None:
        """Compile every bucket's gather and scatter now (start-up), not at the first transfer."""
        kv = self.runner.arena_spec.shape_dtype()
        for n in self.buckets:
            ids = jax.ShapeDtypeStruct((n,), jnp.int32)
            buf = jax.ShapeDtypeStruct((n,) + self.layout.block_shape, jnp.dtype(self.layout.dtype))
            self._gather[n] = jax.jit(_gather_impl).lower(kv, ids).compile()
            self._scatter[n] = jax.jit(_scatter_impl, donate_argnums=(0,)).lower(kv, ids, buf).compile()

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} blocks exceed the largest transfer bucket ({self.buckets[-1]})")

    def gather(self, block_ids) -> jax.Array:
        """Start copying `block_ids` out of the arena; returns the padded device buffer (its first
        len(block_ids) blocks are theirs). Reading it on the host waits for earlier steps."""
        n = len(block_ids)
        b = self._bucket(n)
        ids = np.zeros(b, np.int32)
        ids[:n] = block_ids
        return self._gather[b](self.runner.kv_caches, ids)

    def scatter(self, block_ids, data: np.ndarray) -> None:
        """Write `data` ([n, *block_shape], host) into this arena's blocks `block_ids`, after every
        step dispatched before (the arena's data dependence orders it)."""
        n = len(block_ids)
        if data.shape != (n,) + self.layout.block_shape:
            raise ValueError(f"a buffer of shape {data.shape} for {n} blocks of {self.layout.block_shape}")
        b = self._bucket(n)
        ids = np.zeros(b, np.int32)
        ids[:n] = block_ids
        if b > n:
            data = np.concatenate([data, np.zeros((b - n,) + data.shape[1:], data.dtype)])
        self.runner.transform_arena(lambda arena: self._scatter[b](arena, ids, data))
