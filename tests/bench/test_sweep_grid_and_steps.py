"""`bench sweep`'s parts without an engine: the grid of configurations and the step-time window."""

import pytest

from jaxserve.bench.decode_steps import DecodeTiming, PairedTiming, full_batch_step_times, output_tokens_for, pooled
from jaxserve.bench.sweep_grid import AXES, parse_values, sweep_points

DEFAULT = {"max_model_len": 8192, "max_num_seqs": 32, "block_size": 16, "prefill_tile": 16}
AXIS_VALUES = {"max_model_len": (1024, 8192), "max_num_seqs": (8, 32, 64), "block_size": (16,), "prefill_tile": (8, 16)}


def test_axes_grid_varies_one_setting_at_a_time_from_the_default():
    points = sweep_points(DEFAULT, AXIS_VALUES, "axes")
    assert points[0].is_default and points[0].settings == DEFAULT and points[0].label == "default"
    others = points[1:]
    assert [p.label for p in others] == ["max_model_len=1024", "max_num_seqs=8", "max_num_seqs=64", "prefill_tile=8"]
    for p in others:
        (axis,) = p.varied
        assert {a for a in AXES if p.settings[a] != DEFAULT[a]} == {axis}


def test_full_grid_takes_every_combination_once_with_the_default_first():
    points = sweep_points(DEFAULT, AXIS_VALUES, "full")
    combos = 2 * 3 * 1 * 2
    assert len(points) == combos                       # the default is one of the combinations
    assert points[0].is_default
    assert len({tuple(p.settings.values()) for p in points}) == combos
    assert all(p.varied == tuple(a for a in AXES if p.settings[a] != DEFAULT[a]) for p in points)


def test_a_default_outside_the_lists_is_measured_as_well():
    points = sweep_points({**DEFAULT, "block_size": 32}, AXIS_VALUES, "full")
    assert len(points) == 2 * 3 * 1 * 2 + 1 and points[0].settings["block_size"] == 32


@pytest.mark.parametrize("text", ["", "0,8", "a,8", "-4"])
def test_bad_value_lists_are_refused(text):
    with pytest.raises(ValueError, match="--block-size"):
        parse_values(text, "--block-size")


def test_value_lists_are_sorted_without_duplicates():
    assert parse_values("32, 8,16,8", "--block-size") == (8, 16, 32)


def test_only_steps_with_every_request_decoding_are_timed():
    # request a starts at t=1 and b at t=3 (its prompt came one step later); a ends first, at t=6
    a = [1.0, 2.0, 3.0, 4.5, 6.0]
    b = [3.0, 4.5, 6.0, 7.0, 8.5]
    assert full_batch_step_times([a, b]) == (1.5, 1.5)
    assert full_batch_step_times([[0.0, 0.5, 1.5]]) == (0.5, 1.0)       # batch 1: every gap after the first token
    with pytest.raises(ValueError):
        full_batch_step_times([a, []])


def test_output_tokens_leave_the_asked_steps_after_every_prompt_is_in():
    # 32 prompts of 128 tokens in a 512-token budget: at most ceil(4096 / 480) + 1 = 10 steps to admit them
    assert output_tokens_for(32, 128, 8, 512) == 10 + 8 + 1
    assert output_tokens_for(1, 128, 8, 512) == 2 + 8 + 1


def test_decode_timing_per_token_is_the_median_step_over_the_rows():
    t = DecodeTiming(4, (0.2, 0.1, 0.4))
    assert t.median_s == 0.2 and t.per_token_s == pytest.approx(0.05)
    d = t.as_dict()
    assert d["steps"] == 3 and d["median_step_ms"] == pytest.approx(200) and d["per_token_ms"] == pytest.approx(50)


def test_pooled_timings_keep_every_step_of_one_batch_size():
    t = pooled([DecodeTiming(4, (0.1, 0.3), 0), DecodeTiming(4, (0.2,), 16)])
    assert t == DecodeTiming(4, (0.1, 0.3, 0.2), 16)
    with pytest.raises(ValueError, match="different batch sizes"):
        pooled([DecodeTiming(4, (0.1,)), DecodeTiming(8, (0.1,))])


def test_time_beside_times_the_default_then_the_configuration_each_round(monkeypatch):
    from jaxserve.bench import decode_steps

    calls = []
    step_s = {"default": [0.10, 0.20, 0.10], "config": [0.30, 0.20, 0.50]}   # one step time per round

    def fake_measure(llm, *, batch, input_len, steps, seed):
        calls.append((llm, batch, seed))
        return DecodeTiming(batch, (step_s[llm].pop(0),) * steps)

    monkeypatch.setattr(decode_steps, "measure_decode", fake_measure)
    paired = decode_steps.time_beside("config", "default", batch=8, default_batch=4, rounds=3, input_len=16,
                                      steps=2, seeds=iter(range(100)))
    assert [(llm, batch) for llm, batch, _ in calls] == [("default", 4), ("config", 8)] * 3
    assert len({seed for _, _, seed in calls}) == 6                        # fresh prompts for every timing
    # per token: config 0.3/8, 0.2/8, 0.5/8 against default 0.1/4, 0.2/4, 0.1/4
    assert paired.ratios == pytest.approx((1.5, 0.5, 2.5)) and paired.ratio == pytest.approx(1.5)
    assert paired.own.batch == 8 and len(paired.own.step_s) == 6 and paired.default.batch == 4
    assert PairedTiming.alone(paired.own).ratio == 1.0
