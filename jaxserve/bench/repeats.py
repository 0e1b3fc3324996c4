"""Interleaved repeats: backends take turns N times on one workload; medians and ratios come out.

Our machines are shared, and their speed drifts by 15-20% over minutes. One run per backend,
minutes apart, measures the backends and the drift together. With `--repeats N` every backend
is built and warmed once and stays loaded (the one place two models share memory), then the
backends run in turn, N rounds: each round's runs are neighbours in time, and the summary gives
each backend's median output throughput and the median over rounds of the first backend's
throughput divided by each other backend's.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from jaxserve.bench.backend_base import BackendRun, RunOptions
from jaxserve.bench.metrics import summarize
from jaxserve.bench.session import Session, log
from jaxserve.bench.workloads import BenchRequest


def run_interleaved(session: Session, names: Sequence[str], requests: Sequence[BenchRequest],
                    warmup: Sequence[BenchRequest], options: RunOptions, config: dict[str, Any],
                    repeats: int) -> list[BackendRun]:
    """Runs labelled `label#k` (k = 1..repeats), in the order they ran; config["repeat"] = k."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    backends = []
    try:
        for name in names:
            backend = session.build(name)
            if backend is None:
                continue
            backends.append(backend)
            if not session.warm(backend, warmup):
                backends.pop().close()
        runs = []
        for k in range(1, repeats + 1):
            for backend in backends:
                log(f"round {k}/{repeats}: running {backend.label}")
                run = session.run(backend, requests, options, {**config, "repeat": k})
                if run is not None:
                    run.label = f"{run.label}#{k}"
                    runs.append(run)
        return runs
    finally:
        for backend in backends:
            backend.close()


def repeat_summary(runs: Sequence[BackendRun]) -> dict[str, Any]:
    """Per backend: output tok/s of each round and their median; per other backend: the first
    backend's output tok/s over its own, per round (rounds where both ran) and the median."""
    per_backend: dict[str, dict[int, float]] = {}
    for run in runs:
        tput = summarize(run.records, run.duration_s).output_throughput
        per_backend.setdefault(run.backend, {})[int(run.config["repeat"])] = tput
    if not per_backend:
        return {}
    first, *others = per_backend
    summary: dict[str, Any] = {
        "output_throughput": {
            name: {"per_round": [by_round[k] for k in sorted(by_round)],
                   "median": statistics.median(by_round.values())}
            for name, by_round in per_backend.items()
        },
        "reference": first,
        "ratio_of_reference": {},
    }
    for name in others:
        rounds = sorted(set(per_backend[first]) & set(per_backend[name]))
        ratios = [per_backend[first][k] / per_backend[name][k] for k in rounds if per_backend[name][k] > 0]
        summary["ratio_of_reference"][name] = {
            "per_round": ratios, "median": statistics.median(ratios) if ratios else None}
    return summary


def format_repeat_summary(summary: dict[str, Any]) -> str:
    if not summary:
        return ""
    lines = ["output tok/s by round (median):"]
    for name, d in summary["output_throughput"].items():
        lines.append(f"  {name:<12} " + ", ".join(f"{x:.1f}" for x in d["per_round"]) + f"  ({d['median']:.1f})")
    ref = summary["reference"]
    for name, d in summary["ratio_of_reference"].items():
        if d["median"] is not None:
            lines.append(f"{ref} / {name} by round: " + ", ".join(f"{x:.2f}x" for x in d["per_round"])
                         + f"  (median {d['median']:.2f}x)")
    return "\n".join(lines)
