"""The engine end to end on a tiny random Llama: parity with HF transformers, invariance of the
outputs under batching, chunking and preemption, stop conditions, and clear errors at the door."""

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.testing.tiny_models import hf_greedy

from tests.conftest import TINY_ENGINE

PROMPTS = [
    "The tide comes in",
    "def add(a, b):",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026 and a long tail of words to make it chunked",
    "Unicode: café",
    "A paged KV cache stores keys",
]
# min_tokens bans EOS as HF's min_new_tokens does, so both sides generate exactly 24 tokens
GREEDY_24 = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **TINY_ENGINE)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leaks(llm):
    s = llm.stats()
    assert s.scheduler.num_running == 0 and s.scheduler.num_waiting == 0
    assert s.scheduler.num_kv_blocks_free + s.scheduler.num_kv_blocks_cached == s.scheduler.num_kv_blocks_total


def test_greedy_outputs_match_hf_transformers_token_for_token(llm, tiny_llama_dir):
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, GREEDY_24, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, tok.encode(prompt), 24), prompt
        assert out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_outputs_do_not_depend_on_the_batch(llm):
    together = token_ids(llm.generate(PROMPTS, GREEDY_24, use_tqdm=False))
    alone = [token_ids(llm.generate([p], GREEDY_24, use_tqdm=False))[0] for p in PROMPTS]
    assert together == alone
    assert_no_leaks(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    first = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    alone = [token_ids(llm.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(PROMPTS, params)]
    assert first == alone
    other_seed = token_ids(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0.9, seed=7,
                                                                  ignore_eos=True), use_tqdm=False))
    assert other_seed[0] != first[0]
    assert_no_leaks(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_preemption_does_not_change_greedy_or_seeded_tokens(llm, mode):
    seeded = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    params = [greedy, seeded] * 2
    want = token_ids(llm.generate(PROMPTS[:4], params, use_tqdm=False))
    # the pool can hold about two of these requests at once; the watermark and projected-use
    # admission are off so requests run into each other and must be preempted
    cramped = LLM.sharing_runner(llm, usable_kv_blocks=30, enable_prefix_caching=False, preemption_mode=mode,
                                 kv_watermark=0.0)
    got = token_ids(cramped.generate(PROMPTS[:4], params, use_tqdm=False))
    assert got == want
    s = cramped.stats()
    assert s.scheduler.num_preemptions > 0          # the test really exercised preemption
    if mode == "recompute":
        assert s.scheduler.num_preemptions_swap == 0
    if mode == "swap":
        assert s.scheduler.num_preemptions_swap > 0 and s.scheduler.num_swapped_blocks > 0 and s.scheduler.num_preemptions_recompute == 0
    assert s.scheduler.num_preemptions_recompute + s.scheduler.num_preemptions_swap == s.scheduler.num_preemptions
    assert_no_leaks(cramped)


def test_chunking_does_not_change_greedy_tokens(llm):
    whole = token_ids(llm.generate(PROMPTS[2:3], GREEDY_24, use_tqdm=False))
    chunky = LLM.sharing_runner(llm, long_prefill_token_threshold=5, enable_prefix_caching=False)
    assert token_ids(chunky.generate(PROMPTS[2:3], GREEDY_24, use_tqdm=False)) == whole
    assert_no_leaks(chunky)


def test_top_k_one_is_greedy_and_logprobs_are_reported(llm):
    greedy = token_ids(llm.generate(PROMPTS[:2], GREEDY_24, use_tqdm=False))
    sp = SamplingParams(max_tokens=24, temperature=0.7, top_k=1, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    assert token_ids(outs) == greedy
    for out in outs:
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids)
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and entry[tok].logprob <= 0.0
            assert len(entry) >= 3
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_stop_token_ids_and_stop_strings_end_a_request(llm):
    out = llm.generate(PROMPTS[:1], GREEDY_24, use_tqdm=False)[0].outputs[0]
    stop_id = out.token_ids[5]
    first = out.token_ids.index(stop_id)
    by_id = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id]),
                         use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == out.token_ids[:first + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id

    stop_text = out.text[len(out.text) // 2:][:3]
    if stop_text.strip():
        by_str = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0, stop=[stop_text]),
                              use_tqdm=False)[0].outputs[0]
        assert by_str.finish_reason == "stop" and by_str.stop_reason == stop_text
        assert stop_text not in by_str.text and out.text.startswith(by_str.text)
    assert_no_leaks(llm)


@pytest.mark.parametrize("kind", ["delta", "cumulative", "final_only"])
def test_generate_returns_the_whole_output_whatever_the_output_kind(llm, kind):
    # generate keeps each request's finished output (it runs them final-only): DELTA params once
    # returned only the last step's token
    whole = llm.generate(PROMPTS[:2], GREEDY_24, use_tqdm=False)
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, output_kind=kind)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs] == [
        (o.outputs[0].token_ids, o.outputs[0].text) for o in whole]
    assert all(len(o.outputs[0].token_ids) == 24 and o.finished for o in outs)
    assert params.output_kind.value == kind        # the caller's params are not changed
    assert_no_leaks(llm)


def test_metrics_have_one_time_per_token(llm):
    out = llm.generate(PROMPTS[:1], GREEDY_24, use_tqdm=False)[0]
    m = out.metrics
    assert len(m.token_times) == 24
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.token_times == sorted(m.token_times)


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(), "empty"),
    ({"prompt_token_ids": []}, SamplingParams(), "empty"),
    ({"prompt_token_ids": [1, 99999]}, SamplingParams(), "outside the vocabulary"),
    ("word " * 200, SamplingParams(), "max_model_len"),
    ("hello", SamplingParams(max_tokens=500), "max_model_len"),
    ({"prompt": "hi", "bogus": 1}, SamplingParams(), "unknown prompt field"),
])
def test_bad_input_gets_a_clear_error_and_the_engine_keeps_serving(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0], prompt], params, use_tqdm=False)
    assert_no_leaks(llm)
    assert len(llm.generate(PROMPTS[:1], GREEDY_24, use_tqdm=False)[0].outputs[0].token_ids) == 24


def test_a_request_that_could_never_fit_the_pool_is_rejected(llm):
    cramped = LLM.sharing_runner(llm, usable_kv_blocks=8)
    with pytest.raises(ValueError, match="KV blocks"):
        cramped.generate(PROMPTS[:1], SamplingParams(max_tokens=60), use_tqdm=False)
    assert_no_leaks(cramped)


def test_bad_sampling_values_and_unknown_arguments_are_value_errors(tiny_llama_dir):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(tiny_llama_dir, max_num_seqz=3)


def test_chat_applies_the_template(llm):
    conv = [{"role": "user", "content": "The tide"}]
    out = llm.chat(conv, GREEDY_24, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    want = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert out.prompt_token_ids == list(want)
    assert len(out.outputs[0].token_ids) == 24
