"""The Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3) as a pure function of its params.

This is step 4 of docs/design.md's data flow minus the sampling: embed -> layers -> final norm, and
`compute_logits` for the rows the runner samples from. The model never sees sequence boundaries:
`input_ids` and `positions` are a packed ragged batch, and the attention function passed in (dense
causal for tests, paged in the engine) is the only thing that knows which token sees which.

Architecture differences are config flags, not subclasses: Qwen2's q/k/v bias
(`attention_bias`), Qwen3's per-head q/k RMSNorm (`qk_norm`), Mistral's sliding window (read by
the attention function), tied embeddings, Llama-3 RoPE scaling. Its tensors are declared in the
registry (models/registry.py, `decoder_layout`).

Params layout: one subtree per layer (`layers_{i}`), never a stacked [L, ...] array, and [in, out]
kernels used as plain `x @ W`, with q/k/v fused into one projection and gate/up into another: on
XLA:CPU these are the fastest forms measured (docs/facts.md). Every projection is a `Linear`
(models/linear.py), which runs whatever form its weight has (float, int8, int4, fp8, w8a8).
Dtypes: params and activations in the params' dtype; RMSNorm, RoPE and softmax in float32;
logits float32.

Tensor parallelism (jaxserve/parallel/): with `shards` = S > 1 the fused q/k/v and gate/up
columns are stored shard-major (parallel/layout.py) and `Linear` splits a fused output per
shard; the arithmetic is the same, and S = 1 is the single-device code. Which device holds what
is the params' and arena's shardings.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.models import batch_invariant
from jaxserve.models.config import ModelConfig
from jaxserve.models.linear import Linear, lm_head_logits, recorded_inputs
from jaxserve.models.registry import has_o_proj_bias
from jaxserve.models.rope import apply_rope, rope_cos_sin

Params = dict  # pytree of jnp arrays, layout in params.py

# attention(layer_idx, q [T, N, H], k [T, K, H], v [T, K, H], kv_cache_layer)
#   -> (out [T, N, H], new kv_cache_layer); q and k arrive RoPE'd (and q/k-normed for Qwen3)
AttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


# the MLP's gate activation, by its HF name (`hidden_act` / `hidden_activation`)
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),   # the same tanh formula
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),       # erf
}


def activation(config: ModelConfig):
    if config.hidden_activation not in ACTIVATIONS:
        raise ValueError(f"{config.model_type}: hidden_activation={config.hidden_activation!r} "
                         f"is not one of {tuple(ACTIVATIONS)}")
    return ACTIVATIONS[config.hidden_activation]


class RMSNorm(nn.Module):
    """x / rms(x) * w, in float32 and cast back; `unit_offset`: * (1 + w) instead (Gemma's, whose
    zero weight is the identity)."""

    eps: float
    dtype: Any
    unit_offset: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.dtype).astype(jnp.float32)  # [C]
        scale = 1.0 + weight if self.unit_offset else weight

        def norm(rows):
            x32 = rows.astype(jnp.float32)
            normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
            return (normed * scale).astype(self.dtype)

        # XLA:CPU vectorizes the mean across rows once there are 8 of them: fixed tiles keep a
        # row's bits whatever the step's row count (models/batch_invariant.py)
        return batch_invariant.row_tiled(norm, x) if batch_invariant.active() else norm(x)


class Attention(nn.Module):
    config: ModelConfig
    dtype: Any
    layer_idx: int
    shards: int = 1             # tensor-parallel shards of the fused qkv layout
    unit_offset_norms: bool = False   # q/k norms scale by (1 + w) (Gemma 3)

    @nn.compact
    def __call__(self, x, cos, sin, kv_cache, attention: AttentionFn):
        c = self.config
        n, k, h = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        t = x.shape[0]
        q, key, value = Linear((n + 2 * k) * h, c.attention_bias, self.dtype, parts=(n * h, k * h, k * h),
                               shards=self.shards, name="qkv_proj")(x)        # [T, N*H], [T, K*H] x 2
        q, key, value = q.reshape(t, n, h), key.reshape(t, k, h), value.reshape(t, k, h)
        if c.qk_norm:                                                         # before RoPE
            q = RMSNorm(c.rms_norm_eps, self.dtype, self.unit_offset_norms, name="q_norm")(q)
            key = RMSNorm(c.rms_norm_eps, self.dtype, self.unit_offset_norms, name="k_norm")(key)
        q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
        out, kv_cache = attention(self.layer_idx, q, key, value, kv_cache)  # [T, N, H]
        out = Linear(c.hidden_size, has_o_proj_bias(c), self.dtype, name="o_proj")(out.reshape(t, n * h))  # [T, D]
        return out, kv_cache


class MLP(nn.Module):
    """act(gate) * up -> down: SwiGLU for the Llama family, GeGLU for Gemma (`hidden_activation`)."""

    config: ModelConfig
    dtype: Any
    shards: int = 1

    @nn.compact
    def __call__(self, x):
        f = self.config.intermediate_size
        gate, up = Linear(2 * f, False, self.dtype, parts=(f, f), shards=self.shards,
                          name="gate_up_proj")(x)                             # [T, F] each
        act = activation(self.config)
        if batch_invariant.active():      # the activation's rounding on fixed row tiles too
            hidden = batch_invariant.row_tiled(lambda g, u: act(g) * u, gate, up)
        else:
            hidden = act(gate) * up                                           # [T, F]
        return Linear(self.config.hidden_size, False, self.dtype, name="down_proj")(hidden)  # [T, D]


class DecoderLayer(nn.Module):
    config: ModelConfig
    dtype: Any
    layer_idx: int
    shards: int = 1

    @nn.compact
    def __call__(self, x, cos, sin, kv_cache, attention: AttentionFn):
        eps = self.config.rms_norm_eps
        attn_out, kv_cache = Attention(self.config, self.dtype, self.layer_idx, self.shards, name="self_attn")(
            RMSNorm(eps, self.dtype, name="input_layernorm")(x), cos, sin, kv_cache, attention)
        x = x + attn_out
        x = x + MLP(self.config, self.dtype, self.shards, name="mlp")(
            RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x))
        return x, kv_cache


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm; the LM head is `compute_logits`, applied only
    to the rows that are sampled."""

    config: ModelConfig
    dtype: Any = jnp.float32
    shards: int = 1

    @nn.compact
    def __call__(self, input_ids, positions, kv_caches: Sequence[Any], attention: AttentionFn):
        c = self.config
        x = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                     name="embed_tokens")(input_ids)                          # [T, D]
        cos, sin = rope_cos_sin(c, positions)                                  # [T, H] each
        new_caches = []
        for i in range(c.num_hidden_layers):
            x, cache = DecoderLayer(c, self.dtype, i, self.shards, name=f"layers_{i}")(
                x, cos, sin, kv_caches[i], attention)
            new_caches.append(cache)
        return RMSNorm(c.rms_norm_eps, self.dtype, name="norm")(x), new_caches


def forward(params: Params, config: ModelConfig, input_ids: jax.Array, positions: jax.Array,
            kv_caches: Sequence[Any] | None, attention: AttentionFn, *,
            shards: int = 1, record_inputs: bool = False):
    """input_ids, positions: [T] int32 -> (final-normed hidden [T, D], new per-layer caches).

    `shards`: the tensor-parallel size the params' fused columns are laid out for (1: the
    single-device layout); `config.num_key_value_heads` then counts replicated KV heads.
    `record_inputs`: also return every projection's input maximum per channel, by module path
    (models/linear.py; the calibration pass reads them).

    kv_caches holds one entry per layer (None entries allowed; None for all layers when the
    attention function keeps no cache); each is handed to `attention` and replaced by what it
    returns, so a jitted caller can donate the whole list.
    """
    kv_caches = check_caches(config, kv_caches)
    dtype = params["embed_tokens"]["embedding"].dtype
    model = LlamaModel(config=config, dtype=dtype, shards=shards)
    return apply_model(model, params, (input_ids, positions, list(kv_caches), attention), record_inputs)


def check_caches(config: ModelConfig, kv_caches: Sequence[Any] | None) -> Sequence[Any]:
    if kv_caches is None:
        return [None] * config.num_hidden_layers
    if len(kv_caches) != config.num_hidden_layers:
        raise ValueError(
            f"len(kv_caches)={len(kv_caches)} but the model has {config.num_hidden_layers} layers")
    return kv_caches


def apply_model(model: nn.Module, params: Params, args: tuple, record_inputs: bool):
    """`model.apply` on the module's params. The LM head is not part of the module
    (compute_logits applies it to sampled rows only), nor are a quantized KV cache's scales (the
    runner's attention reads them: runner/kv_write.py)."""
    module_params = {k: v for k, v in params.items() if k not in ("lm_head", "kv_scales")}
    if not record_inputs:
        return model.apply({"params": module_params}, *args)
    (hidden, caches), state = model.apply({"params": module_params}, *args, mutable=["intermediates"])
    return hidden, caches, recorded_inputs(state["intermediates"])


def compute_logits(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden [S, D] -> logits [S, V] float32 (accumulated in float32 even for bf16 params)."""
    return lm_head_logits(params, hidden, tied=config.tie_word_embeddings)

