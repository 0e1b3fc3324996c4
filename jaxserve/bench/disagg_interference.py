"""`jaxserve bench interference --disaggregated`: the interference workload against real servers on
two CPU sets, in one run: a colocated engine on both (the baseline, with and without the long
prompts), then a prefill engine on the first and a decode engine on the second behind
`jaxserve router --prefill ... --decode ...`.

Reported per configuration: the chats' ITL p50/p99 and the long prompts' TTFT (client-side, as
`bench serve` stamps them), and for the disaggregated one the KV transfers the decode engine
measured (count, bytes, mean seconds per transfer) and that time's share of the long prompts'
mean TTFT. The target: the chats' p99 ITL within 1.2x of their p99 with no long prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from typing import Any

from jaxserve.bench.loadgen import run_load
from jaxserve.bench.session import log
from jaxserve.router.children import SERVE, free_port, parse_cpus, start_children, stop_children

START_GUARD_S = 2400   # a cold compile of every bucket on one busy core takes long


def _wait_serving(target: str, proc: subprocess.Popen, what: str) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + START_GUARD_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with grpc.insecure_channel(target) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} was not serving after {START_GUARD_S} s")


def kv_metrics(port: int) -> dict[str, float]:
    """The jaxserve_kv_* samples a server's Prometheus endpoint on `port` exposes, by name and labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(jaxserve_kv_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _dir(parent: str, name: str) -> str:
    path = os.path.join(parent, name)
    os.makedirs(path, exist_ok=True)
    return path


def _run(target: str, requests, tag: str):
    from jaxserve.client import bench_stream

    stream, _ = bench_stream(target)
    reqs = [replace(r, request_id=f"{r.request_id}-{tag}") for r in requests]
    records, _, _ = asyncio.run(run_load(stream, reqs, progress=False))
    return records


def run_disaggregated(args: argparse.Namespace, workload, chats_only, serve_args: list[str]) -> dict[str, Any]:
    from jaxserve.bench.cmd_interference import row

    cpus = [parse_cpus(c) for c in args.cpu_sets.split(":")]
    if len(cpus) != 2:
        raise SystemExit(f"--cpu-sets {args.cpu_sets!r} must name two CPU sets, like 0:1")
    both = cpus[0] | cpus[1]
    log_dir = tempfile.mkdtemp(prefix="jaxserve-disagg-bench-")
    table: dict[str, dict[str, Any]] = {}
    warm = list(chats_only.requests[:1])

    log(f"colocated engine on cpus {sorted(both)}")
    (colo,) = start_children(1, serve_args, cpus=[both], log_dir=_dir(log_dir, "colocated"))
    try:
        target = f"127.0.0.1:{colo.port}"
        _wait_serving(target, colo.proc, "the colocated engine")
        _run(target, warm, "warm")
        table["colocated, chats alone"] = row(_run(target, chats_only.requests, "alone"))
        table["colocated"] = row(_run(target, workload.requests, "colo"))
    finally:
        stop_children([colo])

    log(f"prefill engine on cpus {sorted(cpus[0])}, decode engine on cpus {sorted(cpus[1])}")
    metrics_port = free_port()
    (pre,) = start_children(1, serve_args + ["--role", "prefill"], cpus=[cpus[0]],
                            log_dir=_dir(log_dir, "prefill"))
    (dec,) = start_children(1, serve_args + ["--role", "decode", "--metrics-port", str(metrics_port)],
                            cpus=[cpus[1]], log_dir=_dir(log_dir, "decode"))
    router = None
    try:
        for child, what in ((pre, "the prefill engine"), (dec, "the decode engine")):
            _wait_serving(f"127.0.0.1:{child.port}", child.proc, what)
        port = free_port()
        model = [a for a in serve_args[serve_args.index("--model"):][:2]] if "--model" in serve_args else []
        router_log = open(os.path.join(log_dir, "router.log"), "wb")
        router = subprocess.Popen([sys.executable, "-c", SERVE, "router", "--port", str(port), *model,
                                   "--prefill", f"127.0.0.1:{pre.port}", "--decode", f"127.0.0.1:{dec.port}",
                                   "--prefill-threshold-tokens", str(args.prefill_threshold_tokens)],
                                  cwd=tempfile.gettempdir(), stdout=router_log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
        target = f"127.0.0.1:{port}"
        _wait_serving(target, router, "the router")
        # a transfer, warmed, of a prompt the workload does not have (else both sides would cache it)
        long = workload.requests[-1]
        _run(target, warm + [replace(long, prompt_token_ids=tuple(reversed(long.prompt_token_ids)), output_len=2)],
             "warm")
        table["disaggregated, chats alone"] = row(_run(target, chats_only.requests, "alone"))
        before = kv_metrics(metrics_port)
        records = _run(target, workload.requests, "pd")
        after = kv_metrics(metrics_port)
        r = row(records)
        n = after["jaxserve_kv_transfers_total"] - before["jaxserve_kv_transfers_total"]
        seconds = after["jaxserve_kv_transfer_seconds_sum"] - before["jaxserve_kv_transfer_seconds_sum"]
        r["kv_transfers"] = n
        r["kv_bytes"] = after["jaxserve_kv_transfer_bytes_total"] - before["jaxserve_kv_transfer_bytes_total"]
        r["kv_transfer_mean_s"] = seconds / n if n else None
        r["kv_transfer_share_of_long_ttft"] = (r["kv_transfer_mean_s"] / r["long_ttft_mean_s"]
                                               if n and r["long_ttft_mean_s"] else None)
        r["fallbacks"] = {k: v - before.get(k, 0) for k, v in after.items() if k.startswith("jaxserve_kv_load_fallbacks")}
        table["disaggregated"] = r
    finally:
        if router is not None and router.poll() is None:
            router.terminate()
            router.wait(60)
        stop_children([pre, dec])

    base = table["colocated, chats alone"]["chat_itl_p99_s"]
    targets = {"colocated_p99_itl_over_alone": table["colocated"]["chat_itl_p99_s"] / base,
               "disaggregated_p99_itl_over_colocated_alone": table["disaggregated"]["chat_itl_p99_s"] / base,
               "disaggregated_p99_itl_over_its_alone": (table["disaggregated"]["chat_itl_p99_s"]
                                                        / table["disaggregated, chats alone"]["chat_itl_p99_s"])}
    targets["target_met (<= 1.2)"] = bool(targets["disaggregated_p99_itl_over_colocated_alone"] <= 1.2)
    print(f"{'configuration':<28}{'ITL p50 ms':>11}{'ITL p99 ms':>11}{'long TTFT s':>12}{'transfer ms':>12}{'share':>7}")
    for name, t in table.items():
        tr = t.get("kv_transfer_mean_s")
        share = t.get("kv_transfer_share_of_long_ttft")
        print(f"{name:<28}{t['chat_itl_p50_s'] * 1e3:>11.1f}{t['chat_itl_p99_s'] * 1e3:>11.1f}"
              f"{(t['long_ttft_mean_s'] or float('nan')):>12.2f}{(tr * 1e3 if tr else float('nan')):>12.1f}"
              f"{(100 * share if share else float('nan')):>6.1f}%")
    for k, v in targets.items():
        print(f"{k}: {v}")
    result = {"workload": workload.summary(), "params": dict(workload.params), "table": table, "targets": targets,
              "cpu_sets": args.cpu_sets, "serve_args": serve_args, "load_average": os.getloadavg()}
    log(f"server and router logs in {log_dir}")
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, f"{args.name or 'interference-disaggregated'}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    log(f"wrote {path}")
    return result
