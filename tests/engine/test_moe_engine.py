"""Qwen3-MoE and Mixtral through the engine: greedy tokens equal HF transformers' on tiny random
models (8 experts, top 2; Qwen3-MoE with a dense last layer), with prefix-cache hits, chunked
prefill, preemption, n-gram speculation and the one-step-ahead loop in the workload, and nothing
compiled after warm-up: the engine is model-independent, so the MoE layer changes none of it.
The forward alone against HF, the expert layer, GGUF and quantized experts:
tests/models/test_moe_model.py."""

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.testing.tiny_models import hf_greedy, make_tiny_model
from tests.conftest import TINY_ENGINE
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


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_llm(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    return path, LLM(path, **TINY_ENGINE)


def tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_tokens_equal_hf_with_prefix_hits_chunking_and_preemption(moe_llm):
    path, llm = moe_llm
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    assert len(ids[2]) > TINY_ENGINE["max_num_batched_tokens"]           # chunked over several steps
    want = [hf_greedy(path, i, N) for i in ids]
    got = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert got == want
    hits = llm.stats().scheduler.prefix_cache_hits
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert llm.stats().scheduler.prefix_cache_hits > hits
    cramped = LLM.sharing_runner(llm, usable_kv_blocks=30, enable_prefix_caching=False,
                                 preemption_mode="recompute", kv_watermark=0.0)
    assert tokens(cramped.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert cramped.stats().scheduler.num_preemptions > 0
    check_invariants(cramped.engine.scheduler)
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_ngram_speculation_and_the_synchronous_loop_keep_the_greedy_tokens(moe_llm):
    path, llm = moe_llm
    prompts = PROMPTS + ["1 2 3 4 1 2 3 4 1 2 3"]       # its own tail repeats: n-gram lookup guesses
    plain = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    spec = LLM.sharing_runner(llm, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                       "adaptive": False})
    assert tokens(spec.generate(prompts, GREEDY, use_tqdm=False)) == plain
    assert spec.stats().scheduler.spec_num_draft_tokens > 0
    check_invariants(spec.engine.scheduler)
    sync = LLM.sharing_runner(llm, async_scheduling=False)
    assert tokens(sync.generate(prompts, GREEDY, use_tqdm=False)) == plain
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_tokens_per_expert_are_the_routers_choices_on_the_real_rows(moe_llm):
    """stats() counts each prompt token once per expert its router chose, in every MoE layer, and
    nothing for padding rows: equal to the top-k of HF's own router logits over the same prompt."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    path, llm = moe_llm
    llm.engine.reset_prefix_cache()             # a cached prefix would not run through the steps
    before = np.array(llm.engine.stats().experts.tokens_total or (0,) * 1)
    prompt = "the experts of a tiny model route every token"
    ids = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0].prompt_token_ids
    stats = llm.engine.stats()
    got = np.array(stats.experts.tokens_total) - (before if before.size == len(stats.experts.tokens_total) else 0)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        router = hf(torch.tensor([list(ids)]), output_router_logits=True).router_logits
    k = hf.config.num_experts_per_tok
    want = np.zeros(hf.config.num_local_experts if hasattr(hf.config, "num_local_experts") else hf.config.num_experts,
                    np.int64)
    for layer in router:            # [T, E] per MoE layer
        np.add.at(want, torch.topk(layer.reshape(len(ids), -1), k, dim=-1).indices.reshape(-1).numpy(), 1)
    assert got.tolist() == want.tolist()
    assert stats.experts.imbalance >= 1.0
    assert len(stats.experts.tokens_window) == len(want)
