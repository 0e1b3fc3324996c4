"""The engine with attention forced to a Pallas kernel (run by its CPU interpreter) produces the
same greedy tokens as the pure-JAX reference path."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.dispatch import choose

from jaxserve import LLM, SamplingParams

from tests.conftest import TINY_ENGINE

# One decode bucket and one prefill bucket: the interpreted kernels compile slowly.
# Triton needs power-of-two blocks of at least 16 tokens.
SMALL = dict(TINY_ENGINE, block_size=16, num_kv_blocks=32, decode_buckets=(4,), prefill_buckets=(0, 4), swap_space=0)
PROMPTS = ["The tide comes in", "def add(a, b):", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026 and more"]
GREEDY = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)


@pytest.mark.parametrize("impl", ["triton_interpret"])
def test_forced_kernel_matches_the_reference_path(tiny_llama_dir, impl):
    ref = LLM(tiny_llama_dir, attention_impl="reference", **SMALL)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, GREEDY, use_tqdm=False)]
    kernel = LLM(tiny_llama_dir, attention_impl=impl, **SMALL)
    # the dispatcher really picks the kernel for the engine's shapes (it falls back to XLA otherwise)
    spec = kernel.engine.runner.arena_spec
    cfg = kernel.engine.runner.model_config
    q = jax.ShapeDtypeStruct((8, cfg.num_attention_heads, cfg.head_dim), jnp.dtype(spec.dtype))
    k = jax.ShapeDtypeStruct(spec.layer_shape, jnp.dtype(spec.dtype))
    assert choose(impl, q, k)[0] == impl
    got = [o.outputs[0].token_ids for o in kernel.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    assert kernel.stats().steps.num_compilations_after_warmup == 0
