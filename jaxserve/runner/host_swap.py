"""Copying KV blocks between the device arena and the host-memory pool: preemption by swap, and
the prefix cache's host tier (its saves of evicted blocks and its loads of host hits).

Blocks move in fixed batches of SWAP_BATCH (padding entries read and write the null block), so
the two transfer functions compile once, at start-up. The host pool is numpy, one (k, v) pair of
[num_host_blocks, block_size, K, H] arrays per layer.

A save does not wait for its bytes: the gather is dispatched in step order (before the step
whose blocks it frees) and its device-to-host copy started, and the host arrays are written
when the bytes are needed (a load, which must read them) or at the next step's block operations,
by when the gather has long run. So the step loop never blocks on a save's transfer, and the
device runs the step while the copy drains.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.kv_arena import ArenaSpec

SWAP_BATCH = 16


def _gather_blocks(kv_caches, ids):
    # -> per layer (k, v) of [SWAP_BATCH, block_size, K, H]
    return [(k[ids], v[ids]) for k, v in kv_caches]


def _scatter_blocks(kv_caches, ids, blocks):
    return [(k.at[ids].set(bk), v.at[ids].set(bv)) for (k, v), (bk, bv) in zip(kv_caches, blocks)]


class HostSwapPool:
    def __init__(self, spec: ArenaSpec, num_host_blocks: int):
        shape = (num_host_blocks,) + spec.layer_shape[1:]
        dtype = np.dtype(jnp.dtype(spec.dtype))
        self.num_blocks = num_host_blocks
        self.layers = [(np.zeros(shape, dtype), np.zeros(shape, dtype)) for _ in range(spec.num_layers)]
        self.bytes_per_block = 2 * spec.num_layers * int(np.prod(shape[1:])) * dtype.itemsize
        self._gather = self._scatter = None   # compiled for the arena at the first swap (start-up)
        self._in_flight: list[tuple[list[int], list]] = []   # saves whose bytes are on their way
        self.blocks_saved = 0
        self.blocks_loaded = 0

    def _programs(self, kv_caches):
        """The gather and scatter, compiled ahead of time for this arena and held here: a jitted
        function's own cache is bounded and shared by every engine in the process, so another
        engine's shapes could push these out and a swap would compile while serving."""
        if self._gather is None:
            ids = np.zeros(SWAP_BATCH, np.int32)
            block = np.zeros((SWAP_BATCH,) + self.layers[0][0].shape[1:], self.layers[0][0].dtype)
            blocks = [(block, block) for _ in self.layers]
            self._gather = jax.jit(_gather_blocks).lower(kv_caches, ids).compile()
            self._scatter = jax.jit(_scatter_blocks, donate_argnums=(0,)).lower(kv_caches, ids, blocks).compile()
        return self._gather, self._scatter

    def swap_out(self, kv_caches, pairs) -> None:
        """pairs: (device block, host block); copies device -> host (its host arrays are written
        by `flush`, which every reader calls first)."""
        for i in range(0, len(pairs), SWAP_BATCH):
            chunk = list(pairs[i:i + SWAP_BATCH])
            ids = np.zeros(SWAP_BATCH, np.int32)
            ids[:len(chunk)] = [d for d, _ in chunk]
            blocks = self._programs(kv_caches)[0](kv_caches, ids)
            for arr in jax.tree_util.tree_leaves(blocks):
                arr.copy_to_host_async()
            self._in_flight.append(([h for _, h in chunk], blocks))
            self.blocks_saved += len(chunk)

    def flush(self) -> None:
        """Write the saves in flight into the host arrays, in the order they were made (a later
        save to the same host block wins, as it must)."""
        for host_ids, blocks in self._in_flight:
            n = len(host_ids)
            for (hk, hv), (bk, bv) in zip(self.layers, jax.device_get(blocks)):
                hk[host_ids] = bk[:n]
                hv[host_ids] = bv[:n]
        self._in_flight = []

    def swap_in(self, kv_caches, pairs):
        """pairs: (host block, device block); copies host -> device, returns the new caches."""
        self.flush()
        self.blocks_loaded += len(pairs)
        for i in range(0, len(pairs), SWAP_BATCH):
            chunk = list(pairs[i:i + SWAP_BATCH])
            ids = np.zeros(SWAP_BATCH, np.int32)          # padding rows land in the null block
            ids[:len(chunk)] = [d for _, d in chunk]
            host_ids = [h for h, _ in chunk] + [0] * (SWAP_BATCH - len(chunk))
            blocks = [(hk[host_ids], hv[host_ids]) for hk, hv in self.layers]
            kv_caches = self._programs(kv_caches)[1](kv_caches, ids, blocks)
        return kv_caches


@dataclass(frozen=True, slots=True)
class SwapCostModel:
    """Measured at start-up: a swap of n blocks costs fixed_s + n * per_block_s each way."""

    fixed_s: float
    per_block_s: float
    prefill_tokens_per_s: float
    block_size: int

    def crossover_tokens(self) -> int:
        """Computed tokens above which swapping a request out and back in beats recomputing it."""
        recompute_per_token = 1.0 / self.prefill_tokens_per_s
        swap_per_token = 2 * self.per_block_s / self.block_size
        if recompute_per_token <= swap_per_token:
            return 1 << 30            # recompute is always cheaper
        return max(1, int(np.ceil(2 * self.fixed_s / (recompute_per_token - swap_per_token))))


def measure_swap_seconds(pool: HostSwapPool, kv_caches) -> tuple[float, float, list]:
    """Time one full batch and one single-block round trip (scratch blocks 1.. and host blocks 0..);
    returns (fixed seconds, seconds per block, the caches) of one swap direction."""
    def round_trip(n):
        pairs = [(1 + i, i) for i in range(n)]
        t = time.perf_counter()
        pool.swap_out(kv_caches_ref[0], pairs)
        kv_caches_ref[0] = pool.swap_in(kv_caches_ref[0], [(h, d) for d, h in pairs])
        jax.block_until_ready(kv_caches_ref[0])
        return (time.perf_counter() - t) / 2

    kv_caches_ref = [kv_caches]
    n = min(SWAP_BATCH, pool.num_blocks)
    round_trip(n)                                  # warm: compiles both transfers
    one = min(round_trip(1) for _ in range(3))
    full = min(round_trip(n) for _ in range(3))
    per_block = max(0.0, (full - one) / max(1, n - 1))
    fixed = max(0.0, one - per_block)
    return fixed, per_block, kv_caches_ref[0]
