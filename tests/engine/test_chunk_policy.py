"""The default prefill chunk: ITL budget x measured prefill throughput, in whole tiles."""

from types import SimpleNamespace

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.chunk_policy import resolve_chunk_policy
from jaxserve.runner.calibration import Calibrator
from tests.conftest import TINY_ENGINE


class MeasuredRunner:
    """Decode-only steps cost decode_step_s for the largest bucket, proportionally less below."""

    def __init__(self, decode_step_s: float, prefill_tokens_per_s: float, decode_buckets=(32,)):
        self.decode_step_s, self.prefill_tokens_per_s = decode_step_s, prefill_tokens_per_s
        self.shapes = SimpleNamespace(decode_buckets=decode_buckets)
        self.calls: list[str] = []

    def measure_decode_step_time(self, rows: int) -> float:
        self.calls.append(f"decode {rows}")
        return self.decode_step_s * rows / self.shapes.decode_buckets[-1]

    def measure_chunk_rate(self) -> float:
        self.calls.append("prefill")
        return self.prefill_tokens_per_s


def test_default_budget_is_the_measured_decode_step():
    runner = MeasuredRunner(0.2, 430.0)   # 0.2 s x 430 tok/s = 86 tokens -> 64 in tiles of 32
    policy = resolve_chunk_policy(EngineConfig(prefill_tile=32), runner)
    assert (policy.chunk_tokens, policy.derived) == (64, True)
    assert policy.itl_budget_s == 0.2 and policy.prefill_tokens_per_s == 430.0
    assert runner.calls == ["prefill", "decode 32"] and policy.by_decodes == ()


def test_smaller_decode_batches_get_their_own_smaller_chunks():
    runner = MeasuredRunner(0.2, 430.0, decode_buckets=(1, 4, 16, 32))
    policy = resolve_chunk_policy(EngineConfig(prefill_tile=8), runner)
    # budgets 6.25, 25, 100, 200 ms x 430 tok/s = 2.7, 10.8, 43, 86 tokens -> tiles of 8 (at least one)
    assert policy.by_decodes == ((1, 8), (4, 8), (16, 40))
    assert policy.chunk_tokens == 80 and policy.itl_budget_s == 0.2
    assert runner.calls == ["prefill", "decode 1", "decode 4", "decode 16", "decode 32"]


def test_an_explicit_itl_budget_replaces_the_decode_measurement():
    runner = MeasuredRunner(0.2, 430.0)
    policy = resolve_chunk_policy(EngineConfig(prefill_tile=32, itl_budget_ms=500), runner)
    assert policy.chunk_tokens == 192          # 0.5 x 430 = 215 -> 192
    assert runner.calls == ["prefill"] and policy.by_decodes == ()


def test_a_tiny_budget_still_gets_one_tile():
    policy = resolve_chunk_policy(EngineConfig(prefill_tile=32, itl_budget_ms=1), MeasuredRunner(0.2, 430.0))
    assert policy.chunk_tokens == 32


@pytest.mark.parametrize("kwargs,expected", [({"long_prefill_token_threshold": 0}, 0),
                                             ({"long_prefill_token_threshold": 96}, 96),
                                             ({"enable_chunked_prefill": False}, 0)])
def test_explicit_settings_measure_nothing(kwargs, expected):
    runner = MeasuredRunner(0.2, 430.0)
    policy = resolve_chunk_policy(EngineConfig(**kwargs), runner)
    assert (policy.chunk_tokens, policy.derived, runner.calls) == (expected, False, [])


@pytest.mark.parametrize("bad", [0, -5.0])
def test_itl_budget_must_be_positive(bad):
    with pytest.raises(ValueError, match="itl_budget_ms"):
        EngineConfig(itl_budget_ms=bad)


def test_a_real_engine_derives_its_chunk_at_start_up(tiny_llama_dir):
    config = {**TINY_ENGINE, "long_prefill_token_threshold": None}
    llm = LLM(tiny_llama_dir, **config)
    policy = llm.engine.chunk_policy
    assert policy.derived and policy.itl_budget_s > 0 and policy.prefill_tokens_per_s > 0
    tile = config["prefill_tile"]
    expected = max(tile, int(policy.itl_budget_s * policy.prefill_tokens_per_s) // tile * tile)
    assert policy.chunk_tokens == expected
    assert llm.stats().prefill_chunk_tokens == expected
    # the measurements wrote only scratch blocks: the pool is whole and serving works
    assert llm.stats().num_kv_blocks_free == llm.stats().num_kv_blocks_total
    out = llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=16, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 16
    assert llm.stats().num_compilations_after_warmup == 0


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
