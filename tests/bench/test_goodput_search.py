"""Rate plans, the goodput bisection and the sweep that takes turns between targets, on fake
targets whose attainment falls with the rate: timings come from a formula, never from a clock."""

import math

import pytest

from jaxserve.bench.backend_base import BackendRun
from jaxserve.bench.goodput_sweep import Target, TargetRun, format_sweep, sweep
from jaxserve.bench.metrics import RequestRecord
from jaxserve.bench.rate_search import RatePlan, RateSearch
from jaxserve.bench.slo import SLO
from jaxserve.bench.workloads import BenchRequest, Workload


def test_rate_plans_parse_lists_and_searches():
    assert RatePlan.parse("1,2,inf").rates == (1.0, 2.0, math.inf)
    assert RatePlan.parse("0.5").rates == (0.5,)
    assert RatePlan.parse("search:0.25:4").search == (0.25, 4.0)
    assert str(RatePlan.parse("search:0.25:4")) == "search:0.25:4" and str(RatePlan.parse("1,inf")) == "1,inf"


@pytest.mark.parametrize("text, why", [("", "comma-separated"), ("1,,2", "comma-separated"), ("0", "comma-separated"),
                                       ("fast", "comma-separated"), ("search:1", "search:LOW:HIGH"),
                                       ("search:4:1", "0 < LOW < HIGH"), ("search:0:1", "0 < LOW < HIGH"),
                                       ("search:1:inf", "0 < LOW < HIGH"), ("search:1:2:3", "0 < LOW < HIGH"),
                                       ("search:a:b", "search:LOW:HIGH")])
def test_malformed_rate_plans_are_refused_with_the_usage(text, why):
    with pytest.raises(ValueError, match=why):
        RatePlan.parse(text)


def run_search(attainment_at, low=0.25, high=8.0, probes=6, target=0.9):
    s = RateSearch(low, high, target, probes)
    while (rate := s.next_rate()) is not None:
        s.observe(rate, attainment_at(rate))
    return s


def falling(boundary):
    """Attainment 1 up to `boundary`, then falling with the rate (below the target at once)."""
    return lambda rate: 1.0 if rate <= boundary else 0.8 * boundary / rate


@pytest.mark.parametrize("boundary", [0.3, 0.9, 1.7, 3.3, 7.0])
def test_the_search_brackets_the_highest_passing_rate_within_its_probes(boundary):
    s = run_search(falling(boundary))
    rates = [r for r, _ in s.probes]
    assert rates[:2] == [0.25, 8.0] and len(rates) <= 6
    lo, hi = s.passing, s.failing
    assert lo <= boundary < hi                      # the answer was measured, and is not optimistic
    assert hi / lo <= (8.0 / 0.25) ** (1 / 2 ** (len(rates) - 2)) * 1.01   # halves the log-bracket per probe
    assert s.as_dict()["goodput_rate"] == lo


def test_the_search_stops_at_once_when_low_fails_or_high_passes():
    below = run_search(lambda rate: 0.5)
    assert [r for r, _ in below.probes] == [0.25] and below.passing is None
    above = run_search(lambda rate: 1.0)
    assert [r for r, _ in above.probes] == [0.25, 8.0] and above.passing == 8.0 and above.failing is None


def test_the_search_stops_when_the_bracket_is_fine_enough_and_counts_nan_as_a_miss():
    s = run_search(falling(1.0), low=1.0, high=1.1, probes=20)
    assert [r for r, _ in s.probes] == [1.0, 1.1]     # 1.1 / 1.0 is within the resolution
    s = run_search(lambda rate: float("nan"))
    assert s.passing is None and len(s.probes) == 1


@pytest.mark.parametrize("kw", [dict(low=2, high=1), dict(low=0, high=1), dict(low=1, high=math.inf),
                                dict(low=1, high=2, target=0), dict(low=1, high=2, max_probes=1),
                                dict(low=1, high=2, resolution=1.0)])
def test_the_search_refuses_what_it_cannot_do(kw):
    with pytest.raises(ValueError):
        RateSearch(**kw)


# -- the sweep, on fake targets ----------------------------------------------------------------------

def fake_workload(rate, step, n=10):
    reqs = tuple(BenchRequest(f"r{i}@{step}", (1, 2, 3), 5, arrival_offset=0.0 if math.isinf(rate) else i / rate)
                 for i in range(n))
    return Workload("fake", reqs)


class FakeServer:
    """TTFT grows with the rate past `capacity` (requests/s), for request i by (i / n) x overload:
    the later a request comes in an overloaded run, the longer it queues. TPOT is 50 ms."""

    def __init__(self, name, capacity, fail_every=0):
        self.name, self.capacity, self.fail_every = name, capacity, fail_every
        self.seen = []

    def run(self, wl, rate):
        self.seen.append((rate, tuple(r.request_id for r in wl.requests)))
        n = len(wl.requests)
        overload = max(0.0, rate / self.capacity - 1.0) if math.isfinite(rate) else 10.0
        records, failed = [], {}
        for i, r in enumerate(wl.requests):
            if self.fail_every and i % self.fail_every == 0:
                failed[r.request_id] = "RESOURCE_EXHAUSTED"
                continue
            arrival = 100.0 + r.arrival_offset
            first = arrival + 0.5 + 20.0 * overload * i / n
            finished = first + 0.05 * (r.output_len - 1)
            records.append(RequestRecord(r.request_id, 3, r.output_len, arrival, first, finished))
        duration = max(x.finished_time for x in records) - min(x.arrival_time for x in records)
        return TargetRun(BackendRun("fake", "fake", records, duration, "sha256:fake"), failed)

    def target(self):
        return Target(self.name, self.run)


SLO_2S_100MS = SLO(2.0, 0.1)


def test_a_rate_list_runs_every_target_at_every_rate_on_the_same_requests():
    a, b = FakeServer("a", capacity=1.0), FakeServer("b", capacity=4.0)
    res = sweep([a.target(), b.target()], RatePlan.parse("0.5,2,8"), fake_workload, SLO_2S_100MS)
    assert a.seen == b.seen and [r for r, _ in a.seen] == [0.5, 2.0, 8.0]
    att = {n: [p.report.attainment for p in pts] for n, pts in res.points.items()}
    # a at 2 req/s: overload 1, request i waits 0.5 + 20 i / 10 s: only i = 0 is within 2 s
    assert att["a"] == [1.0, pytest.approx(0.1), pytest.approx(0.1)]
    assert att["b"][:2] == [1.0, 1.0] and att["b"][2] < 0.9
    assert res.goodput("a") == 0.5 and res.goodput("b") == 2.0
    assert [r.label for r in res.runs] == ["a@0.5", "b@0.5", "a@2.0", "b@2.0", "a@8.0", "b@8.0"]
    assert {r.backend for r in res.runs} == {"a", "b"}          # one plot series per target
    d = res.as_dict()
    assert d["targets"]["b"]["goodput_rate"] == 2.0 and d["slo"] == {"ttft_s": 2.0, "tpot_s": 0.1}
    assert d["targets"]["a"]["points"][1]["met"] == 1
    assert "goodput of b: 2 req/s" in format_sweep(res)


def test_a_search_per_target_takes_turns_and_finds_each_targets_goodput():
    a, b = FakeServer("a", capacity=1.0), FakeServer("b", capacity=3.0)
    res = sweep([a.target(), b.target()], RatePlan.parse("search:0.25:16"), fake_workload, SLO_2S_100MS,
                target_attainment=0.9, max_probes=7)
    # attainment at rate r is the share of i with 0.5 + 20 (r / c - 1) i / 10 <= 2: all 10 while r <= 1.075 c
    for server, c in ((a, 1.0), (b, 3.0)):
        lo, hi = res.searches[server.name].passing, res.searches[server.name].failing
        assert lo <= 1.075 * c < hi and hi / lo < 1.3
        assert res.goodput(server.name) == lo
        assert [r for r, _ in server.seen][:2] == [0.25, 16.0]
    # probe k of every target ran the same prompts (step k), at each target's own rate
    assert [ids for _, ids in a.seen] == [ids for _, ids in b.seen][:len(a.seen)]
    assert res.as_dict()["targets"]["a"]["search"]["probes"][0] == {"rate": 0.25, "attainment": 1.0}


def test_failed_requests_are_misses_and_are_recorded_on_the_run():
    s = FakeServer("s", capacity=100.0, fail_every=4)          # requests 0, 4, 8 of 10 rejected
    res = sweep([s.target()], RatePlan.parse("1"), fake_workload, SLO_2S_100MS)
    report = res.points["s"][0].report
    assert report.verdicts.failed == 3 and report.attainment == pytest.approx(0.7)
    assert res.goodput("s") is None
    assert sorted(res.runs[0].config["failed_requests"]) == ["r0@0", "r4@0", "r8@0"]


def test_a_run_that_fails_whole_counts_every_request_as_a_miss_and_a_search_needs_an_slo():
    broken = Target("broken", lambda wl, rate: TargetRun(None))
    res = sweep([broken], RatePlan.parse("search:1:4"), fake_workload, SLO_2S_100MS)
    assert [p.report.verdicts.failed for p in res.points["broken"]] == [10] and res.runs == []
    with pytest.raises(ValueError, match="needs an SLO"):
        sweep([broken], RatePlan.parse("search:1:4"), fake_workload, None)
    plain = sweep([FakeServer("s", 1.0).target()], RatePlan.parse("1,2"), fake_workload, None)
    assert [p.report for p in plain.points["s"]] == [None, None] and len(plain.runs) == 2
