"""The metric definitions of jaxserve.bench.metrics, checked on hand-made timings."""

import math

import numpy as np
import pytest

from jaxserve.bench.metrics import LatencyStats, RequestRecord, metrics_from_dict, summarize


def rec(rid="a", arrival=10.0, times=(10.5, 10.7, 11.0), finished=None, prompt=8, scheduled=10.2, cached=0):
    return RequestRecord(rid, prompt, len(times), arrival, times[0], finished or times[-1], scheduled, tuple(times),
                         cached)


def test_one_request_latencies_follow_the_documented_definitions():
    r = rec()
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.0)
    assert r.tpot == pytest.approx((1.0 - 0.5) / 2)
    assert r.itls == pytest.approx([0.2, 0.3])
    assert r.queue_time == pytest.approx(0.2)


def test_a_one_token_request_has_no_tpot_and_no_itl():
    r = rec(times=(10.4,))
    assert r.tpot is None and r.itls == []


def test_percentiles_interpolate_linearly_between_ranks():
    s = LatencyStats.of([4.0, 1.0, 3.0, 2.0])
    assert s.median == pytest.approx(2.5)
    assert s.p99 == pytest.approx(3.0 + 0.97 * 1.0)  # rank 0.99 * 3 = 2.97 -> 3 + 0.97 * (4 - 3)
    assert s.p90 == pytest.approx(3.0 + 0.7)
    assert (s.mean, s.max, s.n) == (2.5, 4.0, 4)


def test_percentiles_of_nothing_are_nan():
    s = LatencyStats.of([])
    assert s.n == 0 and math.isnan(s.mean) and math.isnan(s.p99)


def test_summary_pools_itl_and_counts_tokens_over_the_whole_run():
    a = rec("a", arrival=0.0, times=(1.0, 2.0, 4.0), prompt=10, cached=4)
    b = rec("b", arrival=1.0, times=(3.0,), finished=5.0, prompt=6, scheduled=None)
    m = summarize([a, b])
    assert m.duration_s == pytest.approx(5.0)          # first arrival 0 -> last finish 5
    assert m.total_prompt_tokens == 16 and m.total_output_tokens == 4
    assert m.request_throughput == pytest.approx(2 / 5)
    assert m.output_throughput == pytest.approx(4 / 5)
    assert m.total_throughput == pytest.approx(20 / 5)
    assert m.ttft.mean == pytest.approx((1.0 + 2.0) / 2)
    assert m.tpot.n == 1 and m.tpot.mean == pytest.approx(1.5)   # b has one token: no TPOT
    assert m.itl.n == 2 and m.itl.median == pytest.approx(1.5)  # a: gaps 1 and 2
    assert m.queue.n == 1                                         # b was never seen scheduled
    assert m.prefix_hit_rate == pytest.approx(4 / 16)
    assert np.isclose(m.e2e.p99, np.percentile([4.0, 4.0], 99))


def test_an_explicit_duration_overrides_the_span_of_the_records():
    m = summarize([rec()], duration_s=4.0)
    assert m.output_throughput == pytest.approx(3 / 4)


def test_summary_round_trips_through_its_dict():
    m = summarize([rec("a"), rec("b", arrival=9.0)])
    assert metrics_from_dict(m.as_dict()) == m


@pytest.mark.parametrize("kwargs, field", [
    ({"arrival": 11.0}, "first_token_time"),
    ({"finished": 10.0}, "finished_time"),
])
def test_inconsistent_timings_are_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        rec(**kwargs)


def test_token_times_must_match_the_output_length():
    with pytest.raises(ValueError, match="token_times"):
        RequestRecord("a", 4, 3, 0.0, 1.0, 2.0, token_times=(1.0, 2.0))


def test_records_round_trip_through_json():
    r = rec()
    assert RequestRecord.from_json(r.to_json()) == r
