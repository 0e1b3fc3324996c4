"""Speculative decoding in the scheduler: n-gram guesses, the planner's choice of k, verification
(accepted guesses appended, rejected ones' K/V recomputed), with the fake runner whose outputs
must equal the model run alone whatever was guessed."""

import pytest
from sched_testkit import (FakeRunner, assert_outputs_match_reference, check_invariants, drive, make_request,
                           short_memory_token)

from jaxserve.sched import Scheduler, SchedulerConfig
from jaxserve.sched.ngram_proposer import propose_ngram
from jaxserve.sched.request import Request
from jaxserve.sched.speculation import DraftPlanner, SpeculativeConfig, expected_tokens


# ---- the n-gram proposer --------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_match():
    #        0  1  2  3  4  5  6  7  8  9
    seq = [5, 6, 7, 8, 5, 6, 9, 1, 5, 6]
    # last 2 tokens (5, 6) occur at 0 and 4; the latest is at 4, followed by 9, 1, 5, 6
    assert propose_ngram(seq, k=3, min_n=1, max_n=2) == [9, 1, 5]
    assert propose_ngram(seq, k=10, min_n=1, max_n=2) == [9, 1, 5, 6]


def test_ngram_prefers_the_longest_suffix_that_matches():
    seq = [1, 2, 3, 7, 2, 3, 8, 9, 1, 2, 3]
    # (1, 2, 3) matches at 0 -> 7; the shorter (2, 3) matches later, at 4 -> 8
    assert propose_ngram(seq, k=1, min_n=1, max_n=3) == [7]
    assert propose_ngram(seq, k=1, min_n=1, max_n=2) == [8]


def test_ngram_without_a_match_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4], k=4, min_n=1, max_n=4) == []
    assert propose_ngram([1, 2, 3, 4, 9, 2, 3], k=4, min_n=3, max_n=4) == []
    assert propose_ngram([7], k=4) == []


# ---- the planner ----------------------------------------------------------------------------
def _req(accepted=0.0, trials=0.0):
    r = Request("r", [1, 2], 8)
    r.spec_accepted, r.spec_trials = accepted, trials
    return r


def test_expected_tokens_counts_guesses_surviving_in_turn():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_free_rows_take_every_guess_and_costly_rows_none():
    spec = SpeculativeConfig(num_speculative_tokens=4)
    good = [(_req(9, 10), [1, 2, 3, 4])]
    assert DraftPlanner(spec, max_rows=8).plan(good) == 4
    # a row costs as much as the whole step (every row doubles the time): no guess pays
    assert DraftPlanner(spec, 8, step_seconds=lambda rows: float(rows)).plan(good) == 0


def test_the_planner_turns_speculation_off_for_a_large_batch():
    spec = SpeculativeConfig(num_speculative_tokens=4)
    cost = lambda rows: 0.04 + 0.002 * rows     # the embedded model on our CPU: 40 ms a step, 2 ms a row
    batch = lambda b: [(_req(6, 10), [1, 2, 3, 4]) for _ in range(b)]
    planner = DraftPlanner(spec, max_rows=256, step_seconds=cost)
    assert planner.plan(batch(1)) > 0
    assert planner.plan(batch(64)) == 0


def test_rejected_guesses_lower_the_acceptance_and_with_it_k():
    spec = SpeculativeConfig(num_speculative_tokens=4)
    cost = lambda rows: 0.04 + 0.004 * rows
    planner = DraftPlanner(spec, max_rows=64, step_seconds=cost)
    assert planner.plan([(_req(9, 10), [1, 2, 3, 4])]) == 4
    assert planner.plan([(_req(0, 20), [1, 2, 3, 4])]) == 0


def test_guesses_never_exceed_the_largest_decode_bucket():
    spec = SpeculativeConfig(num_speculative_tokens=4)
    planner = DraftPlanner(spec, max_rows=6)
    assert planner.plan([(_req(9, 10), [1, 2, 3, 4]) for _ in range(3)]) == 1   # 3 + 3 rows


def test_bad_speculative_configs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.parse({"method": "medusa"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 0}')
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.parse({"method": "ngram", "k": 3})
    with pytest.raises(ValueError, match="JSON"):
        SpeculativeConfig.parse("{method: ngram")
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens == 3


# ---- verification through the scheduler ------------------------------------------------------
def _config(**kw):
    base = dict(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96,
                max_decode_rows=16,
                speculation=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3))
    base.update(kw)
    return SchedulerConfig(**base)


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "one-step-ahead"])
def test_repetitive_outputs_are_guessed_and_every_output_equals_the_model_alone(one_step_ahead):
    sched = Scheduler(_config())
    reqs = [make_request(f"r{i}", 6, 60, ignore_eos=True, seed=i) for i in range(4)]
    steps = []
    drive(sched, reqs, runner=FakeRunner(64, 4, short_memory_token), speculate=True,
          one_step_ahead=one_step_ahead, on_step=lambda i, out: steps.append(out))
    assert_outputs_match_reference(reqs, 96, short_memory_token)
    assert sched.stats().spec_num_verifications > 0
    assert sched.stats().spec_num_accepted_tokens > sched.stats().spec_num_draft_tokens / 2   # the outputs cycle
    # fewer steps than tokens: a verification yields several
    decode_steps = sum(1 for out in steps if out.requests)
    assert decode_steps < sum(len(r.output_token_ids) for r in reqs) / 4


@pytest.mark.parametrize("probe_every", [4, 10 ** 6], ids=["probed", "never-probed"])
def test_a_request_judged_unrepetitive_speculates_again_once_its_text_repeats(monkeypatch, probe_every):
    """Its acceptance rate starts low (as if its text had not repeated so far), so the planner gives
    it no guesses; the lookups checked against its next tokens every few tokens raise the rate once
    its outputs cycle, and guesses come back."""
    from jaxserve.sched import speculative_scheduling

    monkeypatch.setattr(speculative_scheduling, "PROBE_EVERY", probe_every)
    # a step costs 40 ms plus 4 ms a row: guesses pay only at a good acceptance rate
    sched = Scheduler(_config(max_num_seqs=1, decode_step_seconds=tuple((r, 0.04 + 0.004 * r) for r in (1, 16))))
    req = make_request("r", 6, 80, ignore_eos=True, seed=3)
    req.spec_trials = 20.0                                        # 20 wrong guesses so far
    drive(sched, [req], runner=FakeRunner(64, 4, short_memory_token), speculate=True)
    assert_outputs_match_reference([req], 96, short_memory_token)
    assert (sched.stats().spec_num_verifications > 0) == (probe_every == 4)


def test_a_rejected_guess_rewinds_the_computed_tokens_and_its_kv_is_written_again():
    sched = Scheduler(_config(max_num_seqs=1))
    req = make_request("r", [3, 4, 3, 4, 3, 4, 3], 12, ignore_eos=True)
    runner = FakeRunner(64, 4)   # the hash model: n-gram guesses (from the repeated prompt) are wrong
    drive(sched, [req], runner=runner, speculate=True)
    assert_outputs_match_reference([req], 96)
    assert sched.stats().spec_num_draft_tokens > 0 and sched.stats().spec_num_accepted_tokens < sched.stats().spec_num_draft_tokens


def test_guesses_stop_at_max_tokens_and_at_eos_within_a_verification():
    sched = Scheduler(_config())
    # max_tokens cuts a cycle short; EOS (2) may come mid-verification and ends it there
    reqs = [make_request(f"m{i}", 5, 7 + i, ignore_eos=True, seed=i) for i in range(3)]
    reqs += [make_request(f"e{i}", 5, 40, seed=10 + i) for i in range(3)]
    drive(sched, reqs, runner=FakeRunner(64, 4, short_memory_token), speculate=True)
    assert_outputs_match_reference(reqs, 96, short_memory_token)
    for r in reqs:
        assert len(r.output_token_ids) <= r.max_tokens


def test_speculation_under_block_pressure_preempts_no_one_for_a_guess_and_outputs_hold():
    for mode, host in (("recompute", 0), ("swap", 32)):
        sched = Scheduler(_config(num_blocks=24, preemption_mode=mode, num_host_blocks=host))
        reqs = [make_request(f"r{i}", 8, 40, ignore_eos=True, seed=i) for i in range(4)]
        drive(sched, reqs, runner=FakeRunner(24, 4, short_memory_token), speculate=True)
        assert_outputs_match_reference(reqs, 96, short_memory_token)
        assert sched.stats().spec_num_accepted_tokens > 0


def test_aborts_mid_speculation_free_every_block():
    sched = Scheduler(_config())
    reqs = [make_request(f"r{i}", 6, 60, ignore_eos=True, seed=i) for i in range(4)]

    def abort(step):
        if step in (5, 9):
            sched.abort_requests([f"r{step % 4}"])
        check_invariants(sched)

    drive(sched, reqs, runner=FakeRunner(64, 4, short_memory_token), speculate=True, on_update=abort)
    assert_outputs_match_reference(reqs, 96, short_memory_token)
    assert {r.finish_reason for r in reqs} == {"abort", "length"}


def test_no_step_with_a_prompt_in_it_carries_guesses():
    sched = Scheduler(_config(max_num_batched_tokens=8))
    arrivals = {0: [make_request("a", 6, 40, ignore_eos=True)], 6: [make_request("b", 30, 10, ignore_eos=True)]}

    def check(step, out):
        if any(r.num_draft_tokens for r in out.requests):
            assert all(r.decode_rows for r in out.requests), "a step with guesses carried a prompt chunk"

    drive(sched, arrivals=arrivals, runner=FakeRunner(64, 4, short_memory_token), speculate=True, on_step=check)
    assert sched.stats().spec_num_verifications > 0


def test_requests_with_logit_adjustments_never_get_guesses():
    from jaxserve.runner.logit_adjustments import AdjustedSamplingOptions, LogitAdjustments
    sched = Scheduler(_config())
    req = make_request("r", 6, 30, ignore_eos=True,
                       sampling=AdjustedSamplingOptions(adjust=LogitAdjustments(presence_penalty=0.5)))
    drive(sched, [req], runner=FakeRunner(64, 4, short_memory_token), speculate=True)
    assert sched.stats().spec_num_verifications == 0


# ---- a draft model's guesses ------------------------------------------------------------------
@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "one-step-ahead"])
def test_draft_model_guesses_are_asked_for_once_their_blocks_exist_and_outputs_hold(one_step_ahead):
    """A stand-in draft model: the fake model's own continuation, every third guess wrong."""
    calls = []

    def propose(batch):
        calls.append(len(batch))
        out = {}
        for req, k in batch:
            # the draft writes its K/V at the guesses' positions: the blocks must be there
            assert len(req.block_ids) * 4 >= req.num_computed_tokens + 1 + k
            tokens, guesses = req.all_token_ids, []
            for j in range(k):
                t = short_memory_token(tokens)
                t = t if (len(tokens) + j) % 3 else (t + 1) % 12 + 2
                guesses.append(t)
                tokens = tokens + [t]
            out[req.request_id] = guesses
        return out

    spec = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=3)
    sched = Scheduler(_config(speculation=spec, num_blocks=40), draft_proposer=propose)
    reqs = [make_request(f"r{i}", 6, 40, ignore_eos=True, seed=i) for i in range(4)]
    drive(sched, reqs, runner=FakeRunner(40, 4, short_memory_token), speculate=True, one_step_ahead=one_step_ahead)
    assert_outputs_match_reference(reqs, 96, short_memory_token)
    assert calls and 0 < sched.stats().spec_num_accepted_tokens < sched.stats().spec_num_draft_tokens


def test_a_draft_model_config_needs_a_model_and_a_proposer():
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="draft_proposer"):
        Scheduler(_config(speculation=SpeculativeConfig(method="draft_model", model="m")))
