"""`jaxserve bench report RESULTS...`: a markdown table from result JSON files.

One row per run: throughput, TTFT / TPOT / ITL / E2E, prefix hit rate and KV utilisation,
followed by each file's subcommand-specific table (prefix ratios, interference targets, latency
sweep) where present. Written to stdout, and to `--output` when given.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from jaxserve.bench.args import set_command
from jaxserve.bench.results import load_result


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="markdown table from result JSON files")
    p.add_argument("results", nargs="+", help="result JSON files written by `jaxserve bench ...`")
    p.add_argument("--output", default=None, help="also write the markdown here")
    set_command(p, run)


def _f(v: Any, scale: float = 1.0, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v * scale:.{digits}f}"


def _load(pair: Any) -> str:
    """1-minute load average before -> after the run (the machine's other work skews every number)."""
    if not pair or None in pair:
        return "n/a"
    return f"{pair[0][0]:.1f}->{pair[1][0]:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"] + \
        ["| " + " | ".join(r) + " |" for r in rows]


def runs_table(results: list[tuple[str, dict[str, Any]]]) -> list[str]:
    header = ["result", "run", "requests", "duration s", "req/s", "output tok/s", "total tok/s",
              "TTFT mean ms", "TTFT p99 ms", "TPOT median ms", "ITL p50 ms", "ITL p99 ms", "E2E mean s",
              "prefix hit %", "KV util %", "same tokens", "load avg"]
    rows = []
    for name, res in results:
        for run in res["runs"]:
            m, kv, ag = run["metrics"], run.get("kv_usage") or {}, run.get("agreement")
            rows.append([
                name, run["label"], str(m["completed"]), _f(m["duration_s"], 1, 2), _f(m["request_throughput"], 1, 3),
                _f(m["output_throughput"]), _f(m["total_throughput"]), _f(m["ttft"]["mean"], 1e3),
                _f(m["ttft"]["p99"], 1e3), _f(m["tpot"]["median"], 1e3), _f(m["itl"]["median"], 1e3),
                _f(m["itl"]["p99"], 1e3), _f(m["e2e"]["mean"], 1, 2), _f(m.get("prefix_hit_rate"), 100),
                _f(kv.get("utilization_mean"), 100) if kv.get("num_samples") else "n/a",
                f"{ag['identical']}/{ag['compared']} vs {ag['reference']}" if ag else "",
                _load(run["config"].get("load_average_before_after")),
            ])
    return _table(header, rows)


def extra_tables(name: str, res: dict[str, Any]) -> list[str]:
    extra, out = res.get("extra") or {}, []
    if "prefix_table" in extra:
        rows = [[k, _f(v["ttft_mean_s"], 1e3), _f(v["ttft_p99_s"], 1e3), _f(v["output_tok_s"]),
                 _f(v["prefix_hit_rate"], 100)] for k, v in extra["prefix_table"].items()]
        out += ["", f"**{name}: prefix cache**", ""] + _table(
            ["variant", "TTFT mean ms", "TTFT p99 ms", "output tok/s", "hit %"], rows)
        out += [f"- {k}: {_f(v, 1, 2)}" for k, v in (extra.get("ratios") or {}).items()]
        ps = extra.get("parallel_sampling") or {}
        if len(ps) > 2:
            out.append(f"- parallel sampling (n={ps.get('n')}, prompt {ps.get('prompt_len')} tokens), peak KV blocks: "
                       + ", ".join(f"{k}: {v.get('peak_blocks', v.get('error'))}" for k, v in ps.items()
                                   if isinstance(v, dict)))
    if "interference_table" in extra:
        rows = [[k, _f(v["chat_itl_p50_s"], 1e3), _f(v["chat_itl_p99_s"], 1e3), _f(v["long_ttft_mean_s"], 1, 2),
                 _f(v["long_ttft_max_s"], 1, 2)] for k, v in extra["interference_table"].items()]
        out += ["", f"**{name}: interference**", ""] + _table(
            ["variant", "chat ITL p50 ms", "chat ITL p99 ms", "long TTFT mean s", "long TTFT max s"], rows)
        out += [f"- {k}: {v if isinstance(v, bool) else _f(v, 1, 2)}" for k, v in (extra.get("targets") or {}).items()]
    for backend, points in (extra.get("latency_sweep") or {}).items():
        rows = [[str(p["batch_size"]), _f(p["latency_mean_s"], 1, 3), _f(p["tpot_median_s"], 1e3),
                 _f(p["output_tok_s"])] for p in points]
        out += ["", f"**{name}: {backend} latency by batch size**", ""] + _table(
            ["batch", "latency mean s", "TPOT median ms", "output tok/s"], rows)
    for s in extra.get("skipped") or []:
        out.append(f"- {name}: skipped {s['backend']}: {s['reason']}")
    return out


def render(paths: list[str]) -> str:
    results = [(os.path.basename(p), load_result(p)) for p in paths]
    lines = runs_table(results)
    for name, res in results:
        lines += extra_tables(name, res)
    env = {(r["environment"].get("cpu"), r["environment"].get("cpu_count"),
            tuple(r["environment"].get("accelerators") or ())) for _, r in results}
    ids = sorted({run["checkpoint_identity"] for _, r in results for run in r["runs"]})
    lines += ["", "Machines: " + "; ".join(f"{c} ({n} CPUs){' + ' + ', '.join(a) if a else ''}" for c, n, a in env),
              "Checkpoints: " + ", ".join(ids)]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> str:
    text = render(args.results)
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    return text
