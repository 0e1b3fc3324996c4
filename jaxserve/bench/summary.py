"""The text summary printed after each run, laid out like vLLM's serving benchmark output."""

from __future__ import annotations

import math
from typing import Any

_W = 50


def _rule(title: str = "", ch: str = "-") -> str:
    return f" {title} ".center(_W, ch) if title else ch * _W


def _row(name: str, value: Any, fmt: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        text = "n/a"
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        text = str(value) if isinstance(value, int) else fmt.format(value)
    else:
        text = str(value)
    return f"{name + ':':<40}{text:>10}"


def _latency_block(title: str, key: str, stats: dict[str, Any]) -> list[str]:
    ms = lambda v: None if v is None else v * 1000.0  # noqa: E731
    return [_rule(title),
            _row(f"Mean {key} (ms)", ms(stats.get("mean"))),
            _row(f"Median {key} (ms)", ms(stats.get("median"))),
            _row(f"P99 {key} (ms)", ms(stats.get("p99")))]


def format_run(run: dict[str, Any]) -> str:
    """`run` is one entry of a result's "runs" (see results.py)."""
    m = run["metrics"]
    lines = [_rule(f"{run['label']} benchmark result", "="),
             _row("Successful requests", m["completed"]),
             _row("Benchmark duration (s)", m["duration_s"]),
             _row("Total input tokens", m["total_prompt_tokens"]),
             _row("Total generated tokens", m["total_output_tokens"]),
             _row("Request throughput (req/s)", m["request_throughput"]),
             _row("Output token throughput (tok/s)", m["output_throughput"]),
             _row("Total token throughput (tok/s)", m["total_throughput"])]
    if m.get("num_cached_tokens"):
        lines.append(_row("Prefix cache hit rate (%)", 100.0 * m["prefix_hit_rate"]))
    lines += _latency_block("Time to First Token", "TTFT", m["ttft"])
    lines += _latency_block("Time per Output Token (excl. 1st)", "TPOT", m["tpot"])
    lines += _latency_block("Inter-token Latency", "ITL", m["itl"])
    lines += _latency_block("End-to-end Latency", "E2E", m["e2e"])
    kv = run.get("kv_usage") or {}
    if kv.get("num_samples"):
        lines += [_rule("KV cache"),
                  _row("Mean utilisation (live/allocated %)", 100.0 * kv["utilization_mean"]),
                  _row("Peak blocks used", kv["peak_used_blocks"]),
                  _row("Reserve prompt+max_tokens (blocks)", kv["reserve_request_max_blocks"]),
                  _row("Reserve max_model_len (blocks)", kv["reserve_max_model_len_blocks"])]
    stats = run.get("engine_stats") or {}
    steps = stats.get("steps", stats)    # nested since the stats' parts; a result written before is flat
    if "num_compilations_after_warmup" in steps:
        lines.append(_row("Compilations after warmup", steps["num_compilations_after_warmup"]))
    agree = run.get("agreement")
    if agree:
        lines.append(_row(f"Identical greedy outputs vs {agree['reference']}",
                          f"{agree['identical']}/{agree['compared']}"))
    lines.append(_rule(ch="="))
    return "\n".join(lines)


def format_result(result: dict[str, Any]) -> str:
    return "\n\n".join(format_run(r) for r in result["runs"])
