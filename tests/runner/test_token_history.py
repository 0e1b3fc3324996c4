"""The tokens penalties count, from the scheduler to the sampler's arrays, with nothing but the
scheduler's deltas between them (ScheduledRequest.token_history). A cramped scheduler (preemption
by recompute and by swap, chunked prompts, more requests than seats so seats are reused, the
one-step-ahead loop on and off) runs penalised requests beside plain ones, and the runner's
persistent batch packs every step as the engine's runner would: each penalised row's known tokens
must be its request's prompt and exactly the outputs the host knows at that step, and its in-flight
index must point at the previous step's row exactly when its last output is still on the device."""

import pytest

from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.logit_adjustments import AdjustedSamplingOptions, LogitAdjustments
from jaxserve.runner.persistent_batch import PersistentBatch
from jaxserve.sched import Scheduler, SchedulerConfig
from tests.sched.sched_testkit import FakeRunner, assert_outputs_match_reference, drive, make_request

MAX_LEN = 48
SHAPES = RunnerShapes(block_size=4, max_model_len=MAX_LEN, prefill_tile=4, decode_buckets=(8,),
                      prefill_buckets=(0, 1, 2, 4, 8, 16))
PENALISED = AdjustedSamplingOptions(adjust=LogitAdjustments(frequency_penalty=0.5, repetition_penalty=1.1))
BIASED = AdjustedSamplingOptions(adjust=LogitAdjustments(logit_bias=((3, 1.0),)))   # reads no tokens


class PackingRunner(FakeRunner):
    """The fake model's runner, packing each step through a persistent batch first, and checking
    each penalised row's history against the scheduler's requests."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        super().__init__(cfg.num_blocks, cfg.block_size)
        self.batch = PersistentBatch(SHAPES, seats=2)
        self.prev_rows: dict[str, int] = {}
        self.rows_checked = 0
        self.restarts = 0
        self.deltas = 0

    def execute(self, out, sched, pending=None):
        if out.requests:
            packed = self.batch.pack(out, self.prev_rows)
            scheduled = {r.request_id: r for r in out.requests}
            for r in out.requests:
                if r.token_history is not None:
                    self.restarts += r.token_history.restarts
                    self.deltas += bool(r.token_history.new_output_token_ids) and not r.token_history.restarts
            a = packed.sampling
            for rid, row in packed.sample_rows:
                sr, req = scheduled[rid], sched.get_request(rid)
                if not sr.sampling.reads_tokens:
                    assert sr.token_history is None
                    continue
                want = req.prompt_token_ids + req.output_token_ids
                n = len(want)
                assert a["known_tokens"][row, :n].tolist() == want, rid
                assert (a["known_tokens"][row, n:] == -1).all(), rid
                assert a["prompt_len"][row] == req.num_prompt_tokens
                in_flight = req.num_pending_output_tokens - sr.sample   # sampled by the step before
                assert a["in_flight"][row] == (self.prev_rows[rid] if in_flight else -1), rid
                self.rows_checked += 1
            self.prev_rows = dict(packed.sample_rows)
        return super().execute(out, sched, pending)


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "one-step-ahead"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_penalised_rows_see_exactly_their_known_tokens_across_preemption_and_seat_reuse(mode, one_step_ahead):
    cfg = SchedulerConfig(num_blocks=13, block_size=4, max_model_len=MAX_LEN, max_num_batched_tokens=16,
                          max_num_seqs=4, admission_output_share=0.0, preemption_mode=mode,
                          num_host_blocks=32 if mode == "swap" else 0, enable_prefix_caching=False)
    sched = Scheduler(cfg)
    runner = PackingRunner(cfg)
    options = [PENALISED, None, PENALISED, BIASED]
    reqs = [make_request(f"r{i}", 5 + 2 * i, max_tokens=18, ignore_eos=True,
                         **({"sampling": options[i % 4]} if options[i % 4] else {})) for i in range(8)]
    drive(sched, reqs[:5], arrivals={6: reqs[5:]}, runner=runner, one_step_ahead=one_step_ahead)
    s = sched.stats()
    assert s.num_preemptions > 0                         # the test really exercised preemption
    assert (s.num_preemptions_swap > 0) == (mode == "swap")
    penalised = [r for r in reqs if r.sampling is PENALISED]
    assert runner.restarts > len(penalised)               # histories were sent again after preemptions
    assert runner.deltas > 0 and runner.rows_checked > 10 * len(penalised)
    assert_outputs_match_reference(reqs, MAX_LEN)

