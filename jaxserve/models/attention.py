"""Dense causal attention: the reference attention function for tests and one-sequence use.

The engine passes a paged attention function with the same signature; this one treats the T
tokens as ONE sequence at positions 0..T-1 and keeps no cache (whatever cache it gets, it returns
unchanged), so the model can be checked against HF transformers without the runner.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.models.config import ModelConfig
from jaxserve.models.linear import matmul_precision
from jaxserve.models.llama import AttentionFn


def dense_causal_attention(config: ModelConfig, sm_scale: float | None = None) -> AttentionFn:
    """Each layer's scale, sliding window and score soft cap are `config.layer_attention(layer)`'s
    (`sm_scale`, when given, overrides the scale of every layer)."""

    def attention(layer_idx: int, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: Any):
        layer = config.layer_attention(layer_idx)
        scale = layer.sm_scale if sm_scale is None else sm_scale
        window, cap = layer.sliding_window, layer.soft_cap
        t, n, h = q.shape
        kv_heads = k.shape[1]
        group = n // kv_heads              # query head i reads kv head i // group (HF's repeat_kv)
        qg = q.reshape(t, kv_heads, group, h)                                  # [T, K, G, H]
        precision = matmul_precision(q.dtype)
        scores = jnp.einsum("tkgh,skh->kgts", qg, k, precision=precision,
                            preferred_element_type=jnp.float32) * scale        # [K, G, T, S]
        if cap is not None:
            scores = cap * jnp.tanh(scores / cap)                             # before masking
        qi = jnp.arange(t)[:, None]
        kj = jnp.arange(t)[None, :]
        visible = kj <= qi
        if window is not None:
            visible &= kj > qi - window           # a token sees itself and window-1 before it
        scores = jnp.where(visible, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)                # [K, G, T, S]
        out = jnp.einsum("kgts,skh->tkgh", probs, v, precision=precision)    # [T, K, G, H]
        return out.reshape(t, n, h).astype(q.dtype), kv_cache

    return attention
