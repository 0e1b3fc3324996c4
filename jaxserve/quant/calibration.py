"""The calibration pass: the largest activations and K/V values the float model produces on a
real text, from which fp8 activation scales, w8a8's smoothing and the quantized KV cache's scales
are set.

It runs the float model once over the text (windows of up to MAX_TOKENS tokens, dense causal
attention, no runner), and records per layer:
    attn_in   max |x| entering q/k/v (the input norm's output)
    o_in      max |x| entering o_proj (the attention output)
    mlp_in    max |x| entering gate/up (the post-attention norm's output)
    down_in   max |x| entering down_proj (silu(gate) * up)
    k, v      max |k| / |v| per KV head, k after RoPE (what the cache stores)
Activations per input channel (w8a8's smoothing divides each channel by its own range) and per
tensor (the channels' maximum: one scale per GEMM input, as FP8 GEMMs take), per-head maxima for
K/V (heads differ by an order of magnitude in the models measured).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import llama
from jaxserve.models.attention import dense_causal_attention
from jaxserve.models.config import ModelConfig
from jaxserve.models.quantized_linear import is_quantized

MAX_TOKENS = 512


@dataclass(frozen=True)
class CalibrationResult:
    act_channel_absmax: dict[str, np.ndarray]   # "<layer>.<attn_in|o_in|mlp_in|down_in>" -> [in] max |x|
    k_absmax: np.ndarray              # [L, K]
    v_absmax: np.ndarray              # [L, K]
    num_tokens: int


def calibrate(params, config: ModelConfig, token_ids: list[int]) -> CalibrationResult:
    """Run the float `params` over `token_ids` and record the maxima above."""
    if not token_ids:
        raise ValueError("calibration needs at least one token of text")
    L, K = config.num_hidden_layers, config.num_key_value_heads
    k_max, v_max = np.zeros((L, K)), np.zeros((L, K))
    acts: dict[str, np.ndarray] = {}
    run = _calibration_forward(config)
    for start in range(0, len(token_ids), MAX_TOKENS):
        ids = jnp.asarray(token_ids[start:start + MAX_TOKENS], jnp.int32)
        got = jax.device_get(run(params, ids))
        for layer in range(L):
            k_max[layer] = np.maximum(k_max[layer], got["k"][layer])
            v_max[layer] = np.maximum(v_max[layer], got["v"][layer])
            for kind in ("attn_in", "o_in", "mlp_in", "down_in"):
                key = f"{layer}.{kind}"
                acts[key] = np.maximum(acts.get(key, 0.0), np.asarray(got[kind][layer], np.float64))
    return CalibrationResult(acts, k_max, v_max, len(token_ids))


def _calibration_forward(config: ModelConfig):
    dense = dense_causal_attention(config)
    f = config.intermediate_size

    def run(params, ids):
        seen: dict[str, list] = {"k": [], "v": [], "o_in": []}

        def attention(layer, q, k, v, cache):
            out, cache = dense(layer, q, k, v, cache)
            seen["k"].append(jnp.abs(k).max(axis=(0, 2)))                      # [K]
            seen["v"].append(jnp.abs(v).max(axis=(0, 2)))
            seen["o_in"].append(jnp.abs(out.reshape(out.shape[0], -1)).max(axis=0))           # [N * H]
            return out, cache

        module = llama.LlamaModel(config=config, dtype=params["embed_tokens"]["embedding"].dtype,
                                  quantized=is_quantized(params))
        module_params = {k: v for k, v in params.items() if k not in ("lm_head", "kv_scales")}
        positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
        _, state = module.apply({"params": module_params}, ids, positions, [None] * config.num_hidden_layers,
                                attention, capture_intermediates=True, mutable=["intermediates"])
        inter = state["intermediates"]
        out = {"k": jnp.stack(seen["k"]), "v": jnp.stack(seen["v"]), "o_in": jnp.stack(seen["o_in"]),
               "attn_in": [], "mlp_in": [], "down_in": []}
        for i in range(config.num_hidden_layers):
            layer = inter[f"layers_{i}"]
            out["attn_in"].append(jnp.abs(layer["input_layernorm"]["__call__"][0]).max(axis=0))        # [D]
            out["mlp_in"].append(jnp.abs(layer["post_attention_layernorm"]["__call__"][0]).max(axis=0))
            gate_up = layer["mlp"]["gate_up_proj"]["__call__"][0]               # [T, 2F]
            out["down_in"].append(jnp.abs(jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]).max(axis=0))  # [F]
        return {k: jnp.stack(v) if isinstance(v, list) else v for k, v in out.items()}

    return jax.jit(run)
