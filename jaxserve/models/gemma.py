"""Gemma 2 and Gemma 3 (text) as a pure function of their params: llama.py's contract, Gemma's math.

`forward(params, config, input_ids, positions, kv_caches, attention, *, shards)` and
`compute_logits(params, config, hidden)` are llama.py's, with the same AttentionFn (q and k arrive
RoPE'd and, for Gemma 3, q/k-normed) and the same params layout plus two norms per layer:

    embed_tokens/embedding                    [V, D]   (the LM head too: Gemma ties it)
    layers_{i}/input_layernorm/weight         [D]
    layers_{i}/self_attn/qkv_proj/kernel      [D, (N + 2K) * H]   columns: q | k | v
    layers_{i}/self_attn/q_norm/weight        [H]      (Gemma 3; k_norm likewise)
    layers_{i}/self_attn/o_proj/kernel        [N * H, D]
    layers_{i}/post_attention_layernorm/weight  [D]    (on the attention output, before the add)
    layers_{i}/pre_feedforward_layernorm/weight [D]
    layers_{i}/post_feedforward_layernorm/weight [D]   (on the MLP output, before the add)
    layers_{i}/mlp/gate_up_proj/kernel        [D, 2F]  columns: gate | up
    layers_{i}/mlp/down_proj/kernel           [F, D]
    norm/weight                               [D]

What differs from Llama, each as HF transformers' modeling_gemma2.py / modeling_gemma3.py has it:
- RMSNorm scales by (1 + weight), computed in float32 and cast back after the scale (so a zero
  weight is the identity: HF initializes norms to zeros);
- the embedding is multiplied by sqrt(hidden_size), that factor first rounded to the params'
  dtype (HF: `embed_scale.to(weight.dtype)`; 55.4256 is 55.5 in bf16);
- GeGLU MLP: act(gate) * up with `hidden_activation` (gelu_pytorch_tanh: tanh approximation);
- the attention scale is query_pre_attn_scalar ** -0.5, attention scores are soft-capped
  (Gemma 2) and sliding layers see only the last `sliding_window` keys: all three are
  `config.layer_attention(i)`, which the attention function reads;
- Gemma 3's RoPE has two bases: `rope_local_theta` for sliding layers, `rope_theta` (optionally
  with linear scaling) for full-attention ones; Gemma 2 has one;
- the final logits are soft-capped (Gemma 2: final_logit_softcap) in compute_logits, in float32.

Every projection is a `Linear` (models/linear.py): float, quantized and tensor-parallel shard-major
fused layouts run as they do for Llama.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import batch_invariant, registry
from jaxserve.models.config import SLIDING_ATTENTION, ModelConfig
from jaxserve.models.linear import lm_head_logits
from jaxserve.models.llama import MLP, Attention, RMSNorm, activation, apply_model, check_caches
from jaxserve.models.rope import rope_cos_sin

Params = dict
AttentionFn = Any   # llama.AttentionFn: (layer_idx, q, k, v, kv_cache) -> (out, kv_cache)

def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (HF's order: divide, tanh, multiply); x unchanged when cap is None."""
    if cap is None:
        return x
    fn = lambda rows: jnp.tanh(rows / cap) * cap
    # tanh's polynomial rounds by how XLA vectorizes it: fixed tiles in the batch-invariant mode
    return batch_invariant.row_tiled(fn, x) if batch_invariant.active() else fn(x)


def GemmaRMSNorm(eps: float, dtype: Any, name: str) -> RMSNorm:
    """Gemma's norm: x / rms(x) * (1 + w) in float32, cast back after the scale."""
    return RMSNorm(eps, dtype, unit_offset=True, name=name)


class GemmaDecoderLayer(nn.Module):
    config: ModelConfig
    dtype: Any
    layer_idx: int
    shards: int = 1

    @nn.compact
    def __call__(self, x, cos, sin, kv_cache, attention: AttentionFn):
        eps, dt = self.config.rms_norm_eps, self.dtype
        # llama.py's attention (q|k|v, Gemma 3's q/k norms with (1 + w), RoPE, o) and GeGLU MLP;
        # HF's Gemma puts `attention_bias` on q, k, v and o alike, as Llama does
        attn_out, kv_cache = Attention(self.config, dt, self.layer_idx, self.shards, unit_offset_norms=True,
                                       name="self_attn")(
            GemmaRMSNorm(eps, dt, name="input_layernorm")(x), cos, sin, kv_cache, attention)
        x = x + GemmaRMSNorm(eps, dt, name="post_attention_layernorm")(attn_out)
        mlp_out = MLP(self.config, dt, self.shards, name="mlp")(
            GemmaRMSNorm(eps, dt, name="pre_feedforward_layernorm")(x))
        return x + GemmaRMSNorm(eps, dt, name="post_feedforward_layernorm")(mlp_out), kv_cache


def layer_rope(config: ModelConfig, layer: int) -> tuple[float, float | None]:
    """(RoPE base, linear scaling factor) of one layer: Gemma 3's sliding layers use the local
    base unscaled, every other layer the global base with the configured scaling."""
    if config.rope_local_theta is not None and config.layer_type(layer) == SLIDING_ATTENTION:
        return config.rope_local_theta, None
    return config.rope_theta, config.rope_linear_factor


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers and final norm; the (tied) LM head is `compute_logits`."""

    config: ModelConfig
    dtype: Any = jnp.float32
    shards: int = 1

    @nn.compact
    def __call__(self, input_ids, positions, kv_caches: Sequence[Any], attention: AttentionFn):
        c = self.config
        x = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                     name="embed_tokens")(input_ids)                          # [T, D]
        # HF: a float32 tensor sqrt(D), cast to the weight's dtype, times the embedding
        x = x * jnp.asarray(np.float32(c.hidden_size ** 0.5)).astype(self.dtype)
        ropes = {}                                                            # (base, factor) -> cos, sin
        new_caches = []
        for i in range(c.num_hidden_layers):
            rope = layer_rope(c, i)
            if rope not in ropes:
                ropes[rope] = rope_cos_sin(c, positions, theta=rope[0], linear_factor=rope[1])  # [T, H] x 2
            x, cache = GemmaDecoderLayer(c, self.dtype, i, self.shards, name=f"layers_{i}")(
                x, *ropes[rope], kv_caches[i], attention)
            new_caches.append(cache)
        return GemmaRMSNorm(c.rms_norm_eps, self.dtype, name="norm")(x), new_caches


def _check(config: ModelConfig) -> None:
    if config.model_type not in registry.GEMMA.model_types:
        raise ValueError(f"models/gemma.py runs {registry.GEMMA.model_types}, not {config.model_type!r}")
    if config.rope_scaling is not None:
        raise ValueError(f"{config.model_type}: Llama-3 RoPE scaling is not supported")
    activation(config)


def forward(params: Params, config: ModelConfig, input_ids: jax.Array, positions: jax.Array,
            kv_caches: Sequence[Any] | None, attention: AttentionFn, *,
            shards: int = 1, record_inputs: bool = False):
    """input_ids, positions: [T] int32 -> (final-normed hidden [T, D], new per-layer caches);
    llama.forward's contract (kv_caches, shards, the attention function and record_inputs alike)."""
    _check(config)
    kv_caches = check_caches(config, kv_caches)
    dtype = params["embed_tokens"]["embedding"].dtype
    model = GemmaModel(config=config, dtype=dtype, shards=shards)
    return apply_model(model, params, (input_ids, positions, list(kv_caches), attention), record_inputs)


def compute_logits(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden [S, D] -> logits [S, V] float32, soft-capped by final_logit_softcap (in float32)."""
    logits = lm_head_logits(params, hidden, tied=config.tie_word_embeddings)   # the unscaled embedding
    return soft_cap(logits, config.final_logit_softcap)
