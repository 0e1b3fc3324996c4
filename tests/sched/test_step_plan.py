"""StepPlan, the step one schedule() call builds: an entry advances its request as if the step
ran, and take_back (a request preempted later in the same call) restores the request, the budget
and the block copies exactly as they were before the entry. A request whose options read its
tokens gets its TokenHistory: everything on a first step, deltas while every step carries it,
everything again after a step without it (tests/runner/test_token_history.py runs the runner's
side of it)."""

from __future__ import annotations

import dataclasses
import random
from typing import ClassVar

from jaxserve.sched.sampling import SamplingOptions
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN
from jaxserve.sched.step_plan import StepPlan, padded_tokens

from tests.sched.sched_testkit import make_request


def _state(req):
    return (req.num_computed_tokens, req.num_pending_output_tokens)


def test_padded_tokens_rounds_chunks_up_to_the_granularity():
    assert [padded_tokens(n, 16) for n in (0, 1, 2, 16, 17, 33)] == [0, 1, 16, 16, 32, 48]


def test_a_prompt_chunk_then_its_last_chunk_then_a_decode_placeholder():
    plan = StepPlan(100, 16)
    req = make_request("a", 20)
    req.set_blocks([3, 4])
    plan.add(req, 12)                           # a chunk: no sample, left mid-prefill
    sr = plan.scheduled["a"]
    assert sr.token_ids == tuple(req.prompt_token_ids[:12]) and not sr.sample and sr.num_computed_tokens == 0
    assert plan.budget == 100 - 16 and plan.partial == {"a"} and _state(req) == (12, 0)
    plan = StepPlan(100, 16)
    plan.add(req, 8)                            # the prompt's end: it samples
    assert plan.scheduled["a"].sample and _state(req) == (20, 1) and plan.partial == set()
    plan = StepPlan(100, 16)
    plan.add(req, 1)                            # the next step, one ahead: the token in flight
    sr = plan.scheduled["a"]
    assert sr.token_ids == (PLACEHOLDER_TOKEN,) and sr.sample and sr.num_output_tokens == 1
    assert _state(req) == (21, 2) and plan.budget == 99 and plan.decodes == 1


def test_take_back_restores_what_add_advanced():
    rng = random.Random(0)
    verifications = 0
    for trial in range(200):
        plan = StepPlan(rng.randrange(64, 256), rng.choice([1, 8, 16]))
        reqs = []
        for i in range(rng.randrange(1, 6)):
            req = make_request(f"r{i}", rng.randrange(2, 40))
            req.num_computed_tokens = rng.randrange(0, req.num_prompt_tokens)
            req.set_blocks([10 * i + j for j in range(1, 5)])
            reqs.append(req)
        before = {r.request_id: _state(r) for r in reqs}
        budget_before = plan.budget
        for r in reqs:
            n = min(rng.randrange(1, 20), r.num_prompt_tokens - r.num_computed_tokens)
            if rng.random() < 0.3 and r.num_computed_tokens == r.num_prompt_tokens - 1:
                plan.add(r, 3, draft=[rng.randrange(3, 60) for _ in range(2)])   # a verification
                verifications += 1
            else:
                plan.add(r, n)
            plan.copies.append((99, r.block_ids[-1]))     # a copy-on-write into its last block
        victim = rng.choice(reqs)
        copies = [c for c in plan.copies if c[1] not in victim.block_ids]
        assert plan.take_back(victim) is True                 # its copy went with it
        assert _state(victim) == before[victim.request_id]
        assert victim.request_id not in plan.scheduled and victim.request_id not in plan.partial
        assert plan.copies == copies
        assert plan.take_back(victim) is False                # nothing left to undo
        for r in reqs:
            if r is not victim:
                assert plan.take_back(r) is True
        assert plan.budget == budget_before and not plan.scheduled and not plan.copies, trial
    assert verifications > 5


@dataclasses.dataclass(frozen=True, slots=True)
class _Penalised(SamplingOptions):
    reads_tokens: ClassVar[bool] = True     # as runner/logit_adjustments.py's options with penalties


def test_token_histories_restart_unless_the_step_before_sent_one_and_after_a_take_back():
    req = make_request("a", 6, sampling=_Penalised())
    req.set_blocks([1, 2])
    plan = StepPlan(100, 4, step=1)
    plan.add(req, 6)
    h = plan.scheduled["a"].token_history
    assert h.restarts and h.prompt_token_ids == tuple(req.prompt_token_ids) and h.new_output_token_ids == ()
    req.output_token_ids.append(9)            # update(): the token it sampled
    req.num_pending_output_tokens = 0
    plan = StepPlan(100, 4, step=2)
    plan.add(req, 1)
    h = plan.scheduled["a"].token_history
    assert not h.restarts and (h.num_outputs_before, h.new_output_token_ids) == (0, (9,))
    plan.take_back(req)                       # preempted later in the same call: the runner never sees it
    plan = StepPlan(100, 4, step=3)
    plan.add(req, 1)
    h = plan.scheduled["a"].token_history
    assert h.restarts and h.prompt_token_ids == tuple(req.prompt_token_ids) and h.new_output_token_ids == (9,)
    req.output_token_ids += [4, 5]
    req.num_pending_output_tokens = 0
    plan = StepPlan(100, 4, step=5)           # it sat step 4 out: its seat was freed
    plan.add_decode(req)
    h = plan.scheduled["a"].token_history
    assert h.restarts and h.new_output_token_ids == (9, 4, 5)
    plain = make_request("b", 3)
    plain.set_blocks([3])
    plan.add(plain, 3)
    assert plan.scheduled["b"].token_history is None       # options that read no tokens: nothing sent
