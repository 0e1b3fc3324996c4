"""`jaxserve plan --rate R --duration S`: how much concurrency a load needs, against what we measured.

Little's law: in a steady state, requests in the system L = arrival rate x mean time in system
(L = lambda W). So R requests/s lasting S seconds each keep about R x S requests in flight.

Against that we set the knee of the measured throughput-against-batch curve (from a
`jaxserve bench latency --batch-size 1,2,4,...` result): past the knee, more concurrency adds
latency but little throughput. The knee is found as in "Kneedle" (Satopaa et al., 2011): scale
both axes to [0, 1] and take the point farthest above the straight line from the first point to
the last. If L exceeds the knee batch, one engine runs past its knee: the plan says how many
engines keep each at or under it, and whether the token rate (R x output tokens) fits the
measured peak.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from jaxserve.bench.args import set_command
from jaxserve.bench.results import load_result


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="Little's law: concurrency for a request rate, against the measured knee")
    p.add_argument("--rate", type=float, required=True, help="arrival rate, requests/s")
    p.add_argument("--duration", type=float, required=True, help="mean time a request spends in the system, s")
    p.add_argument("--results", default=None, help="a `bench latency` result JSON with a batch-size sweep")
    p.add_argument("--backend", default="jaxserve", help="which backend's curve to use")
    p.add_argument("--output-len", type=float, default=None, help="mean output tokens per request (token-rate check)")
    set_command(p, run)
    return p


def knee(xs: list[float], ys: list[float]) -> int:
    """Index of the knee of an increasing, flattening curve (Kneedle; the last point if < 3 points)."""
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"need equally long, non-empty xs and ys, got {len(xs)} and {len(ys)}")
    if len(xs) < 3:
        return max(range(len(ys)), key=lambda i: ys[i])
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 == x0 or y1 == y0:
        return 0
    diff = [(y - y0) / (y1 - y0) - (x - x0) / (x1 - x0) for x, y in zip(xs, ys)]
    return max(range(len(diff)), key=lambda i: diff[i])


def plan(rate: float, duration: float, sweep: list[dict[str, Any]] | None = None,
         output_len: float | None = None) -> dict[str, Any]:
    if not rate > 0 or not duration > 0:
        raise ValueError(f"rate and duration must be > 0, got {rate} and {duration}")
    out: dict[str, Any] = {"rate": rate, "duration_s": duration, "concurrency": rate * duration}
    if output_len is not None:
        out["token_rate_needed"] = rate * output_len
    if sweep:
        pts = sorted(sweep, key=lambda p: p["batch_size"])
        xs = [p["batch_size"] for p in pts]
        ys = [p["output_tok_s"] for p in pts]
        k = knee(xs, ys)
        out.update({"knee_batch": xs[k], "knee_output_tok_s": ys[k], "peak_output_tok_s": max(ys),
                    "engines_at_knee": max(1, math.ceil(out["concurrency"] / xs[k]))})
        if output_len is not None:
            out["engines_for_token_rate"] = max(1, math.ceil(out["token_rate_needed"] / ys[k]))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    sweep = None
    if args.results:
        res = load_result(args.results)
        curves = (res.get("extra") or {}).get("latency_sweep") or {}
        if args.backend not in curves:
            raise SystemExit(f"{args.results} has no latency sweep for {args.backend!r} (has: {sorted(curves)})")
        sweep = curves[args.backend]
    p = plan(args.rate, args.duration, sweep, args.output_len)
    print(f"Little's law: {p['rate']:g} req/s x {p['duration_s']:g} s = {p['concurrency']:.1f} requests in flight")
    if "knee_batch" in p:
        print(f"measured knee ({args.backend}): batch {p['knee_batch']} at {p['knee_output_tok_s']:.1f} output tok/s "
              f"(peak {p['peak_output_tok_s']:.1f})")
        verdict = "fits one engine" if p["engines_at_knee"] == 1 else f"needs {p['engines_at_knee']} engines"
        print(f"concurrency {p['concurrency']:.1f} against knee {p['knee_batch']}: {verdict} at or under the knee")
    if "token_rate_needed" in p:
        print(f"token rate needed: {p['token_rate_needed']:.1f} output tok/s"
              + (f" -> {p['engines_for_token_rate']} engine(s) at the knee's rate" if "engines_for_token_rate" in p else ""))
    if sweep is None:
        print("(give --results LATENCY_SWEEP.json to compare with a measured knee)")
    return p
