"""Gemma 2 and Gemma 3 (text) through the engine: greedy tokens equal HF transformers' on tiny random
models whose sliding windows (8 tokens) are shorter than the prompts, with prefix-cache hits,
chunked prefill and preemption in the workload, and nothing compiled after warm-up. The forward
alone against HF: tests/models/test_gemma_model.py; at tensor parallelism 2:
tests/parallel/test_tiny_models.py."""

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.quant.prepare import QuantRequest
from jaxserve.testing.tiny_models import hf_greedy, make_tiny_model
from tests.conftest import TINY_ENGINE
from tests.quant.test_engine_quantized import _direct_greedy
from tests.sched.sched_testkit import check_invariants

SYSTEM = "You are a careful assistant. Answer briefly and exactly. "
PROMPTS = [
    SYSTEM + "The tide comes in",
    SYSTEM + "def add(a, b):",                   # shares the first blocks with the one above
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026 and a long tail of words to make it chunked",
    "Unicode: café",
]
N = 32
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=5, num_layers=3)
    return path, LLM(path, **TINY_ENGINE)


def tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_tokens_equal_hf_with_prefix_hits_chunking_and_preemption(gemma):
    path, llm = gemma
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    assert len(ids[2]) > TINY_ENGINE["max_num_batched_tokens"]           # chunked over several steps
    assert min(len(i) for i in ids) + N > 8                              # past the sliding window
    want = [hf_greedy(path, i, N) for i in ids]
    got = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert got == want
    # again: the shared prefix and the earlier prompts' blocks now come from the prefix cache
    hits = llm.stats().scheduler.prefix_cache_hits
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert llm.stats().scheduler.prefix_cache_hits > hits
    # a pool too small for all of them at once: requests are preempted and recomputed
    cramped = LLM.sharing_runner(llm, usable_kv_blocks=30, enable_prefix_caching=False,
                                 preemption_mode="recompute", kv_watermark=0.0)
    assert tokens(cramped.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert cramped.stats().scheduler.num_preemptions > 0
    check_invariants(cramped.engine.scheduler)
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_ngram_speculation_keeps_the_greedy_tokens(gemma):
    path, llm = gemma
    spec = LLM.sharing_runner(llm, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                       "adaptive": False})
    plain = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert tokens(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
    assert spec.stats().scheduler.spec_num_draft_tokens > 0                       # guesses were verified
    check_invariants(spec.engine.scheduler)


@pytest.mark.slow
def test_int8_weights_give_the_quantized_models_own_greedy_tokens(gemma):
    path, llm = gemma
    quantized = LLM(path, **TINY_ENGINE, quantization="int8")
    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    got = tokens(quantized.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    want = _direct_greedy(path, QuantRequest("int8"), prompts)     # its first tokens, run without the engine
    assert [g[:len(w)] for g, w in zip(got, want)] == want
    assert quantized.stats().steps.num_compilations_after_warmup == 0
