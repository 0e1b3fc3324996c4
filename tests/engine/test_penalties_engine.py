"""Penalties and logit bias end to end on the tiny model, with the one-step-ahead loop on and off:
each greedy token is the argmax of the model's own logprobs (returned unadjusted) after the
frequency and presence penalties of the outputs before it, the in-flight one included; logit bias
forces a token; n > 1 samples each count their own outputs; a request without adjustments keeps
its tokens beside one with them; preemption (recompute or swap) and seats reused by later requests
change no penalised token; nothing compiles after warm-up."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE

PROMPT = "The tide comes in"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **TINY_ENGINE)


@pytest.fixture(scope="module", params=[True, False], ids=["loop-on", "loop-off"])
def engines(llm, request):
    return llm if request.param else LLM.sharing_runner(llm, async_scheduling=False)


def check_against_the_logprobs(completion, frequency, presence):
    """Each token must be the best of the model's top 20 after the penalties of the tokens before it."""
    counts: dict[int, int] = {}
    for token, entry in zip(completion.token_ids, completion.logprobs):
        adjusted = {t: lp.logprob - frequency * counts.get(t, 0) - presence * (counts.get(t, 0) > 0)
                    for t, lp in entry.items()}
        best = max(adjusted, key=adjusted.get)
        # a token outside the top 20 has a lower logprob than all of them, and penalties only lower:
        # the best of these is the best of the vocabulary when it beats the 20th raw logprob
        assert adjusted[best] >= min(lp.logprob for lp in entry.values()) - 1e-6
        assert token == best, (token, best, adjusted[token], adjusted[best])
        counts[token] = counts.get(token, 0) + 1


@pytest.mark.parametrize("frequency, presence", [(1.0, 0.0), (0.0, 1.5), (0.6, 0.4)])
def test_greedy_tokens_follow_the_penalised_logprobs(engines, frequency, presence):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=20,
                            frequency_penalty=frequency, presence_penalty=presence)
    plain = engines.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    out = engines.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    check_against_the_logprobs(out, frequency, presence)
    assert out.token_ids != plain.token_ids      # the penalties did change something
    assert len(set(out.token_ids)) > len(set(plain.token_ids))


def test_each_sample_of_n_counts_its_own_outputs(engines):
    kw = dict(max_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=1.0)
    one = engines.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)[0].outputs[0].token_ids
    many = engines.generate(PROMPT, SamplingParams(n=3, **kw), use_tqdm=False)[0].outputs
    assert [c.token_ids for c in many] == [one] * 3


def test_logit_bias_forces_a_token_and_a_request_without_adjustments_is_undisturbed(engines):
    plain = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    alone = engines.generate(PROMPT, plain, use_tqdm=False)[0].outputs[0].token_ids
    forced = SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True, logit_bias={42: 100.0},
                            repetition_penalty=1.2)
    both = engines.generate([PROMPT, PROMPT], [plain, forced], use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone
    assert both[1].outputs[0].token_ids == [42] * 12
    assert engines.stats().steps.num_compilations_after_warmup == 0


PROMPTS = [PROMPT, "def add(a, b):", "A paged KV cache stores keys", "Unicode: café", "Numbers: 0 1 2 3 4 5",
           "The runner packs"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_seat_reuse_do_not_change_penalised_tokens(engines, mode):
    """The runner keeps each penalised request's tokens on its seat from the scheduler's deltas:
    a request preempted and resumed (a new seat, its history sent again), and requests taking the
    seats of those that ended (six requests, four seats), must sample what they do with room."""
    checked = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=20,
                             frequency_penalty=0.7, presence_penalty=0.4)
    params = [checked,
              SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.5),
              checked,
              SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True, presence_penalty=1.0,
                             logit_bias={7: 2.0})]
    roomy = engines.generate(PROMPTS, params, use_tqdm=False)
    # the pool holds about two of these requests at once; the watermark is off so they run into
    # each other and must be preempted
    cramped = LLM.sharing_runner(engines, usable_kv_blocks=30, enable_prefix_caching=False, preemption_mode=mode,
                                 kv_watermark=0.0)
    got = cramped.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in roomy]
    s = cramped.stats()
    assert s.scheduler.num_preemptions > 0                     # the test really exercised preemption
    assert (s.scheduler.num_preemptions_swap > 0) == (mode == "swap")
    for out in (got[0], got[4], roomy[0]):
        check_against_the_logprobs(out.outputs[0], 0.7, 0.4)


def test_a_bias_for_a_token_outside_the_vocabulary_is_refused_at_the_door(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    assert np.isfinite(llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids).all()
