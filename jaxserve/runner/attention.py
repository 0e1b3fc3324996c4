"""Which ragged paged attention implementation the step calls.

On the CPU the XLA implementation (uniform query slots, a flat list of context chunks) serves; on a GPU
the Pallas kernels behind `pallas_kernels.dispatch` do. `reference` forces the pure-JAX source
of truth; any other name (e.g. `mosaic_interpret`) is handed to the dispatcher.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla


def _drop_hint(fn: Callable, **fixed) -> Callable:
    @functools.wraps(fn)
    def call(*args, uniform_q_len=None, kv_chunk_blocks=None, items_per_iter=None, **kwargs):
        return fn(*args, **kwargs, **fixed)
    return call


def select_attention(name: str = "auto") -> Callable:
    if name == "auto":
        name = "xla" if jax.default_backend() == "cpu" else "gpu"
    if name == "xla":
        return ragged_paged_attention_xla
    if name == "reference":
        return _drop_hint(ragged_paged_attention_reference)
    from pallas_kernels.dispatch import ragged_paged_attention
    if name == "gpu":
        return _drop_hint(ragged_paged_attention)
    return _drop_hint(ragged_paged_attention, implementation=name)
