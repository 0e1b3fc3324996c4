"""Writing a step's new K/V into the paged arena, and the quantized KV cache's scales.

A float arena (kv_cache_dtype auto) stores K/V in the model dtype: `write_kv` scatters them by
slot. A quantized arena (fp8_e4m3, int8) stores `round(k / k_scale)` with one scale per layer
and KV head, calibrated on real text (jaxserve/quant/calibration.py) and kept in the params
under `kv_scales` ({"k", "v"}: float32 [L, K]). Static scales, not per-block ones: a block fills
one token per step, so a per-block scale would have to grow and rescale earlier tokens, and the
arena would need scale storage beside every block (fp8 would no longer be exactly half of bf16).

The scales never enter the attention kernels (pallas_kernels/kv_quant.py): they are folded into
the queries and the output around the call, and the kernels only widen the stored elements as they
load them. The bytes attention reads are halved (quartered against float32) and no kernel takes
a scale argument.
"""

from __future__ import annotations

from typing import Callable

import jax

from pallas_kernels.kv_quant import quantize_kv, with_kv_scales


def kv_scales(params, layer: int):
    """(k_scale [K], v_scale [K]) of `layer` when the params carry KV scales, else None."""
    scales = params.get("kv_scales")
    if scales is None:
        return None
    return scales["k"][layer], scales["v"][layer]


def write_kv(k_cache, v_cache, k, v, slots, scales=None):
    # caches: [num_blocks, block_size, K, H]; k, v: [T, K, H]; slots: [T] flat slot ids
    if scales is None:
        k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
    else:
        k, v = quantize_kv(k, scales[0], k_cache.dtype), quantize_kv(v, scales[1], v_cache.dtype)
    if k.shape[0] == 1:
        # One row (a lone decode): XLA rewrites a one-row scatter into a dynamic-update-slice of
        # the flattened arena, which it does not update in place through the reshape: it copied
        # each layer's whole K and V arena every step (60 copies of 18 MB, a quarter of the
        # embedded model's batch-1 step on the CPU). Updated as the [blocks, block_size, K, H]
        # array it is, it writes in place. Slots are never out of bounds (padding rows write
        # slot 0, the null block), so the clamping of dynamic_update_slice never moves a row.
        block_size = k_cache.shape[1]
        at = (slots[0] // block_size, slots[0] % block_size, 0, 0)
        return (jax.lax.dynamic_update_slice(k_cache, k[None], at),
                jax.lax.dynamic_update_slice(v_cache, v[None], at))
    shape = k_cache.shape
    flat_k = k_cache.reshape(-1, shape[2], shape[3]).at[slots].set(k)
    flat_v = v_cache.reshape(-1, shape[2], shape[3]).at[slots].set(v)
    return flat_k.reshape(shape), flat_v.reshape(shape)


def scaled_attention(attention_impl: Callable, scales) -> Callable:
    """attention_impl itself for a float arena; for a quantized one, the same call with the
    per-KV-head scales folded into q (k's) and the output (v's): pallas_kernels/kv_quant.py."""
    return attention_impl if scales is None else with_kv_scales(attention_impl, *scales)
