"""PNG plots of a result (matplotlib, Agg backend: no display needed).

Each function takes a result dict (results.py) and a path, draws one figure, and returns the path.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np


def available() -> bool:
    """Whether matplotlib (the `bench` extra: `pip install 'jaxserve[bench]'`) is installed."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_bars(result: dict[str, Any], path: str) -> str:
    plt = _pyplot()
    runs = result["runs"]
    labels = [r["label"] for r in runs]
    out = [r["metrics"]["output_throughput"] for r in runs]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(runs) + 2), 4))
    bars = ax.bar(range(len(runs)), out, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f")
    ax.set_xticks(range(len(runs)), labels, rotation=20, ha="right")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['subcommand']}: output throughput ({result['workload'].get('num_requests', '?')} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def latency_cdfs(result: dict[str, Any], path: str) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for run in result["runs"]:
        reqs = run["requests"]
        samples = {
            "TTFT (s)": [r["first_token_time"] - r["arrival_time"] for r in reqs],
            "end-to-end latency (s)": [r["finished_time"] - r["arrival_time"] for r in reqs],
            "inter-token latency (ms)": [1000 * (b - a) for r in reqs for a, b in zip(r["token_times"], r["token_times"][1:])],
        }
        for ax, (name, xs) in zip(axes, samples.items()):
            if xs:
                x = np.sort(np.asarray(xs))
                ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=run["label"])
            ax.set_xlabel(name)
    for ax in axes:
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(f"{result['subcommand']}: latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def ttft_vs_rate(result: dict[str, Any], path: str) -> str:
    """Mean and p99 TTFT of each backend against the request rate of its runs."""
    plt = _pyplot()
    series: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for run in result["runs"]:
        rate = run["config"].get("request_rate")
        x = float("inf") if rate in (None, "inf") else float(rate)
        ttft = run["metrics"]["ttft"]
        series[run["backend"]].append((x, ttft["mean"] or 0.0, ttft["p99"] or 0.0))
    finite = [x for pts in series.values() for x, _, _ in pts if np.isfinite(x)]
    inf_at = (max(finite) * 1.5) if finite else 1.0  # "inf" drawn to the right of the largest rate
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in series.items():
        pts = sorted((x if np.isfinite(x) else inf_at, m, p) for x, m, p in pts)
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1] for p in pts], marker="o", label=f"{name} mean")
        ax.plot(xs, [p[2] for p in pts], marker="x", linestyle="--", label=f"{name} p99")
    ax.set_xlabel("request rate (req/s; rightmost point = inf if present)")
    ax.set_ylabel("TTFT (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("time to first token against request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def attainment_vs_rate(result: dict[str, Any], path: str) -> str:
    """SLO attainment of each target (server or engine variant) against the request rate, the
    attainment target as a dotted line and each target's goodput (the highest rate at or above it)
    in the legend (result["extra"]["goodput"], cmd_serve.py)."""
    plt = _pyplot()
    gp = result["extra"]["goodput"]
    curves = {name: sorted((float(p["rate"]), p["attainment"]) for p in t["points"] if p.get("attainment") is not None)
              for name, t in gp["targets"].items()}
    finite = [x for pts in curves.values() for x, _ in pts if np.isfinite(x)]
    inf_at = (max(finite) * 1.5) if finite else 1.0  # "inf" drawn to the right of the largest rate
    fig, ax = plt.subplots(figsize=(7, 4))
    markers = "osD^vP"
    for i, (name, pts) in enumerate(curves.items()):
        g = gp["targets"][name]["goodput_rate"]
        xs = [x if np.isfinite(x) else inf_at for x, _ in pts]
        # variants often tie (100% at low rates): each later one drawn smaller, so none hides another
        ax.plot(xs, [100 * a for _, a in pts], marker=markers[i % len(markers)], markersize=max(3.0, 10.0 - 2 * i),
                alpha=0.85, label=f"{name} (goodput {g if g is not None else 'none'})")
    ax.axhline(100 * gp["attainment_target"], color="grey", linestyle=":",
               label=f"target {100 * gp['attainment_target']:g}%")
    if finite and min(finite) > 0 and max(finite) / min(finite) > 4:
        ax.set_xscale("log")   # searches and doubling sweeps spread rates over ratios
    slo = gp["slo"]
    has_inf = any(not np.isfinite(x) for pts in curves.values() for x, _ in pts)
    ax.set_xlabel("request rate (req/s" + ("; rightmost point = inf)" if has_inf else ")"))
    ax.set_ylabel("requests meeting the SLO (%)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(f"SLO attainment: TTFT <= {slo['ttft_s']:g} s, TPOT <= {1e3 * slo['tpot_s']:g} ms "
                 f"({result['workload'].get('name', '?')})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


LOG_SCALE_SPREAD = 30   # bar charts whose values span more than this factor get a log y axis


def wants_log_scale(values: list[float | None]) -> bool:
    present = [v for v in values if v is not None]
    return bool(present) and min(present) > 0 and max(present) / min(present) > LOG_SCALE_SPREAD


def grouped_bars(title: str, ylabel: str, labels: list[str], series: dict[str, list[float]], path: str) -> str:
    """One group of bars per label, one bar per series (interference and prefix tables)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(labels) + 2), 4))
    width = 0.8 / max(len(series), 1)
    for i, (name, ys) in enumerate(series.items()):
        xs = np.arange(len(labels)) + i * width
        bars = ax.bar(xs, [y if y is not None else 0.0 for y in ys], width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize="x-small")
    ax.set_xticks(np.arange(len(labels)) + width * (len(series) - 1) / 2, labels, rotation=15, ha="right")
    if wants_log_scale([y for ys in series.values() for y in ys]):
        ax.set_yscale("log")   # else the small bars (the ones that matter) are invisible
        ylabel += " (log scale)"
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def curve(title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list[float], list[float]]], path: str,
          mark_x: float | None = None) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    if mark_x is not None:
        ax.axvline(mark_x, color="grey", linestyle=":", label=f"knee = {mark_x:g}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
