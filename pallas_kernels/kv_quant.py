"""A quantized paged KV cache (float8_e4m3fn or int8 elements, one scale per KV head).

Stored value = round(x / scale) in the cache dtype, saturating at its range (448 for e4m3,
127 for int8). Every implementation reads such a cache by widening the elements to q's dtype as
it loads them (the reference and the XLA path widen to float32, the Triton kernel to q's dtype);
no kernel takes a scale. The scales are folded around the call instead (`with_kv_scales`):
q . (s_k k) = (s_k q) . k per KV head, and sum_j p_j (s_v v_j) = s_v sum_j p_j v_j, so the
queries are multiplied by s_k and the output by s_v. The Mosaic kernel declines a quantized
cache (its TMA copies land in SMEM in the cache dtype and wgmma would need an f8 x bf16 dot);
the dispatcher falls back to the Triton kernel.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

KV_QMAX = {"float8_e4m3fn": 448.0, "int8": 127.0}


def is_quantized_kv(dtype) -> bool:
    return jnp.dtype(dtype).name in KV_QMAX


def quantize_kv(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x [T, K, H] float, scale [K] -> the stored form in `dtype`."""
    qmax = KV_QMAX[jnp.dtype(dtype).name]
    y = jnp.clip(x.astype(jnp.float32) / scale[None, :, None], -qmax, qmax)
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype)


def dequantize_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
    """The stored form [..., K, H] -> float32 values."""
    return x.astype(jnp.float32) * scale[:, None]


def with_kv_scales(attention: Callable, k_scale: jax.Array, v_scale: jax.Array) -> Callable:
    """`attention` (ragged paged attention's signature) over a quantized cache with per-KV-head
    scales k_scale, v_scale [K]: the same call with the scales folded into q and the output."""

    @functools.wraps(attention)
    def call(q, k_cache, v_cache, *args, **kwargs):
        group = q.shape[1] // k_scale.shape[0]                 # query head i reads kv head i // group
        per_head_k = jnp.repeat(k_scale, group)[None, :, None]  # [1, N, 1]
        per_head_v = jnp.repeat(v_scale, group)[None, :, None]
        qs = (q.astype(jnp.float32) * per_head_k).astype(q.dtype)
        out = attention(qs, k_cache, v_cache, *args, **kwargs)
        return (out.astype(jnp.float32) * per_head_v).astype(out.dtype)

    return call
