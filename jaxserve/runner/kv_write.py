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
    # Indexed as the [blocks, block_size, K, H] array the arena is, never through a flattened
    # view: XLA turns a one-row write (a lone decode) into a dynamic-update-slice, which it did not
    # do in place through the reshape, and copied each layer's whole K and V arena every step
    # (60 copies of 18 MB, a quarter of the embedded model's batch-1 step on the CPU).
    block_size = k_cache.shape[1]
    block, offset = slots // block_size, slots % block_size
    return k_cache.at[block, offset].set(k), v_cache.at[block, offset].set(v)


def scaled_attention(attention_impl: Callable, scales) -> Callable:
    """attention_impl itself for a float arena; for a quantized one, the same call with the
    per-KV-head scales folded into q (k's) and the output (v's): pallas_kernels/kv_quant.py."""
    return attention_impl if scales is None else with_kv_scales(attention_impl, *scales)
