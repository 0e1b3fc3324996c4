"""Little's law planning, the knee finder, and cross-backend token agreement."""

import pytest

from jaxserve.bench.cmd_plan import knee, plan
from jaxserve.bench.results import agreement


def test_knee_is_where_a_saturating_curve_bends():
    xs = [1, 2, 4, 8, 16, 32]
    ys = [10, 20, 39, 70, 80, 82]
    assert xs[knee(xs, ys)] == 8


def test_knee_of_two_points_is_the_better_one():
    assert knee([1, 2], [5.0, 4.0]) == 0


def test_plan_applies_littles_law_and_counts_engines_at_the_knee():
    sweep = [{"batch_size": b, "output_tok_s": y} for b, y in zip([1, 2, 4, 8, 16, 32], [10, 20, 39, 70, 80, 82])]
    p = plan(rate=3.0, duration=6.0, sweep=sweep, output_len=100)
    assert p["concurrency"] == pytest.approx(18.0)
    assert p["knee_batch"] == 8 and p["engines_at_knee"] == 3          # ceil(18 / 8)
    assert p["token_rate_needed"] == pytest.approx(300.0)
    assert p["engines_for_token_rate"] == 5                             # ceil(300 / 70)


def test_plan_rejects_non_positive_inputs():
    with pytest.raises(ValueError, match="rate and duration"):
        plan(0.0, 1.0)


def test_agreement_stops_comparing_at_the_first_stop_token():
    ref = {"a": [5, 6, 7], "b": [1, 2, 3], "c": [9, 2, 4]}
    other = {"a": [5, 6, 7], "b": [4, 2, 3], "c": [9, 2, 8], "d": [0]}
    got = agreement(ref, other, stop_ids=[2])
    assert got["compared"] == 3
    assert got["identical"] == 2          # a fully, c up to the stop token 2; b differs at index 0
    assert got["mean_matching_prefix"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)


def test_the_jaxserve_cli_mounts_plan_and_exits_zero(capsys):
    from jaxserve.cli import main

    assert main(["plan", "--rate", "1.5", "--duration", "2"]) == 0
    assert "3.0 requests in flight" in capsys.readouterr().out
