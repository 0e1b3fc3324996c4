"""Penalties and logit bias end to end on the tiny model, with the one-step-ahead loop on and off:
each greedy token is the argmax of the model's own logprobs (returned unadjusted) after the
frequency and presence penalties of the outputs before it, the in-flight one included; logit bias
forces a token; n > 1 samples each count their own outputs; a request without adjustments keeps
its tokens beside one with them; nothing compiles after warm-up."""

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
    assert engines.stats().num_compilations_after_warmup == 0


def test_a_bias_for_a_token_outside_the_vocabulary_is_refused_at_the_door(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    assert np.isfinite(llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids).all()
