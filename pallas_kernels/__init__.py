"""Pallas kernels for paged attention, each beside its pure-JAX reference. Depends on jax only."""

from pallas_kernels.ragged_paged_attention import (
    query_layout,
    ragged_paged_attention_reference,
)

__all__ = ["query_layout", "ragged_paged_attention_reference"]
