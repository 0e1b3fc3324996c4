"""The Engine's step loop without a model: a deterministic fake runner whose next token is a
function of the whole context, so any scheduling mistake (a lost, repeated or reordered token)
changes the outputs."""

import pytest

from jaxserve.engine.engine import Engine
from jaxserve.runner.step_data import ModelRunnerOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.scheduler import Scheduler
from jaxserve.sched.scheduler_config import SchedulerConfig
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN

VOCAB = 97
EOS = 0


class FakeRunner:
    """Keeps each request's context as the scheduler feeds it; next token = hash of the context.
    Like the real runner, it resolves a placeholder from the previous dispatched step's tokens."""

    # the rest of the Runner protocol (jaxserve/runner/protocol.py): no features, one device, no
    # real arena, never asleep
    features = ()
    step_mirror = sleep_state = arena_spec = mesh_info = None

    def __init__(self):
        self.owner = None
        self.contexts: dict[str, list[int]] = {}
        self.steps = 0
        self.placeholders = 0
        self._last: dict[str, int] = {}

    def dispatch(self, sched_out):
        self.steps += 1
        sampled = {}
        for r in sched_out.requests:
            ctx = self.contexts.setdefault(r.request_id, [])
            del ctx[r.num_computed_tokens:]          # a preempted request recomputes from its start
            for t in r.token_ids:
                if t == PLACEHOLDER_TOKEN:
                    self.placeholders += 1
                    t = self._last[r.request_id]
                ctx.append(t)
            if r.sample:
                sampled[r.request_id] = [1 + sum((i + 1) * t for i, t in enumerate(ctx)) % (VOCAB - 1)]
        if sched_out.requests:
            self._last = {rid: toks[-1] for rid, toks in sampled.items()}
        return ModelRunnerOutput(sampled)

    def is_ready(self, handle):
        return True

    def collect(self, handle):
        return handle

def expected(prompt, n):
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(1 + sum((i + 1) * t for i, t in enumerate(ctx)) % (VOCAB - 1))
    return ctx[len(prompt):]


def make_engine(num_blocks=200, async_scheduling=True, **kw):
    sched = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                      max_model_len=128, **kw))
    return Engine(scheduler=sched, runner=FakeRunner(), tokenizer=None, vocab_size=VOCAB, max_model_len=128,
                  eos_token_ids=[EOS], async_scheduling=async_scheduling)


loop_modes = pytest.mark.parametrize("async_scheduling", [True, False], ids=["one-step-ahead", "sync"])


def run(engine):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


PROMPTS = [[5, 6, 7], list(range(1, 40)), [9] * 20, [3, 1, 4, 1, 5, 9, 2, 6]]


@loop_modes
def test_every_request_gets_exactly_the_tokens_of_its_own_context(async_scheduling):
    engine = make_engine(async_scheduling=async_scheduling)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=10 + i, temperature=0))
    done = run(engine)
    for i, p in enumerate(PROMPTS):
        assert done[f"r{i}"].outputs[0].token_ids == expected(p, 10 + i)
        assert done[f"r{i}"].outputs[0].finish_reason == "length"
    s = engine.stats()
    assert s.scheduler.num_kv_blocks_free + s.scheduler.num_kv_blocks_cached == s.scheduler.num_kv_blocks_total
    assert s.requests.generation_tokens_total == sum(10 + i for i in range(len(PROMPTS)))


@loop_modes
def test_a_cramped_pool_preempts_without_changing_any_output(async_scheduling):
    engine = make_engine(num_blocks=20, kv_watermark=0.0, enable_prefix_caching=False, async_scheduling=async_scheduling)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=24, temperature=0))
    done = run(engine)
    assert engine.stats().scheduler.num_preemptions > 0
    for i, p in enumerate(PROMPTS):
        assert done[f"r{i}"].outputs[0].token_ids == expected(p, 24)
    s = engine.stats()
    assert s.scheduler.num_kv_blocks_free + s.scheduler.num_kv_blocks_cached == s.scheduler.num_kv_blocks_total


@loop_modes
def test_abort_frees_blocks_and_other_requests_continue(async_scheduling):
    engine = make_engine(async_scheduling=async_scheduling)
    engine.add_request("keep", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=12, temperature=0))
    engine.add_request("drop", {"prompt_token_ids": PROMPTS[2]}, SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    engine.abort("drop")
    done = run(engine)
    assert "drop" not in done
    assert done["keep"].outputs[0].token_ids == expected(PROMPTS[1], 12)
    s = engine.stats()
    assert s.scheduler.num_running == 0 and s.scheduler.num_kv_blocks_free + s.scheduler.num_kv_blocks_cached == s.scheduler.num_kv_blocks_total


def test_the_one_step_ahead_loop_feeds_placeholders_and_drops_the_token_after_a_stop():
    # EOS ends "stops" after its first token; the loop has already scheduled its next step
    engine = make_engine()
    stop_at = expected(PROMPTS[0], 3)[2]
    engine.add_request("stops", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at]))
    engine.add_request("runs", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=8, temperature=0))
    done = run(engine)
    assert engine.runner.placeholders > 0
    assert done["stops"].outputs[0].token_ids == expected(PROMPTS[0], 3)
    assert done["stops"].outputs[0].finish_reason == "stop" and done["stops"].outputs[0].stop_reason == stop_at
    assert done["runs"].outputs[0].token_ids == expected(PROMPTS[1], 8)
    # the step after the stop computed a fourth token for "stops": never counted, never streamed
    assert engine.stats().requests.generation_tokens_total == 3 + 8
    assert len(engine.runner.contexts["stops"]) == len(PROMPTS[0]) + 3
    s = engine.stats()
    assert s.scheduler.num_kv_blocks_free + s.scheduler.num_kv_blocks_cached == s.scheduler.num_kv_blocks_total


def test_without_the_loop_no_placeholder_is_ever_scheduled():
    engine = make_engine(async_scheduling=False)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=6, temperature=0))
    run(engine)
    assert engine.runner.placeholders == 0
