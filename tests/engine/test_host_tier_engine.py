"""The prefix cache's host tier end to end on a tiny random Llama: system prompts that outgrow the
device pool come back from host memory, and outputs are those of a run that found nothing cached
(greedy and seeded, with the one-step-ahead loop); nothing compiles while serving."""

import pytest

from jaxserve import LLM, SamplingParams

from tests.conftest import TINY_ENGINE

# 40 usable device blocks of 4 tokens; six system prompts of 48 tokens take 72
ENGINE = dict(TINY_ENGINE, num_kv_blocks=41, kv_offload_gib=0.004)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **ENGINE)


def prompts(llm):
    tok = llm.get_tokenizer()
    systems = [tok.encode(f"System {i}: " + " ".join(f"rule{i}-{j}" for j in range(40)))[:48] for i in range(6)]
    return [s + tok.encode(f" question {r}")[:4] for r in range(2) for s in systems]


def generate(llm, ids, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ids], params,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_host_hits_give_the_outputs_of_a_cold_cache(llm, params):
    ids = prompts(llm)
    cold = []
    for p in ids:      # each prompt alone on an empty cache: nothing to hit
        assert llm.engine.reset_prefix_cache() is None
        cold += generate(llm, [p], params)
    llm.engine.reset_prefix_cache()
    before = llm.stats()
    warm = []
    for p in ids:      # one at a time: each system prompt comes back after the other five
        warm += generate(llm, [p], params)
    after = llm.stats()
    assert warm == cold
    host_hits = after.scheduler.prefix_cache_host_hits - before.scheduler.prefix_cache_host_hits
    assert host_hits >= 6 * 40            # the second round found (most of) its system prompts on the host
    assert after.kv.offload_bytes_loaded > before.kv.offload_bytes_loaded
    assert after.kv.offload_bytes_saved > before.kv.offload_bytes_saved
    assert after.steps.num_compilations_after_warmup == 0
    assert after.scheduler.num_running == after.scheduler.num_waiting == 0
    assert after.scheduler.num_kv_blocks_free + after.scheduler.num_kv_blocks_cached == after.scheduler.num_kv_blocks_total
    assert after.scheduler.num_host_blocks_in_use == 0 and 0 < after.scheduler.num_host_blocks_cached <= after.scheduler.num_host_blocks_total


def test_batched_host_hits_match_one_at_a_time(llm):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = prompts(llm)
    llm.engine.reset_prefix_cache()
    alone = [generate(llm, [p], params)[0] for p in ids]
    assert generate(llm, ids, params) == alone    # four at a time, loads and saves in the same steps


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_beside_the_host_tier_keeps_the_outputs(tiny_llama_dir, mode):
    """A pool too small for four requests at once: they preempt each other (by swap into the same
    host pool the tier lives in, or by recompute) while host hits load prefixes back."""
    llm = LLM(tiny_llama_dir, **dict(ENGINE, num_kv_blocks=33, preemption_mode=mode))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ids = prompts(llm)
    alone = []
    for p in ids:
        llm.engine.reset_prefix_cache()
        alone += generate(llm, [p], params)
    llm.engine.reset_prefix_cache()
    before = llm.stats()
    together = generate(llm, ids, params)
    after = llm.stats()
    assert together == alone
    assert after.scheduler.num_preemptions > before.scheduler.num_preemptions
    if mode == "swap":
        assert after.scheduler.num_preemptions_swap > before.scheduler.num_preemptions_swap
    assert after.scheduler.prefix_cache_host_hits > before.scheduler.prefix_cache_host_hits
    assert after.steps.num_compilations_after_warmup == 0
    assert after.scheduler.num_host_blocks_in_use == 0
    assert after.scheduler.num_kv_blocks_free + after.scheduler.num_kv_blocks_cached == after.scheduler.num_kv_blocks_total
