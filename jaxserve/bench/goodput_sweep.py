"""A goodput sweep: each target (a gRPC server, or an engine variant in process) at each request
rate, judged against one SLO (slo.py).

The rates come from a RatePlan (rate_search.py). A fixed list runs every target at every rate; a
search bisects per target. Either way the targets take turns at each step (rate i, or probe k),
all on the same workload for that step, so targets that are compared ran minutes apart at most
on the same requests and the same arrival pattern (a shared machine drifts over minutes).

A target is anything with a name and a `run(workload) -> TargetRun`; this module never looks at
clocks, so the whole sweep is tested on fake targets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from jaxserve.bench.backend_base import BackendRun
from jaxserve.bench.rate_search import RatePlan, RateSearch
from jaxserve.bench.slo import SLO, SLOReport, evaluate, goodput_rate
from jaxserve.bench.workloads import Workload


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


@dataclass(slots=True)
class TargetRun:
    run: BackendRun | None                              # None: no request finished, or the run failed
    failed: Mapping[str, str] = field(default_factory=dict)   # request id -> why it has no record


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    run: Callable[[Workload, float], TargetRun]         # (workload with arrivals, its rate)


@dataclass(frozen=True, slots=True)
class RatePoint:
    rate: float
    report: SLOReport | None     # None: the sweep has no SLO (rates only)

    def as_dict(self) -> dict[str, Any]:
        return {"rate": _rate_json(self.rate), **(self.report.as_dict() if self.report is not None else {})}


@dataclass
class SweepResult:
    slo: SLO | None
    target_attainment: float
    plan: RatePlan
    runs: list[BackendRun] = field(default_factory=list)
    points: dict[str, list[RatePoint]] = field(default_factory=dict)
    searches: dict[str, RateSearch] = field(default_factory=dict)

    def goodput(self, name: str) -> float | None:
        """The headline: the highest rate this target ran with attainment >= the target."""
        return goodput_rate([(p.rate, p.report.attainment) for p in self.points.get(name, []) if p.report],
                            self.target_attainment)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"slo": self.slo.as_dict() if self.slo else None,
                               "attainment_target": self.target_attainment,
                               "request_rate": str(self.plan), "targets": {}}
        for name, pts in self.points.items():
            g = self.goodput(name)
            out["targets"][name] = {
                "goodput_rate": None if g is None else _rate_json(g),
                "points": [p.as_dict() for p in pts],
                **({"search": self.searches[name].as_dict()} if name in self.searches else {})}
        return out


def judge(workload: Workload, result: TargetRun, slo: SLO) -> SLOReport:
    asked = {r.request_id: r.output_len for r in workload.requests}
    groups = {r.request_id: r.group for r in workload.requests if r.group}
    records = result.run.records if result.run is not None else []
    duration = result.run.duration_s if result.run is not None else 0.0
    return evaluate(records, asked, slo, duration, groups)


def sweep(targets: Sequence[Target], plan: RatePlan, workload_at: Callable[[float, int], Workload],
          slo: SLO | None, target_attainment: float = 0.9, max_probes: int = 6,
          on_point: Callable[[str, RatePoint], None] | None = None) -> SweepResult:
    """`workload_at(rate, step)`: the requests of step `step` (same for every target) with their
    arrival times at `rate`. Without an SLO the runs are only collected (and a search is refused).
    `on_point` hears of every point as it is measured (progress)."""
    if plan.search is not None and slo is None:
        raise ValueError("a rate search needs an SLO to judge its probes")
    result = SweepResult(slo, target_attainment, plan, points={t.name: [] for t in targets})

    def one(t: Target, rate: float, step: int) -> float:
        wl = workload_at(rate, step)
        tr = t.run(wl, rate)
        if tr.run is not None:
            # one series per target (plots group runs by backend), one label per run
            tr.run.backend = t.name
            tr.run.label = f"{t.name}@{'inf' if math.isinf(rate) else rate}"
            tr.run.config["failed_requests"] = dict(tr.failed)
            result.runs.append(tr.run)
        point = RatePoint(rate, judge(wl, tr, slo) if slo is not None else None)
        result.points[t.name].append(point)
        if on_point is not None:
            on_point(t.name, point)
        return point.report.attainment if point.report is not None else math.nan

    if plan.search is None:
        for step, rate in enumerate(plan.rates):
            for t in targets:
                one(t, rate, step)
        return result
    low, high = plan.search
    result.searches = {t.name: RateSearch(low, high, target_attainment, max_probes) for t in targets}
    for step in range(max_probes):
        for t in targets:
            s = result.searches[t.name]
            rate = s.next_rate()
            if rate is not None:
                s.observe(rate, one(t, rate, step))
    return result


def format_sweep(result: SweepResult) -> str:
    """The per-rate table and the goodput headline of each target, for the terminal."""
    ms = lambda v: "n/a" if v != v else f"{v * 1e3:.0f}"    # noqa: E731
    s = lambda v: "n/a" if v != v else f"{v:.2f}"            # noqa: E731
    if result.slo is None:
        return ""
    lines = [f"SLO {result.slo} (TTFT s, TPOT ms); goodput = highest rate with attainment >= "
             f"{result.target_attainment:.0%}",
             f"{'target':<16}{'rate':>8}{'attain':>8}{'goodput':>9}{'TTFT p50/p99 s':>17}{'TPOT p50/p99 ms':>18}"
             f"{'failed':>8}{'aborted':>8}"]
    for name, pts in result.points.items():
        for p in sorted(pts, key=lambda p: p.rate):
            r = p.report
            if r is None:
                continue
            rate = "inf" if math.isinf(p.rate) else f"{p.rate:g}"
            lines.append(f"{name:<16}{rate:>8}{r.attainment:>8.0%}{s(r.goodput):>9}"
                         f"{s(r.ttft.median) + ' / ' + s(r.ttft.p99):>17}"
                         f"{ms(r.tpot.median) + ' / ' + ms(r.tpot.p99):>18}"
                         f"{r.verdicts.failed:>8}{r.verdicts.aborted:>8}")
    for name in result.points:
        g = result.goodput(name)
        lines.append(f"goodput of {name}: " + ("none of its rates met the target" if g is None else
                                               f"{'inf' if math.isinf(g) else f'{g:g}'} req/s"))
    return "\n".join(lines)
