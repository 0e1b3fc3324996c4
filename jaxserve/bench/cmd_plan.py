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

The transfer rule (disaggregated prefill and decode, `--link-gbps`): a prompt of L tokens moves
L x (KV bytes per token) from the prefill engine to the decode engine, where KV bytes per token =
2 (K and V) x layers x KV heads x head size x bytes per element, from the model's config. At a
link of B Gbit/s that takes L x bytes / (B / 8 x 1e9) s, plus the link's per-transfer latency.
Disaggregation pays when that is a small share of the latency target (rule of thumb: under 5%);
the plan gives the time and share per prompt length and the longest prompt under 5%.
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
    t = p.add_argument_group("KV transfer (disaggregated prefill and decode)")
    t.add_argument("--link-gbps", type=float, default=None, help="link bandwidth between prefill and decode engines")
    t.add_argument("--link-latency-ms", type=float, default=0.5, help="fixed cost of one transfer (handshake, RTTs)")
    t.add_argument("--model-config", default=None,
                   help="the model's HF config.json (or its directory), for KV bytes per token")
    t.add_argument("--kv-bytes-per-element", type=float, default=2.0,
                   help="2 for bfloat16, 4 for float32, 1 for an fp8/int8 KV cache")
    t.add_argument("--kv-bytes-per-token", type=float, default=None, help="instead of --model-config")
    t.add_argument("--latency-target-ms", type=float, default=1000.0, help="the TTFT target the transfer is part of")
    t.add_argument("--prompt-lens", default="128,512,2048,8192,32768", help="prompt lengths to tabulate")
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


PAYS_SHARE = 0.05      # the rule of thumb: the transfer under 5% of the latency target


def kv_bytes_per_token(config: dict[str, Any], bytes_per_element: float) -> float:
    """2 (K and V) x layers x KV heads x head size x bytes per element, from an HF config."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * bytes_per_element


def transfer_plan(bytes_per_token: float, link_gbps: float, latency_target_s: float, prompt_lens: list[int],
                  link_latency_s: float = 0.0) -> dict[str, Any]:
    """Transfer time and its share of the latency target per prompt length, and a verdict."""
    if not bytes_per_token > 0 or not link_gbps > 0 or not latency_target_s > 0 or link_latency_s < 0:
        raise ValueError(f"need bytes per token, link Gbit/s and latency target > 0, got {bytes_per_token}, "
                         f"{link_gbps}, {latency_target_s}")
    bytes_per_s = link_gbps / 8 * 1e9
    rows = []
    for n in prompt_lens:
        seconds = link_latency_s + n * bytes_per_token / bytes_per_s
        share = seconds / latency_target_s
        verdict = "pays" if share < PAYS_SHARE else ("marginal" if share < 4 * PAYS_SHARE else "does not pay")
        rows.append({"prompt_len": n, "bytes": n * bytes_per_token, "transfer_s": seconds, "share": share,
                     "verdict": verdict})
    budget = PAYS_SHARE * latency_target_s - link_latency_s
    longest = max(0, math.floor(budget * bytes_per_s / bytes_per_token)) if budget > 0 else 0
    return {"kv_bytes_per_token": bytes_per_token, "link_gbps": link_gbps, "latency_target_s": latency_target_s,
            "rows": rows, "longest_prompt_that_pays": longest}


def _bytes_per_token(args: argparse.Namespace) -> float | None:
    if args.kv_bytes_per_token is not None:
        return args.kv_bytes_per_token
    if args.model_config is None:
        return None
    import json
    import os

    path = os.path.join(args.model_config, "config.json") if os.path.isdir(args.model_config) else args.model_config
    with open(path) as f:
        return kv_bytes_per_token(json.load(f), args.kv_bytes_per_element)


def _print_transfer(t: dict[str, Any]) -> None:
    print(f"KV transfer: {t['kv_bytes_per_token']:.0f} bytes/token over {t['link_gbps']:g} Gbit/s, "
          f"against a {t['latency_target_s'] * 1e3:g} ms target")
    for r in t["rows"]:
        print(f"  prompt {r['prompt_len']:>6}: {r['bytes'] / 2**20:9.2f} MiB in {r['transfer_s'] * 1e3:8.2f} ms = "
              f"{100 * r['share']:6.2f}% of the target: {r['verdict']}")
    print(f"  longest prompt under {100 * PAYS_SHARE:g}% of the target: {t['longest_prompt_that_pays']} tokens")


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
    if args.link_gbps is not None:
        bpt = _bytes_per_token(args)
        if bpt is None:
            raise SystemExit("--link-gbps needs --model-config CONFIG.json or --kv-bytes-per-token")
        lens = [int(x) for x in args.prompt_lens.split(",") if x]
        p["kv_transfer"] = transfer_plan(bpt, args.link_gbps, args.latency_target_ms / 1e3, lens,
                                         args.link_latency_ms / 1e3)
        _print_transfer(p["kv_transfer"])
    return p
