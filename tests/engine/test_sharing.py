"""Sharing KV blocks on the engine: prefix caching on/off parity, n parallel samples forked from one
prompt, beam search against HF transformers."""

import pytest

from jaxserve import LLM, BeamSearchParams, SamplingParams

from tests.conftest import TINY_ENGINE

SYSTEM = "A paged KV cache stores keys and values in fixed-size blocks. " * 2
QUESTIONS = ["The tide comes in", "def add(a, b):", "Numbers: 0 1 2 3"]
GREEDY = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **TINY_ENGINE)


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leaks(llm):
    s = llm.stats()
    assert s.scheduler.num_running == 0 and s.scheduler.num_waiting == 0
    assert s.scheduler.num_kv_blocks_free + s.scheduler.num_kv_blocks_cached == s.scheduler.num_kv_blocks_total


def test_prefix_cache_hits_do_not_change_greedy_outputs(llm):
    prompts = [SYSTEM + q for q in QUESTIONS]
    off = LLM.sharing_runner(llm, enable_prefix_caching=False)
    want = ids(off.generate(prompts, GREEDY, use_tqdm=False))
    on = LLM.sharing_runner(llm, enable_prefix_caching=True)
    first = on.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = on.generate(prompts, GREEDY, use_tqdm=False)
    assert ids(first) == want[:1]
    assert ids(rest) == want
    assert all(o.num_cached_tokens > 0 for o in rest)
    s = on.stats()
    assert s.scheduler.prefix_cache_hits > 0 and s.scheduler.num_kv_blocks_cached > 0
    assert_no_leaks(on)


def test_chunked_prefill_of_a_partly_cached_prompt_matches(llm):
    prompts = [SYSTEM + QUESTIONS[0], SYSTEM + QUESTIONS[1]]
    off = LLM.sharing_runner(llm, enable_prefix_caching=False)
    want = ids(off.generate(prompts, GREEDY, use_tqdm=False))
    on = LLM.sharing_runner(llm, enable_prefix_caching=True, long_prefill_token_threshold=8)
    on.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert ids(on.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert_no_leaks(on)


def test_cache_salts_never_share_blocks(llm):
    on = LLM.sharing_runner(llm, enable_prefix_caching=True)
    on.generate([{"prompt": SYSTEM, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)
    before = on.stats().scheduler.prefix_cache_hits
    out = on.generate([{"prompt": SYSTEM, "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and on.stats().scheduler.prefix_cache_hits == before
    again = on.generate([{"prompt": SYSTEM, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert_no_leaks(on)


def test_n_samples_share_the_prompt_and_are_reproducible(llm):
    on = LLM.sharing_runner(llm, enable_prefix_caching=False)
    sp = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    out = on.generate([SYSTEM], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = [c.token_ids for c in out.outputs]
    assert len(set(map(tuple, samples))) > 1                 # different seeds, different samples
    again = on.generate([SYSTEM], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == samples   # seeded: reproducible
    # sample i equals a single request seeded seed + i
    single = on.generate([SYSTEM], SamplingParams(max_tokens=10, temperature=1.0, seed=13, ignore_eos=True),
                         use_tqdm=False)[0]
    assert single.outputs[0].token_ids == samples[2]
    assert_no_leaks(on)


def test_n_samples_use_a_quarter_of_the_prompt_blocks(llm):
    # 80 prompt tokens = 20 blocks of 4; 12 outputs add at most 3 blocks (+1 copy-on-write) per sample
    prompt_blocks, out_blocks, n = 20, 3, 4
    prompt = {"prompt_token_ids": list(range(5, 5 + 4 * prompt_blocks))}
    on = LLM.sharing_runner(llm, enable_prefix_caching=False, kv_watermark=0.0)
    engine = on.engine
    engine.add_request("shared", prompt, SamplingParams(n=n, max_tokens=12, temperature=1.0, seed=1, ignore_eos=True))
    peak_shared = _peak_blocks(engine)
    for i in range(n):
        engine.add_request(f"own{i}", prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True))
    peak_own = _peak_blocks(engine)
    assert peak_own >= n * prompt_blocks                          # every request holds its own prompt
    assert peak_shared <= prompt_blocks + n * (out_blocks + 1)    # the prompt once
    assert peak_shared - n * (out_blocks + 1) <= peak_own / n     # a quarter of the prompt blocks, or less
    assert_no_leaks(on)


def _peak_blocks(engine):
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.stats()
        peak = max(peak, s.scheduler.num_kv_blocks_total - s.scheduler.num_kv_blocks_free - s.scheduler.num_kv_blocks_cached)
    return peak


def test_beam_search_matches_hf_transformers(llm, tiny_llama_dir):
    torch = pytest.importorskip("torch")
    from jaxserve.testing.tiny_models import _hf_model

    tok = llm.get_tokenizer()
    prompt = tok.encode(QUESTIONS[0])
    width, steps = 3, 8
    got = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(width, steps, ignore_eos=True))[0]
    model = _hf_model(tiny_llama_dir)
    x = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(x, attention_mask=torch.ones_like(x), num_beams=width, do_sample=False,
                             max_new_tokens=steps, min_new_tokens=steps, length_penalty=1.0, pad_token_id=0,
                             num_return_sequences=width, early_stopping=False)
    want = [r[len(prompt):].tolist() for r in ref]
    assert got.sequences[0].tokens == want[0]
    assert [s.tokens for s in got.sequences] == want
    assert_no_leaks(llm)
