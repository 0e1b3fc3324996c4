"""Whole-block copies in every layer of the arena (copy-on-write of a shared prefix block).

COPY_BATCH pairs per compiled call, padding pairs copying the null block onto itself, so one
executable serves every copy; compiled at the first copy (ModelRunner.warm_helpers, at start-up)
and held, as the swap's transfers are (host_swap.py says why)."""

from __future__ import annotations

import jax
import numpy as np

COPY_BATCH = 16


class BlockCopy:
    def __init__(self):
        self._compiled = None

    def __call__(self, kv_caches, pairs):
        """kv_caches with every (src, dst) block pair copied; the arena is donated."""
        pairs = list(pairs)
        for i in range(0, len(pairs), COPY_BATCH):
            chunk = pairs[i:i + COPY_BATCH]
            chunk += [(0, 0)] * (COPY_BATCH - len(chunk))
            src = np.array([p[0] for p in chunk], np.int32)
            dst = np.array([p[1] for p in chunk], np.int32)
            if self._compiled is None:
                self._compiled = jax.jit(_copy_blocks, donate_argnums=(0,)).lower(kv_caches, src, dst).compile()
            kv_caches = self._compiled(kv_caches, src, dst)
        return kv_caches


def _copy_blocks(kv_caches, src, dst):
    return [(k.at[dst].set(k[src]), v.at[dst].set(v[src])) for k, v in kv_caches]
