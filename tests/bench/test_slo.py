"""SLO attainment and goodput (jaxserve.bench.slo), checked on hand-made records: no clock runs."""

import math

import pytest

from jaxserve.bench.metrics import RequestRecord
from jaxserve.bench.slo import SLO, evaluate, goodput_rate, meets, verdict


def rec(rid, arrival, first, finished, n, group=""):
    """A request of n output tokens: first token at `first`, the others evenly up to `finished`."""
    times = [first] if n == 1 else [first + (finished - first) * i / (n - 1) for i in range(n)]
    return RequestRecord(rid, 8, n, arrival, first, finished, token_times=tuple(times), group=group)


SLO_2S_250MS = SLO(ttft_s=2.0, tpot_s=0.25)


def test_parse_takes_ttft_in_seconds_and_tpot_in_milliseconds():
    assert SLO.parse("ttft=2,tpot=250") == SLO_2S_250MS
    assert SLO.parse(" TPOT = 250 , ttft=2.0 ") == SLO_2S_250MS
    assert str(SLO.parse("ttft=2.5,tpot=300")) == "ttft=2.5,tpot=300"


@pytest.mark.parametrize("text", ["", "ttft=2", "tpot=300", "ttft=2,tpot=300,ttft=3", "ttft=2;tpot=300",
                                  "ttft=two,tpot=300", "ttft=0,tpot=300", "ttft=2,tpot=-1", "ttft=inf,tpot=300",
                                  "ttft=2,tpot=300,itl=5", "ttft 2, tpot 300"])
def test_parse_rejects_malformed_slos_with_the_usage(text):
    with pytest.raises(ValueError, match="ttft=SECONDS,tpot=MILLISECONDS"):
        SLO.parse(text)


def test_each_request_gets_one_verdict_and_attainment_counts_every_request_sent():
    records = [
        rec("met", 0.0, 1.0, 3.0, 9),            # TTFT 1 s, TPOT (3 - 1) / 8 = 0.25 s: both exactly met
        rec("slow-first", 1.0, 3.5, 4.0, 5),     # TTFT 2.5 s
        rec("slow-decode", 2.0, 2.5, 6.5, 9),    # TTFT 0.5 s, TPOT 0.5 s
        rec("one-token", 3.0, 4.0, 4.0, 1),      # no TPOT: judged on TTFT alone
        rec("one-token-late", 4.0, 7.0, 7.0, 1),
        rec("aborted", 5.0, 5.1, 5.2, 3),        # fast, but asked for 10 tokens and got 3
    ]
    asked = {r.request_id: r.output_len for r in records} | {"aborted": 10, "rejected": 4}
    report = evaluate(records, asked, SLO_2S_250MS)
    v = report.verdicts
    assert (v.sent, v.met, v.missed_ttft, v.missed_tpot, v.aborted, v.failed) == (7, 2, 2, 1, 1, 1)
    assert report.attainment == pytest.approx(2 / 7)
    assert report.duration_s == pytest.approx(7.0)           # first arrival 0 -> last finish 7
    assert report.goodput == pytest.approx(2 / 7.0)         # met requests per second
    by_id = {r.request_id: r for r in records}
    assert [verdict(by_id.get(rid), SLO_2S_250MS, n) for rid, n in asked.items()] == [
        "met", "missed_ttft", "missed_tpot", "met", "missed_ttft", "aborted", "failed"]


def test_tpot_is_decode_time_over_tokens_after_the_first_not_e2e_over_tokens():
    # e2e 3 s over 5 tokens = 0.6 s per token, but TTFT takes 2.6 of it: TPOT = 0.4 / 4 = 0.1 s
    r = rec("a", 0.0, 1.9, 2.3, 5)
    assert r.tpot == pytest.approx(0.1)
    assert meets(r, SLO(ttft_s=2.0, tpot_s=0.11), 5)
    assert not meets(r, SLO(ttft_s=2.0, tpot_s=0.09), 5)
    # a stream whose last chunk closes after its last token: TPOT counts up to the finish
    late_end = RequestRecord("b", 8, 3, 0.0, 1.0, 2.0, token_times=(1.0, 1.2, 1.4))
    assert late_end.tpot == pytest.approx(0.5) and not meets(late_end, SLO(2.0, 0.25), 3)


def test_latency_percentiles_cover_requests_that_finished_whole():
    records = [rec("a", 0.0, 1.0, 2.0, 3), rec("b", 0.0, 3.0, 5.0, 3), rec("cut", 0.0, 0.1, 0.2, 2)]
    report = evaluate(records, {"a": 3, "b": 3, "cut": 5}, SLO_2S_250MS)
    assert report.ttft.n == 2 and report.ttft.median == pytest.approx(2.0)
    assert report.tpot.n == 2 and report.tpot.median == pytest.approx(0.75)   # 0.5 and 1.0
    assert report.verdicts.aborted == 1


def test_groups_break_the_verdicts_down():
    records = [rec("c1", 0.0, 0.5, 1.0, 3, "chat"), rec("c2", 0.0, 0.5, 1.0, 3, "chat"),
               rec("L", 0.0, 9.0, 9.5, 2, "long")]
    asked = {"c1": 3, "c2": 3, "L": 2, "c3": 3}
    report = evaluate(records, asked, SLO_2S_250MS, groups={"c1": "chat", "c2": "chat", "L": "long", "c3": "chat"})
    assert report.by_group["chat"].sent == 3 and report.by_group["chat"].met == 2
    assert report.by_group["long"].attainment == 0.0
    d = report.as_dict()
    assert d["by_group"]["chat"]["attainment"] == pytest.approx(2 / 3) and d["failed"] == 1


def test_an_explicit_duration_and_a_run_where_nothing_finished():
    report = evaluate([rec("a", 0.0, 1.0, 1.5, 3)], {"a": 3}, SLO_2S_250MS, duration_s=4.0)
    assert report.goodput == pytest.approx(0.25)
    nothing = evaluate([], {"a": 3, "b": 3}, SLO_2S_250MS)
    assert nothing.attainment == 0.0 and nothing.verdicts.failed == 2 and math.isnan(nothing.goodput)
    assert math.isnan(evaluate([], {}, SLO_2S_250MS).attainment)


def test_records_of_requests_never_sent_are_an_error():
    with pytest.raises(ValueError, match="never sent"):
        evaluate([rec("ghost", 0.0, 1.0, 2.0, 3)], {"a": 3}, SLO_2S_250MS)


def test_goodput_headline_is_the_highest_rate_that_reached_the_target():
    points = [(0.5, 1.0), (1.0, 0.95), (2.0, 0.9), (4.0, 0.6), (8.0, float("nan"))]
    assert goodput_rate(points, 0.9) == 2.0
    assert goodput_rate(points, 0.96) == 0.5
    assert goodput_rate(points, 1.0) == 0.5
    assert goodput_rate([(1.0, 0.89), (2.0, 0.91)], 0.9) == 2.0   # not monotone: still the highest that passed
    assert goodput_rate([(1.0, 0.5)], 0.9) is None
    assert goodput_rate([(float("inf"), 1.0), (1.0, 1.0)], 0.9) == float("inf")
