"""The one-step-ahead loop (async_scheduling) on a tiny random Llama: outputs are identical with
the loop on and off (greedy, seeded sampling, logprobs, n > 1, stops, many requests, aborts in
between, preemption in each mode, beam search, prefix-cache hits), no request ever gets a token
past its limits, and the block accounting holds after every workload."""

import random

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.beam_search import BeamSearchParams

from tests.conftest import TINY_ENGINE

WORDS = "the tide comes in a paged cache stores keys and values numbers unicode café def add return".split()


@pytest.fixture(scope="module")
def on(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **TINY_ENGINE)
    assert llm.engine.async_scheduling
    return llm


def off(on, **kw):
    return LLM.sharing_runner(on, async_scheduling=False, **kw)


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30))) for _ in range(n)]


def mixed_params(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            out.append(SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0))
        elif kind == 1:
            out.append(SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=40, seed=i, ignore_eos=True))
        elif kind == 2:
            out.append(SamplingParams(max_tokens=12, temperature=0.0, logprobs=3))
        elif kind == 3:
            out.append(SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=1000 + i, logprobs=1))
        elif kind == 4:
            out.append(SamplingParams(max_tokens=30, temperature=0.0, stop=["e"], include_stop_str_in_output=True))
        else:
            out.append(SamplingParams(max_tokens=16, min_tokens=4, temperature=0.7, seed=i, stop_token_ids=[5, 9, 17]))
    return out


def summary(outs):
    """Everything a user sees of the outputs. Logprob values are rounded to 5 significant digits:
    a row's float logits depend in their last bits on the bucket (row count) of the step it ran
    in (XLA's matmul blocking), and the loop changes which steps a request shares (a request that
    ended may still hold a row in the step after), as any change of batch composition does; the
    tokens and ranks are compared exactly."""
    def lp(entries):
        return None if entries is None else [{t: (float(f"{v.logprob:.5g}"), v.rank) for t, v in e.items()}
                                             for e in entries]
    return [([(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, lp(c.logprobs),
                             None if c.cumulative_logprob is None else float(f"{c.cumulative_logprob:.5g}"))
                            for c in o.outputs], o.prompt_token_ids) for o in outs]


def assert_drained(llm):
    s = llm.stats()
    assert s.scheduler.num_running == 0 and s.scheduler.num_waiting == 0
    assert s.scheduler.num_kv_blocks_free + s.scheduler.num_kv_blocks_cached == s.scheduler.num_kv_blocks_total
    assert not llm.engine.has_unfinished_requests()


def test_many_mixed_requests_give_the_same_outputs_with_the_loop_on_and_off(on):
    ps, params = prompts(30), mixed_params(30)
    got = summary(on.generate(ps, params, use_tqdm=False))
    assert_drained(on)
    sync = off(on)
    want = summary(sync.generate(ps, params, use_tqdm=False))
    assert_drained(sync)
    assert got == want
    for (completions, _), p in zip(got, params):
        for c in completions:
            assert len(c[1]) <= p.max_tokens  # max_tokens is never exceeded
    assert on.stats().steps.num_compilations_after_warmup == 0


def drive_with_aborts(llm, ps, params, abort_at: dict[int, str]):
    """Add every request, step, and abort the named requests at the given step numbers."""
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(ps, params)):
        eng.add_request(f"r{i}", p, sp)
    finished, seen_after_abort, aborted = {}, [], set()
    step = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id in aborted:
                seen_after_abort.append(out.request_id)
            if out.finished:
                finished[out.request_id] = out
        if step in abort_at:
            eng.abort(abort_at[step])
            aborted.add(abort_at[step])
        step += 1
    assert not seen_after_abort, "an aborted request was streamed after its abort"
    return finished, aborted


@pytest.mark.parametrize("seed", [1, 2])
def test_random_aborts_between_steps_leave_every_other_output_unchanged(on, seed):
    rng = random.Random(seed)
    n = 16
    ps, params = prompts(n, seed), [SamplingParams(max_tokens=rng.randint(4, 30), temperature=rng.choice([0.0, 0.9]),
                                                   seed=rng.randint(0, 99), ignore_eos=True) for _ in range(n)]
    abort_at = {rng.randint(0, 40): f"r{rng.randrange(n)}" for _ in range(5)}
    got, aborted = drive_with_aborts(on, ps, params, abort_at)
    assert_drained(on)
    sync = off(on)
    want, _ = drive_with_aborts(sync, ps, params, abort_at)
    assert_drained(sync)
    for rid in set(got) | set(want):
        if rid not in aborted:
            assert summary([got[rid]]) == summary([want[rid]])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_the_loop_on_gives_the_outputs_of_the_loop_off(on, mode):
    ps = prompts(6, seed=3)
    params = [SamplingParams(max_tokens=40, temperature=t, seed=3, ignore_eos=True) for t in (0.0, 1.0) * 3]
    kw = dict(usable_kv_blocks=30, enable_prefix_caching=False, preemption_mode=mode, kv_watermark=0.0)
    cramped = LLM.sharing_runner(on, **kw)
    got = summary(cramped.generate(ps, params, use_tqdm=False))
    s = cramped.stats()
    assert s.scheduler.num_preemptions > 0 and (s.scheduler.num_preemptions_swap > 0) == (mode == "swap")
    assert_drained(cramped)
    want = summary(off(on, **kw).generate(ps, params, use_tqdm=False))
    assert got == want


def test_beam_search_and_prefix_hits_are_the_same_with_the_loop_on_and_off(on):
    beam = BeamSearchParams(beam_width=3, max_tokens=6)
    got = [[(s.tokens, round(s.cum_logprob, 4)) for s in r.sequences] for r in on.beam_search(["The tide comes"], beam)]
    sync = off(on)
    want = [[(s.tokens, round(s.cum_logprob, 4)) for s in r.sequences]
            for r in sync.beam_search(["The tide comes"], beam)]
    assert got == want
    shared = " ".join(WORDS) * 2
    ps = [shared + f" question {i}" for i in range(6)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    on.engine.reset_prefix_cache()
    got = summary(on.generate(ps, greedy, use_tqdm=False))
    assert on.stats().scheduler.prefix_cache_hits > 0
    sync = off(on)
    assert summary(sync.generate(ps, greedy, use_tqdm=False)) == got
    assert_drained(on)


def test_stats_show_host_time_and_device_idle_share_and_count_this_engines_compilations(on, tiny_llama_dir):
    on.generate(prompts(4), SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    s = on.stats()
    assert s.steps.host_ms_per_step > 0 and 0.0 <= s.steps.device_idle_fraction <= 1.0
    before = s.steps.num_compilations_after_warmup
    other = LLM(tiny_llama_dir, **{**TINY_ENGINE, "max_num_seqs": 2})  # compiles its own buckets
    assert other.stats().steps.num_compilations_after_warmup == 0
    assert on.stats().steps.num_compilations_after_warmup == before == 0
