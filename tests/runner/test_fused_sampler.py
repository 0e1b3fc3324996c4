"""One launch per step: each compiled step samples its logits rows itself (runner/step_programs.py;
an accelerator's default, --fuse-sampler on a CPU). The fused engine's outputs are the
two-launch engine's (--no-fuse-sampler): greedy and seeded
sampling, top-k/top-p, penalties, logit bias, grammar masks, logprobs, placeholders across steps
that sample nothing (a long prompt's chunks), and it loads no sampler program of its own."""

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.structured_outputs import StructuredOutputs
from tests.conftest import TINY_ENGINE


def _requests():
    long_prompt = {"prompt_token_ids": [3 + (i * 7) % 200 for i in range(70)]}   # chunks with no sampled row
    prompts = [{"prompt_token_ids": list(range(3, 3 + 4 * (i + 1)))} for i in range(4)] + [long_prompt]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=10, temperature=1.0, top_k=5, top_p=0.9, seed=8, ignore_eos=True,
                       presence_penalty=0.6, frequency_penalty=0.3, logit_bias={11: 5.0}),
        SamplingParams(max_tokens=6, temperature=0.0, structured_outputs=StructuredOutputs(choice=["yes", "no"])),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
    ]
    return prompts, params


def _run(llm):
    prompts, params = _requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [sorted((t, lp.logprob) for t, lp in step.items()) for step in (o.outputs[0].logprobs or [])])
            for o in outs]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    fused = LLM(tiny_llama_dir, **TINY_ENGINE, fuse_sampler=True)
    apart = LLM(tiny_llama_dir, **TINY_ENGINE, fuse_sampler=False)
    return fused, apart


def test_a_fused_step_samples_as_the_step_and_sampler_apart_do(engines):
    fused, apart = engines
    assert fused.engine.runner.step_programs.fused and not apart.engine.runner.step_programs.fused
    got, want = _run(fused), _run(apart)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        assert [[t for t, _ in step] for step in logprobs] == [[t for t, _ in step] for step in want_logprobs]
        for step, want_step in zip(logprobs, want_logprobs):
            assert [lp for _, lp in step] == pytest.approx([lp for _, lp in want_step], rel=1e-5, abs=1e-5)
    for llm in engines:
        assert llm.stats().steps.num_compilations_after_warmup == 0
        assert llm.engine.scheduler.kv.pool.num_in_use == 0


def test_a_fused_engine_loads_one_program_per_step(engines):
    fused, apart = engines
    # the two-launch engine loaded a sampler per logits-row count; the fused one none
    rows = set(fused.engine.runner.sampler.store)
    assert not any(fused.engine.runner.sampler.store.is_loaded(r) for r in rows)
    assert all(apart.engine.runner.sampler.store.is_loaded(r) for r in rows)
    assert fused.engine.runner.executables_loaded_on_demand() == []
