"""The prefill policy chosen at start-up (engine/chunk_policy.py): the service-objective policy (the
serving default) from a measured step-cost model, and the earlier itl policy: ITL budget x measured
prefill throughput, in whole tiles."""

from types import SimpleNamespace

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine_args import engine_config
from jaxserve.engine.builder import runner_shapes
from jaxserve.engine.chunk_policy import ITEM_TOKENS, resolve_chunk_policy
from jaxserve.runner.batch import bucket_for
from tests.packing_oracle import pack_step
from jaxserve.runner.calibration import Calibrator
from tests.conftest import TINY_ENGINE
from tests.sched.sched_testkit import check_invariants


class MeasuredRunner:
    """Decode-only steps cost decode_step_s for the largest bucket, proportionally less below."""

    def __init__(self, decode_step_s: float, prefill_tokens_per_s: float, decode_buckets=(32,)):
        self.decode_step_s, self.prefill_tokens_per_s = decode_step_s, prefill_tokens_per_s
        self.shapes = SimpleNamespace(decode_buckets=decode_buckets, prefill_buckets=(0, 1, 2, 4), prefill_tile=8,
                                      max_model_len=4096)
        self.calls: list[str] = []

    def measure_decode_step_time(self, rows: int, context: int = 256) -> float:
        self.calls.append(f"decode {rows}")
        return self.decode_step_s * rows / self.shapes.decode_buckets[-1]

    def measure_prefill_step_time(self, tiles: int, depth: int = 0) -> float:
        """A tile at depth 0 costs 8 / prefill_tokens_per_s; 0.5 ms more per 64-token item beyond."""
        self.calls.append(f"prefill {tiles} at {depth}")
        extra_items = tiles * (-(-(depth + 8) // ITEM_TOKENS) - 1)
        return tiles * 8 / self.prefill_tokens_per_s + 0.0005 * extra_items

    def measure_chunk_rate(self) -> float:
        self.calls.append("prefill")
        return self.prefill_tokens_per_s

    def prefill_depth(self, tiles: int, depth: int) -> int:
        return max(0, min(depth, self.shapes.max_model_len - tiles * 8))


def test_default_budget_is_the_measured_decode_step():
    runner = MeasuredRunner(0.2, 430.0)   # 0.2 s x 430 tok/s = 86 tokens -> 64 in tiles of 32
    policy = resolve_chunk_policy(engine_config(prefill_tile=32, chunk_policy="itl"), runner)
    assert (policy.chunk_tokens, policy.derived) == (64, True)
    assert policy.itl_budget_s == 0.2 and policy.prefill_tokens_per_s == 430.0
    assert runner.calls == ["prefill", "decode 32"] and policy.by_decodes == ()


def test_smaller_decode_batches_get_their_own_smaller_chunks():
    runner = MeasuredRunner(0.2, 430.0, decode_buckets=(1, 4, 16, 32))
    policy = resolve_chunk_policy(engine_config(prefill_tile=8, chunk_policy="itl"), runner)
    # budgets 6.25, 25, 100, 200 ms x 430 tok/s = 2.7, 10.8, 43, 86 tokens -> tiles of 8 (at least one)
    assert policy.by_decodes == ((1, 8), (4, 8), (16, 40))
    assert policy.chunk_tokens == 80 and policy.itl_budget_s == 0.2
    assert runner.calls == ["prefill", "decode 1", "decode 4", "decode 16", "decode 32"]


def test_an_explicit_itl_budget_replaces_the_decode_measurement():
    runner = MeasuredRunner(0.2, 430.0)
    policy = resolve_chunk_policy(engine_config(prefill_tile=32, itl_budget_ms=500, chunk_policy="itl"), runner)
    assert policy.chunk_tokens == 192          # 0.5 x 430 = 215 -> 192
    assert runner.calls == ["prefill"] and policy.by_decodes == ()


def test_a_tiny_budget_still_gets_one_tile():
    policy = resolve_chunk_policy(engine_config(prefill_tile=32, itl_budget_ms=1, chunk_policy="itl"),
                                  MeasuredRunner(0.2, 430.0))
    assert policy.chunk_tokens == 32


@pytest.mark.parametrize("kwargs,expected", [({"long_prefill_token_threshold": 0}, 0),
                                             ({"long_prefill_token_threshold": 96}, 96),
                                             ({"enable_chunked_prefill": False}, 0)])
def test_explicit_settings_measure_nothing(kwargs, expected):
    runner = MeasuredRunner(0.2, 430.0)
    policy = resolve_chunk_policy(engine_config(**kwargs), runner)
    assert (policy.chunk_tokens, policy.derived, runner.calls) == (expected, False, [])


@pytest.mark.parametrize("bad", [0, -5.0])
def test_itl_budget_must_be_positive(bad):
    with pytest.raises(ValueError, match="itl_budget_ms"):
        engine_config(itl_budget_ms=bad)


def test_the_slo_policy_measures_a_step_cost_model_and_derives_its_objectives():
    runner = MeasuredRunner(0.2, 400.0, decode_buckets=(1, 4, 16, 32))
    policy = resolve_chunk_policy(engine_config(max_num_batched_tokens=32), runner)
    cost, slo = policy.step_cost, policy.objectives
    assert policy.chunk_tokens == 0 and not policy.derived
    assert cost.decode_s == ((1, 0.2 / 32), (4, 0.2 / 8), (16, 0.1), (32, 0.2))
    assert cost.prefill_s == ((1, 0.02), (2, 0.04), (4, 0.08)) and cost.tile == 8
    assert cost.item_s == pytest.approx(0.0005)   # the one tile measured at depth 2048 against depth 0
    assert slo.tpot_s == pytest.approx(0.3)       # 1.5 x the 32-row decode step (above the 100 ms floor)
    assert slo.ttft_s == pytest.approx(1.0)       # 2 x (6.25 ms + 80 ms) is under the 1 s floor
    assert "slo" in policy.describe()


def test_the_operators_objectives_replace_the_derived_ones():
    runner = MeasuredRunner(0.2, 400.0)
    policy = resolve_chunk_policy(engine_config(ttft_slo_ms=2500, tpot_slo_ms=120), runner)
    assert (policy.objectives.ttft_s, policy.objectives.tpot_s) == (2.5, 0.12)


@pytest.mark.parametrize("name", ["ttft_slo_ms", "tpot_slo_ms"])
@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_objectives_must_be_finite_and_positive(name, bad):
    with pytest.raises(ValueError, match=name):
        engine_config(**{name: bad})


def test_a_real_engine_measures_its_step_cost_model_at_start_up(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **{**TINY_ENGINE, "long_prefill_token_threshold": None, "tpot_slo_ms": 50})
    policy = llm.engine.chunk_policy
    sched_config = llm.engine.scheduler.config
    assert sched_config.objectives is policy.objectives and sched_config.step_cost is policy.step_cost
    assert policy.objectives.tpot_s == 0.05
    assert all(s > 0 for _, s in policy.step_cost.decode_s)
    # a tile's added time is a difference of two timings, clamped at 0: on a busy machine a tiny
    # model's mixed step can time as fast as its decode-only one, so only its range is certain
    assert [p for p, _ in policy.step_cost.prefill_s] == [p for p in llm.engine.runner.shapes.prefill_buckets if p]
    assert all(0 <= s < float("inf") for _, s in policy.step_cost.prefill_s)
    assert "slo" in llm.stats().steps.prefill_policy
    assert llm.stats().scheduler.num_kv_blocks_free == llm.stats().scheduler.num_kv_blocks_total
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (40, 7, 90)]
    out = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [16, 16, 16]
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_a_real_engine_derives_its_chunk_at_start_up(tiny_llama_dir):
    config = {**TINY_ENGINE, "long_prefill_token_threshold": None, "chunk_policy": "itl"}
    llm = LLM(tiny_llama_dir, **config)
    policy = llm.engine.chunk_policy
    assert policy.derived and policy.itl_budget_s > 0 and policy.prefill_tokens_per_s > 0
    tile = config["prefill_tile"]
    expected = max(tile, int(policy.itl_budget_s * policy.prefill_tokens_per_s) // tile * tile)
    assert policy.chunk_tokens == expected
    assert llm.stats().steps.prefill_chunk_tokens == expected
    # the measurements wrote only scratch blocks: the pool is whole and serving works
    assert llm.stats().scheduler.num_kv_blocks_free == llm.stats().scheduler.num_kv_blocks_total
    out = llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=16, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 16
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_the_chunk_rate_is_measured_at_the_deepest_chunk(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **TINY_ENGINE)
    runner = llm.engine.runner
    calibrator = Calibrator(runner)
    timed = []
    calibrator._best_time = lambda step, repeats: timed.append(step) or 0.1 * len(timed)
    assert calibrator.measure_chunk_rate() == pytest.approx(TINY_ENGINE["prefill_tile"] / 0.1)
    decode_only, mixed = timed
    chunk = [r for r in mixed.requests if len(r.token_ids) > 1]
    assert len(chunk) == 1 and len(chunk[0].token_ids) == TINY_ENGINE["prefill_tile"]
    # the chunk's last token sits at the last position a prompt can have
    assert chunk[0].num_computed_tokens + len(chunk[0].token_ids) == TINY_ENGINE["max_model_len"]
    assert len(decode_only.requests) == len(mixed.requests) - 1 == runner.shapes.max_decode_rows


class PackingRunner:
    """A runner that compiles nothing: each calibration step is checked against the engine's limits
    and packed into its bucket's arrays (what a real runner does before it runs one)."""

    def __init__(self, shapes, num_blocks: int):
        self.shapes = shapes
        self.arena_spec = SimpleNamespace(num_blocks=num_blocks)
        self.host_pool = None
        self.measurements = {}    # what a Calibrator keeps on the runner
        self.steps = []

    def load_executables(self, buckets) -> None:
        for bucket in buckets:
            assert bucket in self.shapes.buckets()

    def execute(self, step) -> None:
        for r in step.requests:
            end = r.num_computed_tokens + len(r.token_ids)
            assert end <= self.shapes.max_model_len, f"{r.request_id} reaches {end}"
            assert max(r.block_ids) < self.arena_spec.num_blocks
        bucket_for(step, self.shapes)
        pack_step(step, self.shapes)
        self.steps.append(step)


@pytest.mark.parametrize("policy", ["slo", "itl"])
@pytest.mark.parametrize("max_model_len", [64, 256, 1024])
def test_calibration_steps_fit_a_short_context(max_model_len, policy):
    # serve's defaults but a 2,048-token step budget: the largest prompt bucket (and the
    # item-cost depth of 2,048) exceeds what one request of a short context can hold
    config = engine_config(max_model_len=max_model_len, chunk_policy=policy, max_num_batched_tokens=2048)
    shapes = runner_shapes(config, max_model_len)
    assert shapes.prefill_buckets[-1] * shapes.prefill_tile > max_model_len
    runner = PackingRunner(shapes, num_blocks=4096)
    policy = resolve_chunk_policy(config, Calibrator(runner))
    assert runner.steps and (policy.step_cost or policy.chunk_tokens)
    if policy.step_cost is not None:
        # every prompt bucket measured, each with all its tiles, the deepest at the context's end
        assert [p for p, _ in policy.step_cost.prefill_s] == [p for p in shapes.prefill_buckets if p]
    tile = shapes.prefill_tile
    for step in runner.steps:
        chunk_tiles = sum(-(-len(r.token_ids) // tile) for r in step.requests if len(r.token_ids) > 1)
        assert chunk_tiles in (0, *shapes.prefill_buckets)
    deepest = max(r.num_computed_tokens + len(r.token_ids) for s in runner.steps for r in s.requests)
    assert deepest == max_model_len


def test_calibration_steps_fit_a_small_arena():
    config = engine_config(max_model_len=1024)
    shapes = runner_shapes(config, 1024)
    runner = PackingRunner(shapes, num_blocks=1 + 300 // shapes.block_size)   # 300 tokens of scratch
    policy = resolve_chunk_policy(config, Calibrator(runner))
    assert policy.step_cost is not None
    assert max(b for s in runner.steps for r in s.requests for b in r.block_ids) < runner.arena_spec.num_blocks


def test_a_real_engine_with_a_context_shorter_than_its_step_budget_starts_and_serves(tiny_llama_dir):
    # the serving default (slo policy) with a 64-token step budget over a 32-token context: the
    # largest prompt bucket is two requests' worth, and the item cost is measured at depth 24
    llm = LLM(tiny_llama_dir, **{**TINY_ENGINE, "long_prefill_token_threshold": None, "max_model_len": 32,
                                 "max_num_batched_tokens": 64})
    cost = llm.engine.chunk_policy.step_cost
    assert [p for p, _ in cost.prefill_s] == [p for p in llm.engine.runner.shapes.prefill_buckets if p]
    out = llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (20, 5)],
                       SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
    check_invariants(llm.engine.scheduler)
    assert llm.stats().steps.num_compilations_after_warmup == 0
