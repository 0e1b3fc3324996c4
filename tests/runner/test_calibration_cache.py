"""Calibration timings are measured once per key (checkpoint, shapes and sizes, software, machine)
and read back from the cache by the next start under the same key; any change in the key measures
again. The runner is a stand-in that counts the steps it is asked to run."""

import dataclasses

import pytest

from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.calibration import CalibrationCache, CalibrationKey, Calibrator
from jaxserve.runner.kv_arena import ArenaSpec

SHAPES = RunnerShapes(block_size=4, max_model_len=128, prefill_tile=8, decode_buckets=(1, 4),
                      prefill_buckets=(0, 1, 2, 4), decode_only_buckets=(1, 2, 4))


class CountingRunner:
    def __init__(self, shapes=SHAPES, num_blocks=96):
        self.shapes = shapes
        self.arena_spec = ArenaSpec(num_layers=2, num_blocks=num_blocks, block_size=shapes.block_size,
                                    num_kv_heads=1, head_dim=8, dtype="float32")
        self.host_pool = None
        self.measurements = {}    # what a Calibrator keeps on the runner
        self.attention_impl = "xla"
        self.compiler_options = {}
        self.steps = 0

    def load_executables(self, buckets):
        pass

    def execute(self, step):
        self.steps += 1


def _calibrate(runner, cache, identity="sha256:aa"):
    calibrator = Calibrator(runner, cache=cache, key=CalibrationKey.for_runner(runner, identity))
    values = (calibrator.measure_prefill_throughput(), calibrator.measure_chunk_rate(),
              [calibrator.measure_decode_step_time(rows=r) for r in runner.shapes.decode_buckets])
    calibrator.save()
    return calibrator, values


def test_a_second_start_under_the_same_key_measures_nothing(tmp_path):
    cache = CalibrationCache(str(tmp_path))
    first, values = _calibrate(runner := CountingRunner(), cache)
    assert runner.steps > 0 and first.reused == [] and len(first.measured) == 4
    again, same_values = _calibrate(runner := CountingRunner(), cache)
    assert runner.steps == 0 and again.measured == [] and sorted(again.reused) == sorted(first.measured)
    assert same_values == values


@pytest.mark.parametrize("change", ["checkpoint", "shapes", "arena", "machine", "software"])
def test_a_different_key_measures_again(tmp_path, change, monkeypatch):
    cache = CalibrationCache(str(tmp_path))
    _calibrate(CountingRunner(), cache)
    runner, identity = CountingRunner(), "sha256:aa"
    if change == "checkpoint":
        identity = "sha256:bb"
    elif change == "shapes":
        runner = CountingRunner(dataclasses.replace(SHAPES, max_model_len=256))
    elif change == "arena":
        runner = CountingRunner(num_blocks=48)
    else:
        from jaxserve.runner import fingerprint, calibration
        real = getattr(fingerprint, change)()
        monkeypatch.setattr(calibration.fingerprint, change, lambda: {**real, "changed": True})
    calibrator, _ = _calibrate(runner, cache, identity)
    assert runner.steps > 0 and calibrator.reused == []


def test_an_entry_whose_stored_key_differs_is_a_miss(tmp_path):
    cache = CalibrationCache(str(tmp_path))
    key = CalibrationKey.for_runner(CountingRunner(), "sha256:aa")
    other = dataclasses.replace(key, checkpoint="sha256:bb")
    cache._disk.put_json(key.file_name(), {"key": other.as_json(), "measurements": {"prefill_tokens_per_s": 1.0}})
    assert cache.load(key) == {}
    cache.store(key, {"prefill_tokens_per_s": 2.0})
    assert cache.load(key) == {"prefill_tokens_per_s": 2.0}


def test_without_a_cache_every_runner_measures_once(tmp_path):
    """No disk cache: each new runner (a start) measures; a second calibrator over the same runner
    (another engine on it: tests, bench variants) reuses what the runner already measured."""
    runner = CountingRunner()
    Calibrator(runner).measure_prefill_throughput()
    measured = runner.steps
    Calibrator(runner).measure_prefill_throughput()
    assert measured > 0 and runner.steps == measured
    other = CountingRunner()
    Calibrator(other).measure_prefill_throughput()
    assert other.steps == measured
