"""A trainer's replay: reference_logprobs, the per-token logprobs of given tokens from the engine's
own model function on a full sequence.

    lp = jaxserve.reference_logprobs(llm, params, token_ids)       # token_ids [T] or [B, T]
    lp[..., i] == log p(token_ids[..., i + 1] | token_ids[..., :i + 1])   # [..., T - 1] float32

It runs the same `forward` and `compute_logits` the engine's steps run (the model registry's, or a
model brought from outside jaxserve), on the same params pytree (`llm.engine.runner.params`, what
`LLM.update_weights` takes), but as one plain sequence: positions 0..T-1, dense causal attention
(models/attention.py, the reference the engine's paged attention is tested against), no KV cache,
no paging, no buckets, the LM head on every position. It is a pure function of `params` and
`token_ids`: jit it, vmap it, differentiate it with respect to float params (the RL example's
policy gradient, examples/rl_policy_gradient.py).

For a prompt of P tokens and its completion, the completion's logprobs are `lp[..., P - 1:]`.
`temperature` divides the logits first, as the sampler does: with `logprobs_mode="processed"`
and no truncation or adjustment (top_k, top_p, min_p, penalties, bias, masks all off), the
engine's sampled logprobs are these at the request's temperature; with "raw", at 1. A batch of
sequences of different lengths can be right-padded with any id: causal attention never lets a
position see the padding after it (mask the padded positions' outputs).

The engine's paged, bucketed step computes the same function with other reductions (attention
over blocks, matmuls over a bucket's rows), so its logprobs differ from these in the last bits
(tests/test_replay.py measures the gap; docs/rl.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.models import registry
from jaxserve.models.attention import dense_causal_attention
from jaxserve.models.batch_invariant import batch_invariant as batch_invariant_mode, log_softmax
from jaxserve.models.invariant_attention import sequence_attention
from jaxserve.models.config import ModelConfig
from jaxserve.parallel.mesh import MODEL_AXIS

DEFAULT_BLOCK_SIZE = 16      # CacheConfig's block_size default: a ModelConfig replays with it


class _Replayed(NamedTuple):
    """What the replay needs of the model it follows."""
    config: ModelConfig
    fns: Any                  # the module or adapter with forward / compute_logits
    shards: int               # the tensor-parallel layout of its params
    batch_invariant: bool     # whether its engine runs the batch-invariant mode
    block_size: int           # its KV block size (the invariant attention reads in its blocks)
    custom: bool              # a custom model (not a registry architecture)


def _model_of(model: Any) -> _Replayed:
    """What to replay for an LLM, an Engine, a ModelRunner or a ModelConfig."""
    if isinstance(model, ModelConfig):       # a registry architecture, single-device layout
        return _Replayed(model, registry.for_config(model).model(), 1, False, DEFAULT_BLOCK_SIZE, False)
    runner = model
    if hasattr(runner, "engine"):            # LLM
        runner = runner.engine
    if hasattr(runner, "runner"):            # Engine
        runner = runner.runner
    config = getattr(runner, "model_config", None)
    if config is None:
        raise TypeError(f"reference_logprobs takes an LLM, an Engine, a ModelRunner or a ModelConfig, "
                        f"not {type(model).__name__}")
    custom = runner.model is not None
    fns = runner.model if custom else registry.for_config(config).model()
    shards = 1 if runner.mesh is None else runner.mesh.shape[MODEL_AXIS]
    return _Replayed(config, fns, shards, runner.batch_invariant, runner.arena_spec.block_size, custom)


def reference_logprobs(model: Any, params: Any, token_ids: jax.Array, *, temperature: float = 1.0,
                       batch_invariant: bool | None = None) -> jax.Array:
    """Logprobs of each next token of `token_ids` under `params`: [T] -> [T - 1], [B, T] -> [B, T - 1],
    float32. model: the LLM (or Engine, or ModelRunner) whose model function and layout `params`
    follow, or a ModelConfig (its registry architecture, the one-device layout of
    models/params.py); params: a pytree shaped as `llm.engine.runner.params`. Traceable (jit,
    grad, vmap). batch_invariant: compute with the engine's batch-invariant kernels (row-tiled
    matmuls and norms, the grouped attention over blocks of the engine's block size), so the
    result equals a batch-invariant engine's logprobs bit for bit; None: as the engine given
    runs (False for a ModelConfig)."""
    replayed = _model_of(model)
    config, fns, shards, block_size = replayed.config, replayed.fns, replayed.shards, replayed.block_size
    invariant = replayed.batch_invariant if batch_invariant is None else batch_invariant
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy rows' logprobs are at 1)")
    token_ids = jnp.asarray(token_ids, jnp.int32)
    if token_ids.ndim == 2:
        return jax.vmap(lambda ids: reference_logprobs(model, params, ids, temperature=temperature,
                                                       batch_invariant=invariant))(token_ids)
    if token_ids.ndim != 1 or token_ids.shape[0] < 2:
        raise ValueError(f"token_ids must be [T] or [B, T] with T >= 2, got shape {token_ids.shape}")
    if invariant and shards > 1:
        raise ValueError("batch_invariant=True replays one device's layout (the mode refuses tensor parallelism)")
    if invariant and (config.num_experts or replayed.custom):
        raise ValueError("batch_invariant=True replays the registry's dense architectures (the engine's mode "
                         "refuses mixture-of-experts and custom models)")
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    attention = sequence_attention(config, block_size) if invariant else dense_causal_attention(config)
    with batch_invariant_mode(invariant):
        hidden, _ = fns.forward(params, config, token_ids, positions, None, attention, shards=shards)  # [T, D]
        logits = fns.compute_logits(params, config, hidden[:-1]).astype(jnp.float32)      # [T - 1, V]
        lp = log_softmax(logits / temperature)
    return jnp.take_along_axis(lp, token_ids[1:, None], axis=-1)[:, 0]
