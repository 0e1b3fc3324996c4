"""The draft model of speculative decoding (method "draft_model"): its own compiled runner, on an
arena with the target's block count and block size so the scheduler's block tables index both
(engine/draft_proposer.py says how the two stay in step)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxserve.checkpoints import load_checkpoint
from jaxserve.models.config import ModelConfig
from jaxserve.models.params import params_from_hf
from jaxserve.runner.calibration import CalibrationCache, CalibrationKey, Calibrator
from jaxserve.runner.executables import ExecutableCache
from jaxserve.runner.kv_arena import plan_arena
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.warmup import warm_up

log = logging.getLogger(__name__)


def build_draft_runner(config, target: ModelRunner, cache_dir: str | None, dtype, *,
                       progress: bool = False) -> ModelRunner:
    """Load and compile the draft named by config.speculative_config.model beside `target`.
    Raises ValueError when it cannot draft for the target (another vocabulary, too short a context)."""
    path = config.speculative_config.model
    ckpt = load_checkpoint(path, cache_dir=cache_dir)
    model_config = ModelConfig.from_hf_config(ckpt.config)
    vocab = target.model_config.vocab_size
    if model_config.vocab_size != vocab:
        raise ValueError(f"the draft model {path!r} has a vocabulary of {model_config.vocab_size} tokens, the target "
                         f"{vocab}: a draft must use the target's tokenizer")
    if model_config.max_position_embeddings < target.shapes.max_model_len:
        raise ValueError(f"the draft model {path!r} takes {model_config.max_position_embeddings} positions, fewer "
                         f"than max_model_len={target.shapes.max_model_len}")
    dtype = jnp.dtype(dtype)   # the target's compute dtype (the draft is not quantized)
    params = jax.block_until_ready(params_from_hf(model_config, ckpt.tensors, dtype))
    arena = plan_arena(model_config, block_size=target.arena_spec.block_size, dtype=str(dtype),
                       num_kv_blocks=target.arena_spec.num_blocks - 1, kv_cache_memory=None)   # less the null block
    host_blocks = target.host_pool.num_blocks if target.host_pool is not None else 0
    runner = ModelRunner(model_config, params, arena, target.shapes, attention_impl=target.attention_impl,
                         xla_optimization_level=config.compilation.xla_optimization_level, num_host_blocks=host_blocks,
                         executable_cache=ExecutableCache(f"{cache_dir}/executables") if cache_dir else None,
                         sampler_probs=True)   # the distributions its guesses are drawn from
    runner.warm_helpers()
    if config.compilation.warm_up == "all":
        warm_up(runner, progress=progress)
    if config.adaptive_speculation:
        # what the planner weighs guesses against: k of these steps before each verification
        calibrator = Calibrator(runner, cache=CalibrationCache(f"{cache_dir}/calibration") if cache_dir else None,
                                key=CalibrationKey.for_runner(runner, ckpt.identity))
        from jaxserve.engine.builder import measure_decode_step_seconds

        measure_decode_step_seconds(calibrator)    # kept in runner.measurements for the scheduler's config
        calibrator.save()
    log.info("draft model %s: %d layers, arena of %d blocks", path, model_config.num_hidden_layers, arena.num_blocks)
    return runner
