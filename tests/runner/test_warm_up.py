"""Warm-up: no request pays a step's first run. Counted, never timed: which buckets ran before the
engine took a request, against the buckets its requests then stepped in."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.builder import prepare_for_requests
from jaxserve.runner.batch import bucket_for
from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.warmup import buckets_for_requests
from tests.conftest import TINY_ENGINE


@pytest.fixture
def bucket_log(monkeypatch):
    """Every bucket the runner dispatches, in order, with the phase it ran in."""
    log: list[tuple[str, tuple[int, int]]] = []
    phase = ["build"]
    dispatch = ModelRunner.dispatch

    def recording(self, sched_out):
        if sched_out.requests:
            log.append((phase[0], bucket_for(sched_out, self.shapes)))
        return dispatch(self, sched_out)

    monkeypatch.setattr(ModelRunner, "dispatch", recording)
    return log, phase


def _workload(seed: int, n: int = 12, longest: int = 70):
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(3, 200, int(rng.integers(2, longest))).tolist()} for _ in range(n)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 24)), ignore_eos=True) for _ in range(n)]
    return prompts, params


def test_every_bucket_runs_once_before_the_engine_takes_a_request(tiny_llama_dir, bucket_log):
    log, phase = bucket_log
    # warm_up="all", the default; no swap space, so no calibration runs steps besides the warm-up
    llm = LLM(tiny_llama_dir, **{**TINY_ENGINE, "swap_space": 0})
    runner = llm.engine.runner
    warmed = [b for p, b in log if p == "build"]
    assert sorted(warmed) == sorted(runner.shapes.buckets())     # each once, decode-only and mixed alike
    assert (2, 0) in warmed and (4, 0) in warmed and (4, 4) in warmed

    phase[0] = "serve"
    prompts, params = _workload(seed=0)
    llm.generate(prompts, params, use_tqdm=False)
    served = {b for p, b in log if p == "serve"}
    assert served and served <= set(warmed)
    assert runner.executables_loaded_on_demand() == []
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_a_step_loaded_by_calibration_is_still_warmed_for_requests(tiny_llama_dir, bucket_log):
    """Loaded is not run: prepare_for_requests runs every bucket it names, loaded before or not."""
    log, phase = bucket_log
    llm = LLM(tiny_llama_dir, **{**TINY_ENGINE, "warm_up": "none", "swap_space": 0})
    runner = llm.engine.runner
    runner.load_executables([(1, 2), (1, 0)])
    phase[0] = "prepare"
    prepare_for_requests(llm.engine, [(12, 4)])              # 12 prompt tokens in tiles of 8: 2 tiles
    assert sorted(b for p, b in log if p == "prepare") == [(1, 0), (1, 2)]


def test_warm_up_writes_only_the_null_block(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **{**TINY_ENGINE, "swap_space": 0})   # no swap calibration: nothing else writes
    for k, v in llm.engine.runner.kv_caches:
        assert not np.asarray(k)[1:].any() and not np.asarray(v)[1:].any()
    stats = llm.stats()
    assert stats.scheduler.num_kv_blocks_free == stats.scheduler.num_kv_blocks_total


def test_warming_for_known_requests_covers_every_step_they_take(tiny_llama_dir, bucket_log):
    """`jaxserve generate`'s policy: nothing warmed at build, then the steps its requests can need."""
    log, phase = bucket_log
    llm = LLM(tiny_llama_dir, **{**TINY_ENGINE, "warm_up": "none", "swap_space": 0})
    runner = llm.engine.runner
    assert [b for p, b in log if p == "build"] == []             # nothing to calibrate: no step ran
    rounds = [_workload(seed=3, n=1, longest=20), _workload(seed=1, n=2, longest=20), _workload(seed=2)]
    for round_, (prompts, params) in enumerate(rounds):
        phase[0] = f"prepare {round_}"
        requests = [llm.engine.input_processor.process(p, sp) for p, sp in zip(prompts, params)]
        prepare_for_requests(llm.engine, [(len(r.prompt_token_ids), r.max_tokens) for r in requests])
        warmed = {b for p, b in log if p.startswith("prepare")}
        phase[0] = f"serve {round_}"
        out = llm.generate(prompts, params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [p.max_tokens for p in params]
        assert {b for p, b in log if p == phase[0]} <= warmed
        if round_ == 0:      # one request: its prompt's step and one-decode steps, exactly
            assert warmed == {b for p, b in log if p == phase[0]} and len(warmed) == 2
        if round_ == 1:      # two short requests: two seats' and a few tiles' worth, not every step
            assert len(warmed) < len(runner.shapes.buckets())
    assert runner.executables_loaded_on_demand() == []


SHAPES = RunnerShapes(block_size=4, max_model_len=128, prefill_tile=8, decode_buckets=(1, 4, 16),
                      prefill_buckets=(0, 1, 2, 4, 8), decode_only_buckets=(1, 2, 4, 6, 8, 12, 16))


def test_one_request_needs_its_prompt_step_and_one_decode_step():
    # a 20-token prompt: 3 tiles of 8 -> prefill bucket 4, beside the one-row bucket; then decodes
    assert buckets_for_requests(SHAPES, [(20, 4)]) == [(1, 0), (1, 4)]
    assert buckets_for_requests(SHAPES, [(20, 1)]) == [(1, 0), (1, 4)]   # a step beyond the last may run
    assert buckets_for_requests(SHAPES, [(1, 4)]) == [(1, 0)]            # a one-token prompt is a decode row
    # a prompt over the step's budget (8 tiles) is chunked, into any smaller steps
    assert buckets_for_requests(SHAPES, [(100, 4)]) == [(1, 0), (1, 1), (1, 2), (1, 4), (1, 8)]


def test_more_requests_widen_both_bounds_up_to_the_budget():
    got = buckets_for_requests(SHAPES, [(20, 4)] * 5)      # 5 sequences, 15 tiles (budget: 8)
    assert got == sorted([(d, 0) for d in (1, 2, 4, 6)] + [(d, p) for d in (1, 4, 16) for p in (1, 2, 4, 8)])
    assert buckets_for_requests(SHAPES, [(10, 6), (2, 3)]) == [(1, 0), (1, 1), (1, 2), (1, 4), (2, 0),
                                                              (4, 1), (4, 2), (4, 4)]
    assert buckets_for_requests(SHAPES, [(900, 100)] * 40) == SHAPES.buckets()
    assert buckets_for_requests(SHAPES, []) == []
