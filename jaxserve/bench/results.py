"""One JSON file per benchmark invocation: config, environment, workload, and every backend's run.

Schema `jaxserve.bench/1`:
  {"schema", "subcommand", "created_utc", "config": {CLI arguments}, "environment": {...},
   "model": {"path", "kind", "files_sha256"}, "workload": {Workload.summary()},
   "runs": [{"backend", "label", "checkpoint_identity", "config", "metrics": BenchmarkMetrics,
             "engine_stats", "kv_usage", "notes", "agreement", "requests": [RequestRecord...]}],
   "extra": {subcommand-specific tables}}
"""

from __future__ import annotations

import datetime
import json
import math
import os
from typing import Any, Iterable, Sequence

from jaxserve.bench.backend_base import BackendRun
from jaxserve.bench.metrics import summarize

SCHEMA = "jaxserve.bench/1"


def _clean(x: Any) -> Any:
    """JSON has no NaN or inf: write them as null (inf request rates are written as "inf" upstream)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (str, int, bool)) or x is None or isinstance(x, float):
        return x
    return str(x)


def agreement(reference: dict[str, list[int]], other: dict[str, list[int]], stop_ids: Iterable[int] = ()) -> dict[str, Any]:
    """How many requests got identical greedy tokens, compared up to the first stop token of either.

    Backends treat a sampled EOS differently under "ignore EOS" (HF's min_new_tokens forbids it,
    others emit it and carry on), so tokens after the first EOS are not compared.
    """
    stops = set(stop_ids)
    common = sorted(set(reference) & set(other))
    same, prefix = 0, []
    for rid in common:
        a, b = reference[rid], other[rid]
        n = min(len(a), len(b))
        for i in range(n):
            if a[i] in stops or b[i] in stops:
                n = i
                break
        k = next((i for i in range(n) if a[i] != b[i]), n)
        same += k == n
        prefix.append(k / n if n else 1.0)
    return {"compared": len(common), "identical": same,
            "mean_matching_prefix": sum(prefix) / len(prefix) if prefix else float("nan")}


def run_to_json(run: BackendRun) -> dict[str, Any]:
    return {
        "backend": run.backend,
        "label": run.label,
        "checkpoint_identity": run.checkpoint_identity,
        "config": run.config,
        "metrics": summarize(run.records, run.duration_s).as_dict(),
        "engine_stats": run.engine_stats,
        "kv_usage": run.kv_usage,
        "notes": run.notes,
        "requests": [r.to_json() for r in run.records],
    }


def build_result(subcommand: str, config: dict[str, Any], environment: dict[str, Any], model: dict[str, Any],
                 workload: dict[str, Any], runs: Sequence[BackendRun], stop_ids: Iterable[int] = (),
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    stop_ids = list(stop_ids)
    out_runs = []
    for i, run in enumerate(runs):
        d = run_to_json(run)
        # compare with the earliest run of another backend (or another engine variant on the same
        # runner, e.g. without speculation) that served the same request ids
        ref = next((r for r in runs[:i] if (r.backend != run.backend or "shares_runner_of" in r.config)
                    and set(r.output_token_ids) & set(run.output_token_ids)), None)
        if ref is not None:
            d["agreement"] = {"reference": ref.label, **agreement(ref.output_token_ids, run.output_token_ids, stop_ids)}
        out_runs.append(d)
    return _clean({
        "schema": SCHEMA,
        "subcommand": subcommand,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": config,
        "environment": environment,
        "model": model,
        "workload": workload,
        "runs": out_runs,
        "extra": extra or {},
    })


def write_result(result: dict[str, Any], output_dir: str, stem: str | None = None) -> str:
    os.makedirs(output_dir, exist_ok=True)
    if stem is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        stem = f"{result['subcommand']}-{stamp}"
    path = os.path.join(output_dir, f"{stem}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, allow_nan=False)
    return path


def load_result(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a jaxserve benchmark result (schema {SCHEMA})")
    return d
