"""Speculative decoding end to end on a tiny random Llama whose outputs often repeat (so n-gram
guesses are both accepted and rejected): greedy and seeded outputs identical to decoding without
speculation (and greedy to HF transformers), sampled outputs distributed as the target model's
(chi-square against the exact distribution), stop strings, logprobs, n > 1, preemption and aborts
mid-speculation, no compilation after warm-up, no leaked block."""

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from jaxserve import LLM, SamplingParams
from jaxserve.testing.tiny_models import _hf_model, hf_greedy, make_tiny_repeating_model

from tests.conftest import TINY_ENGINE

# adaptive=False: every guess found is verified (the adaptive planner's choices follow measured
# step times, which differ from machine to machine; tests/sched/test_speculation.py covers them)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False}
PROMPTS = [[5, 17, 33, 5, 17, 33, 9], [100, 7, 250, 3, 9, 41], [60, 61, 62, 60, 61, 62, 60, 61],
           [200, 201, 7, 200, 201, 8, 200, 201, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 200]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_repeating_model(tmp_path_factory.mktemp("tiny-repeating"))


@pytest.fixture(scope="module")
def spec_llm(model_dir):
    return LLM(model_dir, **TINY_ENGINE, speculative_config=SPEC)


@pytest.fixture(scope="module")
def plain_llm(spec_llm):
    return LLM.sharing_runner(spec_llm, speculative_config=None)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    # the target's weights with its attention and MLP scaled down further: a cruder model whose
    # greedy guesses agree with the target's tokens about 60% of the time
    return make_tiny_repeating_model(tmp_path_factory.mktemp("tiny-draft"), seed=0, residual_scale=0.2)


@pytest.fixture(scope="module")
def draft_llm(model_dir, draft_dir):
    return LLM(model_dir, **TINY_ENGINE, speculative_config={"method": "draft_model", "model": draft_dir,
                                                             "num_speculative_tokens": 3, "adaptive": False})


@pytest.fixture(params=["ngram", "draft_model"])
def speculating(request, spec_llm, draft_llm):
    return spec_llm if request.param == "ngram" else draft_llm


@pytest.fixture(scope="module")
def draft_k1_llm(draft_llm):
    """The same target and draft guessing one token at a time: other steps speculate."""
    return LLM.sharing_runner(draft_llm, speculative_config={"method": "draft_model", "model": "unused",
                                                             "num_speculative_tokens": 1, "adaptive": False})


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def spec_counts(llm):
    s = llm.stats()
    return s.scheduler.spec_num_verifications, s.scheduler.spec_num_draft_tokens, s.scheduler.spec_num_accepted_tokens


def assert_no_leaks(llm):
    s = llm.stats()
    assert s.scheduler.num_running == 0 and s.scheduler.num_waiting == 0
    assert s.scheduler.num_kv_blocks_free + s.scheduler.num_kv_blocks_cached == s.scheduler.num_kv_blocks_total
    assert s.steps.num_compilations_after_warmup == 0


def test_greedy_outputs_equal_decoding_without_speculation_and_hf(speculating, plain_llm, model_dir):
    spec_llm = speculating
    greedy = SamplingParams(max_tokens=40, min_tokens=40, temperature=0.0)
    before = spec_counts(spec_llm)
    got = ids(spec_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False))
    want = ids(plain_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False))
    assert got == want
    for p, out in zip(PROMPTS[:2], got):
        assert out == hf_greedy(model_dir, p, 40)
    verifications, drafted, accepted = (a - b for a, b in zip(spec_counts(spec_llm), before))
    assert verifications > 0 and 0 < accepted < drafted     # guesses were both kept and thrown away
    assert spec_counts(plain_llm) == (0, 0, 0)
    assert_no_leaks(spec_llm)


SEEDED = [SamplingParams(max_tokens=24, temperature=t, top_k=k, top_p=p, seed=10 + i, ignore_eos=True)
          for i, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8), (1.3, 3, 0.9)])]


def test_seeded_ngram_sampling_gives_the_same_tokens_with_and_without_speculation(spec_llm, plain_llm):
    # a verification row samples with the key of the output index it produces, as a one-token step would
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    before = spec_counts(spec_llm)
    assert ids(spec_llm.generate(prompts, SEEDED, use_tqdm=False)) == ids(plain_llm.generate(prompts, SEEDED,
                                                                                             use_tqdm=False))
    assert spec_counts(spec_llm)[2] > before[2]
    assert_no_leaks(spec_llm)


def test_seeded_draft_model_sampling_does_not_depend_on_which_steps_speculate(draft_llm, draft_k1_llm):
    """With a draft model every sampled token comes from the coupling with the draft's draw at the
    same output index, guessed or not: a seeded request's tokens are the same with 3 guesses per
    verification, with 1, and alone instead of in a batch."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    before = spec_counts(draft_llm)
    batched = ids(draft_llm.generate(prompts, SEEDED, use_tqdm=False))
    assert spec_counts(draft_llm)[2] > before[2]
    assert ids(draft_k1_llm.generate(prompts, SEEDED, use_tqdm=False)) == batched
    assert ids(draft_llm.generate(prompts[3:], SEEDED[3:], use_tqdm=False)) == batched[3:]
    assert_no_leaks(draft_llm)


def _filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The target distribution as SamplingParams define it: temperature, the top_k most likely,
    and the smallest prefix of the sorted distribution whose mass reaches top_p."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    before = np.cumsum(p[order]) - p[order]
    keep[order[:top_k]] = True
    keep[order[before >= top_p]] = False
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def test_sampled_outputs_follow_the_target_distribution(speculating, model_dir):
    """Chi-square of 3-token continuations (1,500 seeds) against their exact probabilities,
    computed from HF's logits on the same weights."""
    spec_llm = speculating
    # a prompt ending in the model's own repetitive continuation: guesses are often right, not always
    prompt = PROMPTS[0] + hf_greedy(model_dir, PROMPTS[0], 12)
    temperature, top_k, top_p, n = 4.0, 3, 0.95, 1500   # the model's logits are scaled 4x
    hf = _hf_model(model_dir)

    def next_probs(seq):
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, -1].double().numpy()
        return _filtered_probs(logits, temperature, top_k, top_p)

    exact = {}
    p0 = next_probs(prompt)
    for a in np.flatnonzero(p0):
        p1 = next_probs(prompt + [int(a)])
        for b in np.flatnonzero(p1):
            p2 = next_probs(prompt + [int(a), int(b)])
            for c in np.flatnonzero(p2):
                exact[(int(a), int(b), int(c))] = p0[a] * p1[b] * p2[c]
    before = spec_counts(spec_llm)
    params = [SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p, seed=s,
                             ignore_eos=True) for s in range(n)]
    # a few at a time, as many as the seats: a step that could admit a waiting prompt carries no guess
    seats = TINY_ENGINE["max_num_seqs"]
    outs = [o for i in range(0, n, seats)
            for o in ids(spec_llm.generate([{"prompt_token_ids": prompt}] * seats, params[i:i + seats],
                                           use_tqdm=False))]
    verifications, drafted, accepted = (a - b for a, b in zip(spec_counts(spec_llm), before))
    assert verifications > n / 2 and 0 < accepted < drafted   # most samples went through a verification
    counts: dict = {}
    for o in outs:
        assert tuple(o) in exact, f"{o} has probability 0 under the target"
        counts[tuple(o)] = counts.get(tuple(o), 0) + 1
    # cells expected at least 5 times, the rest pooled
    big = [c for c, p in exact.items() if p * n >= 5]
    observed = [counts.get(c, 0) for c in big]
    expected = [exact[c] * n for c in big]
    rest_p = 1.0 - sum(exact[c] for c in big)
    if rest_p * n >= 5:
        observed.append(n - sum(observed))
        expected.append(rest_p * n)
    else:
        expected = list(np.array(expected) * (n - (n - sum(observed))) / sum(expected))
        n_obs = sum(observed)
        expected = [e * n_obs / sum(expected) for e in expected]
    assert len(big) >= 3, "the test needs a spread distribution"
    _, p_value = scipy_stats.chisquare(observed, expected)
    assert p_value > 1e-3, f"sampled continuations do not follow the target distribution (p={p_value:.2g})"
    assert_no_leaks(spec_llm)


def test_stop_strings_logprobs_and_n_are_as_without_speculation(speculating, plain_llm, draft_k1_llm):
    spec_llm = speculating
    # a draft model's sampled tokens are the coupling's, the same however many guesses (the test above)
    sampled_like = draft_k1_llm if spec_llm.engine.draft_runner is not None else plain_llm
    tok = spec_llm.get_tokenizer()
    text = tok.decode(hf_greedy_ids := ids(plain_llm.generate([{"prompt_token_ids": PROMPTS[2]}],
                                                              SamplingParams(max_tokens=30, temperature=0.0,
                                                                             ignore_eos=True),
                                                              use_tqdm=False))[0])
    stop = text[len(text) // 2: len(text) // 2 + 2]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=20, temperature=0.8, seed=5, n=3, ignore_eos=True)]
    prompts = [{"prompt_token_ids": PROMPTS[2]}, {"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[3]}]
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    want = plain_llm.generate(prompts[:2], params[:2], use_tqdm=False) + sampled_like.generate(
        prompts[2:], params[2:], use_tqdm=False)
    assert hf_greedy_ids
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
    assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].stop_reason == stop
    for g_lp, w_lp in zip(got[1].outputs[0].logprobs, want[1].outputs[0].logprobs):
        assert g_lp.keys() == w_lp.keys()
        for t in g_lp:
            assert g_lp[t].logprob == pytest.approx(w_lp[t].logprob, abs=1e-4)
    assert_no_leaks(spec_llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_mid_speculation_changes_no_token(speculating, plain_llm, mode):
    spec_llm = speculating
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = ids(plain_llm.generate(prompts, greedy, use_tqdm=False))
    cramped = LLM.sharing_runner(spec_llm, usable_kv_blocks=40, enable_prefix_caching=False, preemption_mode=mode,
                                 kv_watermark=0.0)
    assert ids(cramped.generate(prompts, greedy, use_tqdm=False)) == want
    s = cramped.stats()
    assert s.scheduler.num_preemptions > 0 and s.scheduler.spec_num_verifications > 0
    assert_no_leaks(cramped)


def test_aborts_mid_speculation_leak_no_block(speculating):
    spec_llm = speculating
    engine = spec_llm.engine
    greedy = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(None, {"prompt_token_ids": p}, greedy) for p in PROMPTS]
    before = engine.scheduler.stats().spec_num_verifications
    steps = 0
    while engine.scheduler.stats().spec_num_verifications < before + 3:
        engine.step()
        steps += 1
        assert steps < 500
    engine.abort(rids[:2])
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(spec_llm)


def test_the_cli_flag_and_llm_kwarg_take_the_same_speculative_config():
    import argparse

    from jaxserve.engine_args import engine_config
    from jaxserve.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    from_cli = engine_config_from_args(args).speculative_config
    assert from_cli == engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).speculative_config
    assert from_cli.num_speculative_tokens == 3 and from_cli.adaptive
    with pytest.raises(SystemExit):   # argparse reports the bad value with the parser's usage
        parser.parse_args(["--speculative-config", '{"method": "draft_model"}'])
    with pytest.raises(ValueError, match="draft's checkpoint path"):
        engine_config(speculative_config={"method": "draft_model"})
    assert engine_config(speculative_config={"method": "draft_model", "model": "/x"}).speculative_config.model == "/x"


def test_a_draft_model_with_another_vocabulary_is_refused(spec_llm, tmp_path):
    from jaxserve.engine_args import engine_config
    from jaxserve.engine.draft_model import build_draft_runner
    from jaxserve.testing.tiny_models import make_tiny_model

    other = make_tiny_model(tmp_path / "other-vocab", vocab_size=256)
    config = engine_config(speculative_config={"method": "draft_model", "model": other})
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the target 320"):
        build_draft_runner(config, spec_llm.engine.runner, None, "float32")


def test_a_draft_model_engine_runs_every_step_without_lookahead(draft_llm):
    assert draft_llm.engine.draft_runner is not None and not draft_llm.engine.async_scheduling
    assert draft_llm.engine.draft_runner.arena_spec.num_blocks == draft_llm.engine.runner.arena_spec.num_blocks
