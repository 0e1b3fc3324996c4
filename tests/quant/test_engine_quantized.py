"""The engine end to end with quantization on, on the tiny random Llama: everything that works
for float works for quantized weights and a quantized KV cache.

- greedy tokens equal the model run directly (no runner) on the same quantized params, traced
  with the CPU kernels on as the engine's steps are (int4 then rounds activations per group at
  every step size), so the paged step, buckets and prefix sharing add nothing to what
  quantization changes;
- prefix caching hits and gives the same tokens; swap preemption gives the same tokens;
- the compile counter reads 0 after warm-up;
- an fp8 / int8 KV cache holds twice the blocks of bfloat16 (four times float32) in the same
  kv_cache_memory, and the paged step over it gives the tokens of the dense model reading the
  same quantized K/V (runner/kv_write.py's quantize_kv).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoints import load_checkpoint
from jaxserve.models import ModelConfig
from jaxserve.models.params import params_from_hf
from jaxserve.quant.accuracy import Scorer, greedy_reference, kv_fake_quant_attention
from jaxserve.quant.prepare import QuantRequest, prepare

from tests.conftest import TINY_ENGINE

PROMPTS = ["The tide comes in", "def add(a, b):", "A paged KV cache stores keys and values in blocks"]
N = 12
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0)


def _direct_greedy(path: str, request: QuantRequest, prompts: list[list[int]]) -> list[list[int]]:
    import jax.numpy as jnp

    ckpt = load_checkpoint(path)
    config = ModelConfig.from_hf_config(ckpt.config)
    prepared = prepare(ckpt, request, config, jnp.float32)
    params = params_from_hf(config, prepared.checkpoint.tensors, jnp.float32)
    attention = (kv_fake_quant_attention(config, prepared.kv_scales, prepared.kv_dtype)
                 if prepared.kv_scales else None)
    # traced as the engine traces a single-device CPU step: with the native kernels' arithmetic
    scorer = Scorer(params, config, max(len(p) for p in prompts) + N, attention, native_kernels=True)
    return [list(r[len(p):]) for r, p in zip(greedy_reference(scorer, prompts, N), prompts)]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module", params=["int8", "int4", "w8a8", "w8a8_lm_head"])
def quantized_llm(request, tiny_llama_dir):
    mode = request.param
    return mode, LLM(tiny_llama_dir, **TINY_ENGINE, quantization=mode.removesuffix("_lm_head"),
                     quantize_lm_head=mode.endswith("_lm_head"))


def test_engine_tokens_equal_the_quantized_model_run_directly(quantized_llm, tiny_llama_dir):
    mode, llm = quantized_llm
    tok = llm.get_tokenizer()
    got = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    request = QuantRequest(mode.removesuffix("_lm_head"), lm_head=mode.endswith("_lm_head"))
    assert got == _direct_greedy(tiny_llama_dir, request, [tok.encode(p) for p in PROMPTS])
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_prefix_cache_and_swap_keep_the_tokens(quantized_llm):
    _, llm = quantized_llm
    first = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    hits = llm.stats().scheduler.prefix_cache_hits
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == first
    assert llm.stats().scheduler.prefix_cache_hits > hits
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = _tokens(llm.generate(PROMPTS, long, use_tqdm=False))
    cramped = LLM.sharing_runner(llm, usable_kv_blocks=30, enable_prefix_caching=False, preemption_mode="swap",
                                 kv_watermark=0.0)
    assert _tokens(cramped.generate(PROMPTS, long, use_tqdm=False)) == want
    s = cramped.stats()
    assert s.scheduler.num_preemptions_swap > 0 and s.steps.num_compilations_after_warmup == 0


KV_MEMORY_ENGINE = {**TINY_ENGINE, "num_kv_blocks": None, "kv_cache_memory": 1 << 20}


@pytest.fixture(scope="module")
def f32_kv_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **KV_MEMORY_ENGINE)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_quantized_kv_cache_has_four_times_the_float32_blocks_and_the_dense_tokens(tiny_llama_dir, f32_kv_llm, kv):
    f32 = f32_kv_llm
    q = LLM(tiny_llama_dir, **KV_MEMORY_ENGINE, kv_cache_dtype=kv)
    # blocks include the null block: (bytes // block bytes) in both
    assert q.stats().scheduler.num_kv_blocks_total + 1 == 4 * (f32.stats().scheduler.num_kv_blocks_total + 1)
    tok = q.get_tokenizer()
    got = _tokens(q.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert got == _direct_greedy(tiny_llama_dir, QuantRequest(kv_cache_dtype=kv), [tok.encode(p) for p in PROMPTS])
    assert q.stats().steps.num_compilations_after_warmup == 0
    assert q.engine.runner.arena_spec.dtype == {"fp8_e4m3": "float8_e4m3fn", "int8": "int8"}[kv]
    # stats() names the arena's element type and what a block costs
    assert q.stats().kv.dtype == q.engine.runner.arena_spec.dtype and f32.stats().kv.dtype == "float32"
    assert 4 * q.stats().kv.bytes_per_block == f32.stats().kv.bytes_per_block


def test_beam_search_runs_on_quantized_weights(quantized_llm):
    from jaxserve.beam_search import BeamSearchParams

    _, llm = quantized_llm
    prompt = llm.get_tokenizer().encode(PROMPTS[0])
    got = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(3, 8, ignore_eos=True))[0]
    greedy = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0),
                          use_tqdm=False)[0].outputs[0]
    assert len(got.sequences) == 3 and all(len(s.tokens) == 8 for s in got.sequences)
    # the best beam is at least as likely as the greedy path (beam search's one promise)
    assert got.sequences[0].cum_logprob >= greedy.cumulative_logprob - 1e-4
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_w8a8_decode_steps_call_the_native_int8_dot(quantized_llm):
    """On one CPU device the few-row steps run cpu_kernels' int8 dot (its tokens are the ones
    test_engine_tokens_equal_the_quantized_model_run_directly compares with XLA's dot), the
    larger ones XLA's own; JAXSERVE_CPU_KERNELS=0 or a machine without a compiler keeps XLA's."""
    from cpu_kernels import build
    from cpu_kernels.int8_dot import max_rows

    mode, llm = quantized_llm
    runner = llm.engine.runner
    if not mode.startswith("w8a8") or not build.registered():
        pytest.skip("the native dot serves w8a8, where the kernels can be built")
    assert runner.cpu_kernels
    for bucket in runner.shapes.buckets():
        step, _ = runner.step_and_sampler(bucket)
        rows = bucket[0] + bucket[1] * runner.shapes.prefill_tile      # decode rows + prefill tiles' rows
        calls = "jaxserve_w8a8_dot" in step.as_text()
        if rows <= max_rows():
            assert calls, bucket
        elif mode == "w8a8":      # (a quantized LM head runs on the few rows sampled, any step)
            assert not calls, bucket
