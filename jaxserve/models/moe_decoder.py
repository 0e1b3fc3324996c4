"""Qwen3-MoE and Mixtral as a pure function of their params: the Llama family's decoder
(models/llama.py: its attention, with Qwen3's q/k norms for Qwen3-MoE, its norms, its dense MLP
where a layer has one) with a mixture-of-experts block as the MLP of the layers the config names
(`ModelConfig.moe_layers`: Mixtral all, Qwen3-MoE per `mlp_only_layers` / `decoder_sparse_step`).

The block: router logits x @ gate [D, E] (float, in the params' dtype as HF computes them),
softmax top-k (models/moe.py `route`, renormalized per `norm_topk_prob`), and the experts as a
grouped matmul over the tokens sorted by expert (`moe_mlp`), capacity-free. Its tensors are
declared in the registry (`moe_layout`): `mlp/gate/kernel` [D, E], `mlp/experts/gate_up` [E, D,
2F'] (columns gate | up) and `mlp/experts/down` [E, F', D], float or quantized per expert.

`forward(..., return_routing=True)` also returns every MoE layer's chosen experts
[L_moe, T, K] int32 (in `moe_layers` order): the runner counts tokens per expert from them.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.models.config import ModelConfig
from jaxserve.models.linear import matmul_precision
from jaxserve.models.llama import (MLP, Attention, AttentionFn, Params, RMSNorm, activation, apply_model,
                                   check_caches, compute_logits)
from jaxserve.models.moe import ExpertWeights, moe_mlp, route
from jaxserve.models.rope import rope_cos_sin

__all__ = ["forward", "compute_logits", "MoeBlock", "MoeModel"]


class StackedWeights(nn.Module):
    """One stacked expert projection's leaves, handed to moe.py as they are (float `kernel`
    [E, in, out], or a quantized form's leaves); `init` creates the float form."""

    shape: tuple[int, int, int]
    dtype: Any

    @nn.compact
    def __call__(self) -> dict:
        if self.is_initializing():
            self.param("kernel", nn.initializers.lecun_normal(batch_axis=(0,)), self.shape, self.dtype)
        return dict(self.variables["params"])


class MoeDecoderLayer(nn.Module):
    config: ModelConfig
    dtype: Any
    layer_idx: int
    shards: int = 1
    expert_layer: Callable = moe_mlp

    @nn.compact
    def __call__(self, x, cos, sin, kv_cache, attention: AttentionFn):
        c = self.config
        attn_out, kv_cache = Attention(c, self.dtype, self.layer_idx, self.shards, name="self_attn")(
            RMSNorm(c.rms_norm_eps, self.dtype, name="input_layernorm")(x), cos, sin, kv_cache, attention)
        x = x + attn_out
        h = RMSNorm(c.rms_norm_eps, self.dtype, name="post_attention_layernorm")(x)
        if c.is_moe_layer(self.layer_idx):
            out, ids = MoeBlock(c, self.dtype, self.expert_layer, name="mlp")(h)
        else:
            out, ids = MLP(c, self.dtype, self.shards, name="mlp")(h), None
        return x + out, kv_cache, ids


class MoeBlock(nn.Module):
    """x [T, D] -> (out [T, D], expert_ids [T, K]); params gate/kernel [D, E], experts/gate_up,
    experts/down. `expert_layer`: moe.py's `moe_mlp`, or what runs it over a mesh
    (parallel/experts.py), called as moe_mlp is."""

    config: ModelConfig
    dtype: Any
    expert_layer: Callable = moe_mlp

    @nn.compact
    def __call__(self, x):
        c = self.config
        d, f, e = c.hidden_size, c.moe_intermediate_size, c.num_experts
        gate = self.param("gate", lambda key: {"kernel": nn.initializers.lecun_normal()(key, (d, e), self.dtype)})
        logits = jnp.matmul(x, gate["kernel"].astype(self.dtype), precision=matmul_precision(self.dtype))  # [T, E]
        routing = route(logits, top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob)
        experts = Experts(c, self.dtype, name="experts")()
        return self.expert_layer(x, routing, experts, activation=activation(c)), routing.expert_ids


class Experts(nn.Module):
    config: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self) -> ExpertWeights:
        c = self.config
        d, f, e = c.hidden_size, c.moe_intermediate_size, c.num_experts
        return ExpertWeights(gate_up=StackedWeights((e, d, 2 * f), self.dtype, name="gate_up")(),
                             down=StackedWeights((e, f, d), self.dtype, name="down")())


class MoeModel(nn.Module):
    """Embedding, decoder layers (MoE or dense MLP per layer) and final norm."""

    config: ModelConfig
    dtype: Any = jnp.float32
    shards: int = 1
    return_routing: bool = False
    expert_layer: Callable = moe_mlp

    @nn.compact
    def __call__(self, input_ids, positions, kv_caches: Sequence[Any], attention: AttentionFn):

        c = self.config
        x = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                     name="embed_tokens")(input_ids)                          # [T, D]
        cos, sin = rope_cos_sin(c, positions)
        new_caches, routed = [], []
        for i in range(c.num_hidden_layers):
            x, cache, ids = MoeDecoderLayer(c, self.dtype, i, self.shards, self.expert_layer, name=f"layers_{i}")(
                x, cos, sin, kv_caches[i], attention)
            new_caches.append(cache)
            if ids is not None:
                routed.append(ids)
        hidden = RMSNorm(c.rms_norm_eps, self.dtype, name="norm")(x)
        if self.return_routing:
            return hidden, new_caches, jnp.stack(routed)                       # [L_moe, T, K]
        return hidden, new_caches


def forward(params: Params, config: ModelConfig, input_ids: jax.Array, positions: jax.Array,
            kv_caches: Sequence[Any] | None, attention: AttentionFn, *,
            shards: int = 1, record_inputs: bool = False, return_routing: bool = False,
            expert_layer: Callable | None = None):
    """As models/llama.py's forward; with `return_routing` the result gains, after the caches,
    every MoE layer's chosen experts [L_moe, T, K] int32. `expert_layer`: what runs the experts
    (default moe.py's `moe_mlp` on this device; parallel/experts.py's ExpertParallel over a mesh)."""
    kv_caches = check_caches(config, kv_caches)
    dtype = params["embed_tokens"]["embedding"].dtype
    if record_inputs and return_routing:
        raise ValueError("record_inputs and return_routing are separate passes")
    model = MoeModel(config=config, dtype=dtype, shards=shards, return_routing=return_routing,
                     expert_layer=expert_layer or moe_mlp)
    return apply_model(model, params, (input_ids, positions, list(kv_caches), attention), record_inputs)
