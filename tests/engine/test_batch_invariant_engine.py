"""EngineConfig.batch_invariant end to end on the tiny Llama: a request's tokens and logprobs are
bit-identical alone and beside other requests (other buckets, chunked prefill, a prefix-cache
hit, preemption under a small arena), greedy and sampled, and equal bit for bit to
`reference_logprobs` compiled with the engine's compiler options. What the mode does not cover
is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, reference_logprobs
from jaxserve.engine_args import engine_config
from tests.conftest import TINY_ENGINE
from tests.sched.sched_testkit import check_invariants

# 96 blocks of 4 tokens: the four long requests below need more, so some are preempted
INVARIANT_ENGINE = dict(TINY_ENGINE, batch_invariant=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **INVARIANT_ENGINE)


def _tokens_and_logprobs(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    c = outs[0].outputs[0]
    return c.token_ids, np.array([e[t].logprob for e, t in zip(c.logprobs, c.token_ids)], np.float32)


def test_a_request_is_bit_identical_whatever_else_runs_and_equals_the_replay(llm):
    rng = np.random.default_rng(0)
    target = rng.integers(3, 300, 37).tolist()        # longer than the 32-token budget: chunked
    others = [rng.integers(3, 300, int(rng.integers(3, 60))).tolist() for _ in range(5)]
    stats = llm.stats
    for params in (SamplingParams(temperature=0, logprobs=0, max_tokens=20, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=7, logprobs=0, max_tokens=20, ignore_eos=True)):
        llm.engine.reset_prefix_cache()
        alone = _tokens_and_logprobs(llm, [target], params)
        hits = stats().scheduler.prefix_cache_hits
        cached = _tokens_and_logprobs(llm, [target], params)             # the prompt's blocks from the cache
        assert stats().scheduler.prefix_cache_hits > hits
        crowded = _tokens_and_logprobs(llm, [target] + others, params)
        for tokens, logprobs in (cached, crowded):
            assert tokens == alone[0]
            assert np.array_equal(logprobs, alone[1]), np.abs(logprobs - alone[1]).max()
    # long neighbours crowd the arena: a request is preempted and recomputed
    long_ones = [rng.integers(3, 300, 60).tolist() for _ in range(3)]
    before = stats().scheduler.num_preemptions
    crowded = _tokens_and_logprobs(llm, [target] + long_ones,
                                   SamplingParams(temperature=0, logprobs=0, max_tokens=50, ignore_eos=True))
    assert stats().scheduler.num_preemptions > before, "the arena was expected to preempt a request"
    greedy = _tokens_and_logprobs(llm, [target], SamplingParams(temperature=0, logprobs=0, max_tokens=50,
                                                                ignore_eos=True))
    assert crowded[0] == greedy[0] and np.array_equal(crowded[1], greedy[1])
    check_invariants(llm.engine.scheduler)        # the preempted request's blocks all came back

    # the trainer's replay: the same kernels, compiled as the engine compiles its steps
    ids = jnp.asarray(target + greedy[0], jnp.int32)
    replay = jax.jit(lambda p, ids: reference_logprobs(llm, p, ids)).lower(llm.engine.runner.params, ids)
    got = np.asarray(replay.compile(llm.engine.runner.compiler_options)(llm.engine.runner.params, ids))
    assert np.array_equal(got[len(target) - 1:], greedy[1]), np.abs(got[len(target) - 1:] - greedy[1]).max()


@pytest.mark.parametrize("setting", [dict(quantization="int8"), dict(kv_cache_dtype="fp8_e4m3"),
                                     dict(tensor_parallel_size=2),
                                     dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2})])
def test_what_the_mode_does_not_cover_is_refused(setting):
    with pytest.raises(ValueError, match="batch_invariant"):
        engine_config(batch_invariant=True, **setting)


def test_a_mixture_of_experts_model_is_refused(tmp_path):
    from jaxserve.testing.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "moe", "qwen3_moe")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(path, **INVARIANT_ENGINE)


def test_the_rollout_benchmark_reads_a_zero_replay_gap_in_the_mode(llm):
    from jaxserve.bench.cmd_rollout import replay_gap

    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 300, 11).tolist(), rng.integers(3, 300, 23).tolist()]
    assert replay_gap(llm, prompts, n=3, output_len=6) == 0.0


def test_gemma3_sliding_layers_are_bit_identical_too(tmp_path):
    # Gemma 3: sliding-window layers (window 8) beside global ones, unit-offset norms, GeGLU
    from jaxserve.testing.tiny_models import make_tiny_model

    gemma = LLM(make_tiny_model(tmp_path / "gemma3", "gemma3"), **INVARIANT_ENGINE)
    rng = np.random.default_rng(6)
    target = rng.integers(3, 300, 37).tolist()
    others = [rng.integers(3, 300, int(rng.integers(3, 60))).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0, logprobs=0, max_tokens=12, ignore_eos=True)
    alone = _tokens_and_logprobs(gemma, [target], params)
    crowded = _tokens_and_logprobs(gemma, [target] + others, params)
    assert crowded[0] == alone[0] and np.array_equal(crowded[1], alone[1])
    check_invariants(gemma.engine.scheduler)
    ids = jnp.asarray(target + alone[0], jnp.int32)
    runner = gemma.engine.runner
    replay = jax.jit(lambda p, ids: reference_logprobs(gemma, p, ids)).lower(runner.params, ids)
    got = np.asarray(replay.compile(runner.compiler_options)(runner.params, ids))[len(target) - 1:]
    assert np.array_equal(got, alone[1])


def test_an_invariant_replay_of_a_mixture_of_experts_config_is_refused(tmp_path):
    import json

    from jaxserve.models.config import ModelConfig
    from jaxserve.testing.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "moe", "qwen3_moe")
    with open(path + "/config.json") as f:
        config = ModelConfig.from_hf_config(json.load(f))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        reference_logprobs(config, {}, jnp.arange(4), batch_invariant=True)
