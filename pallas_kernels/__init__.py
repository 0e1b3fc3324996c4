"""Pallas kernels for paged attention, each beside its pure-JAX reference. Depends on jax only.

`ragged_paged_attention` is the entry point the runner calls: it dispatches to the Mosaic GPU
kernel (Hopper), the Triton-backend kernel (older CUDA GPUs) or the XLA implementation (CPU).
"""

from pallas_kernels.dispatch import ragged_paged_attention, resolve_implementation
from pallas_kernels.ragged_paged_attention import (
    query_layout,
    ragged_paged_attention_reference,
)

__all__ = [
    "query_layout",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "resolve_implementation",
]
