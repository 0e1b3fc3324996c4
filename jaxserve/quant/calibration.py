"""The calibration pass: the largest activations and K/V values the float model produces on a
real text, from which fp8 activation scales, w8a8's smoothing and the quantized KV cache's scales
are set.

It runs the float model once over the text (windows of up to MAX_TOKENS tokens, dense causal
attention, no runner) through its architecture's forward (models/registry.py) with every
projection's input recorded (models/linear.py), and keeps:
    act_channel_absmax   per projection, by module path ("layers_0/self_attn/qkv_proj"): max |x|
                         per input channel (w8a8's smoothing divides each channel by its own
                         range; fp8 takes their maximum: one scale per GEMM input, as FP8 GEMMs take),
                         and the LM head's input (the final norm's output) under LM_HEAD_INPUT
    k, v                 per layer and KV head, max |k| (after RoPE: what the cache stores) and |v|
Per-head maxima for K/V: heads differ by an order of magnitude in the models measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import registry
from jaxserve.models.attention import dense_causal_attention
from jaxserve.models.config import ModelConfig

MAX_TOKENS = 512
LM_HEAD_INPUT = "lm_head"     # act_channel_absmax's key for the LM head's input


@dataclass(frozen=True)
class CalibrationResult:
    act_channel_absmax: dict[str, np.ndarray]   # projection module path -> [in] max |x|
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
        k_max = np.maximum(k_max, got["k"])
        v_max = np.maximum(v_max, got["v"])
        for path, absmax in got["inputs"].items():
            acts[path] = np.maximum(acts.get(path, 0.0), np.asarray(absmax, np.float64))
    return CalibrationResult(acts, k_max, v_max, len(token_ids))


def _calibration_forward(config: ModelConfig):
    dense = dense_causal_attention(config)
    model = registry.for_config(config).model()

    def run(params, ids):
        seen: dict[str, list] = {"k": [], "v": []}

        def attention(layer, q, k, v, cache):
            seen["k"].append(jnp.abs(k).max(axis=(0, 2)))                      # [K]
            seen["v"].append(jnp.abs(v).max(axis=(0, 2)))
            return dense(layer, q, k, v, cache)

        positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
        hidden, _, inputs = model.forward(params, config, ids, positions, None, attention, record_inputs=True)
        inputs = {**inputs, LM_HEAD_INPUT: jnp.abs(hidden).max(axis=0)}
        return {"k": jnp.stack(seen["k"]), "v": jnp.stack(seen["v"]), "inputs": inputs}

    return jax.jit(run)
