"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers on a tiny random Llama:
whole prompts and prompts chunked over several steps, past a prefix-cache hit, with n = 2, in a
batch with requests that do not ask, and nothing compiled after warm-up. The row layout the
runner reads them from is checked against runner/batch.py's packing."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.input_processor import InputProcessor
from tests.packing_oracle import pack_step
from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.prompt_logprobs import pack
from jaxserve.sched.limits import RequestLimits
from jaxserve.sched.sampling import SamplingOptions
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from jaxserve.testing.tiny_models import hf_logprobs

PROMPTS = [
    "The tide comes in",
    "def add(a, b):",
    # 40+ tokens: more than one step's 32-token budget, so it is chunked even at the default
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026 and a long tail of words to make it chunked twice over",
]
K = 5
TOL = 1e-4          # float32 against HF's float32 forward
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def asking(**kw):
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=K, **kw)


def assert_matches_hf(path, out, k=K):
    ids = out.prompt_token_ids
    ref = hf_logprobs(path, ids)
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(ids) and pl[0] is None
    for pos in range(1, len(ids)):
        entry, want = pl[pos], ref[pos - 1]
        tok = ids[pos]
        assert entry[tok].logprob == pytest.approx(want[tok], abs=TOL), (pos, tok)
        # the rank: 1 + the tokens more likely (near-ties within the tolerance may go either way)
        assert 1 + np.sum(want > want[tok] + TOL) <= entry[tok].rank <= 1 + np.sum(want > want[tok] - TOL)
        top = {lp.rank: (tid, lp.logprob) for tid, lp in entry.items() if lp.rank <= k}
        assert sorted(top) == list(range(1, k + 1))       # the top k, each with its rank
        for tid, lp in top.values():
            assert lp == pytest.approx(want[tid], abs=TOL)
        assert [top[r][1] for r in range(1, k + 1)] == pytest.approx(sorted(want, reverse=True)[:k], abs=TOL)
        assert len(entry) == k + (entry[tok].rank > k)    # and the prompt token, when not among them


def test_prompt_logprobs_match_hf_in_a_batch_with_requests_that_do_not_ask(prompt_logprobs_llm, tiny_llama_dir):
    llm = prompt_logprobs_llm
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # asking and not asking interleaved in one batch (4 seats: they run together)
    params = [asking(), GREEDY, asking(logprobs=2)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outs[1].prompt_logprobs is None
    for out in (outs[0], outs[2]):
        assert_matches_hf(tiny_llama_dir, out)
    assert [o.outputs[0].token_ids for o in outs] == alone    # asking changes no token
    assert outs[2].outputs[0].logprobs is not None and len(outs[2].outputs[0].logprobs) == 4
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_chunked_prefill_gives_the_same_prompt_logprobs(prompt_logprobs_llm, tiny_llama_dir):
    chunky = LLM.sharing_runner(prompt_logprobs_llm, long_prefill_token_threshold=5)
    out = chunky.generate(PROMPTS[2:], asking(), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 3 * 5            # really several chunks
    assert_matches_hf(tiny_llama_dir, out)
    # k = 0: the prompt token alone, with its rank
    zero = chunky.generate(PROMPTS[:1], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert all(len(e) == 1 for e in zero.prompt_logprobs[1:])
    assert chunky.stats().steps.num_compilations_after_warmup == 0


def test_a_cached_prefix_is_computed_again_for_a_request_that_asks(prompt_logprobs_llm, tiny_llama_dir):
    llm = LLM.sharing_runner(prompt_logprobs_llm, enable_prefix_caching=True)
    first = llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False)[0]
    hit = llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and hit.num_cached_tokens > 0   # the prefix is cached
    out = llm.generate(PROMPTS[2:], asking(), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0                                   # ...but not read by this one
    assert_matches_hf(tiny_llama_dir, out)
    assert out.outputs[0].token_ids == hit.outputs[0].token_ids


def test_n_samples_share_one_set_of_prompt_logprobs(prompt_logprobs_llm, tiny_llama_dir):
    sp = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True, prompt_logprobs=K)
    out = prompt_logprobs_llm.generate(PROMPTS[1:2], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert_matches_hf(tiny_llama_dir, out)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_prompt_preempted_midway_still_has_all_its_prompt_logprobs(prompt_logprobs_llm, tiny_llama_dir, mode):
    # a background prompt in 8-token chunks, evicted by an urgent one that needs the blocks
    # before its prompt is in (recompute computes it again from the start; swap brings it back)
    engine = LLM.sharing_runner(prompt_logprobs_llm, usable_kv_blocks=26, enable_prefix_caching=False,
                                preemption_mode=mode, kv_watermark=0.0, long_prefill_token_threshold=8,
                                scheduling_policy="priority", max_num_partial_prefills=0).engine
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    engine.add_request("background", PROMPTS[2], sp, priority=1)
    engine.step()
    engine.add_request("urgent", PROMPTS[2], sp, priority=0)
    done, evicted_before_its_first_token = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        bg = engine.scheduler.get_request("background")
        evicted_before_its_first_token |= (bg is not None and bg.status.is_waiting and bg.num_preemptions > 0
                                           and not bg.output_token_ids)
    assert evicted_before_its_first_token and sorted(done) == ["background", "urgent"]
    for out in done.values():
        assert_matches_hf(tiny_llama_dir, out)
    assert engine.stats().steps.num_compilations_after_warmup == 0


def test_a_one_token_prompt_has_just_none():
    # no engine needed: the state is complete from the start
    from jaxserve.engine.request_state import RequestState
    from jaxserve.outputs import RequestMetrics

    state = RequestState("r", None, [7], SamplingParams(prompt_logprobs=2), RequestMetrics(0.0), [])
    assert state.prompt_logprobs == [None] and state.prompt_logprobs_missing == 0


def test_prompt_logprobs_are_refused_where_the_engine_does_not_compute_them():
    door = InputProcessor(tokenizer=None, vocab_size=100, limits=RequestLimits(max_model_len=64, block_size=4,
                                                                              num_pool_blocks=64),
                          eos_token_ids=frozenset())
    with pytest.raises(ValueError, match="enable_prompt_logprobs"):
        door.process({"prompt_token_ids": [1, 2, 3]}, SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def _req(rid, tokens, computed, *, prompt=None, k=None, sample=False, drafts=0):
    opts = SamplingOptions(num_prompt_logprobs=k, prompt_token_ids=tuple(prompt or ()))
    blocks = tuple(range(1, 21))
    return ScheduledRequest(rid, tuple(tokens), computed, blocks, sample, 0, opts, num_draft_tokens=drafts)


def test_prompt_rows_are_the_rows_batch_packing_gives_those_positions():
    shapes = RunnerShapes(block_size=4, max_model_len=128, prefill_tile=8, decode_buckets=(4, 8),
                          prefill_buckets=(0, 1, 2, 4, 8), decode_only_buckets=(1, 4))
    prompt = list(range(100, 130))                      # 30 prompt tokens
    reqs = [
        _req("decode", [PLACEHOLDER_TOKEN], 40, sample=True),
        _req("verify", [5, 6, 7], 20, sample=True, drafts=2),
        _req("one", prompt[9:10], 9, prompt=prompt, k=1),            # a one-token chunk: a decode row
        _req("mid", prompt[:11], 0, prompt=prompt, k=3),             # the first chunk of a prompt
        _req("quiet", list(range(50, 70)), 0),                       # a prompt that does not ask
        _req("last", prompt[20:], 20, prompt=prompt, k=0, sample=True),  # the last chunk: 9 positions
    ]
    out = SchedulerOutput(tuple(reqs), sum(len(r.token_ids) for r in reqs))
    packed = pack_step(out, shapes, {"decode": 0})
    rows = pack(out, packed.bucket, shapes.prefill_tile)
    got = {rid: (first, count) for rid, first, _, count in rows.reads}
    assert got == {"one": (10, 1), "mid": (1, 11), "last": (21, 9)}
    for rid, first, row, count in rows.reads:
        for j in range(count):
            # the row computes position first + j - 1, holding its token; its target is the next one
            assert packed.arrays["positions"][row + j] == first + j - 1
            assert packed.arrays["input_ids"][row + j] == prompt[first + j - 1]
            assert rows.targets[row + j] == prompt[first + j]
    assert (rows.targets >= 0).sum() == 21
    quiet = SchedulerOutput((reqs[4],), 20)
    assert pack(quiet, pack_step(quiet, shapes).bucket, 8) is None    # the usual step: nothing to do
