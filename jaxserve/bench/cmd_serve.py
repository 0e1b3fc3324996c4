"""`jaxserve bench serve`: Poisson / gamma traffic against a running jaxserve gRPC server.

The load generator (loadgen.py) needs a streaming callable; `client_stream` takes it from
`jaxserve.client.bench_stream(target, api_key) -> (stream, checkpoint identity)`. Where that
module is missing the command stops with a clear message instead of measuring something else.
Start the server with the same `--model` as this command: prompts are tokenized here.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import math
from typing import Any

from jaxserve.bench import plots
from jaxserve.bench.args import add_arrivals, add_common, add_dataset, parse_rates, set_command
from jaxserve.bench.backend_base import BackendRun
from jaxserve.bench.loadgen import StreamFn, run_load
from jaxserve.bench.session import Session, log


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="traffic against a running `jaxserve serve` (gRPC)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common(p, "jaxserve")
    add_dataset(p, num_prompts=64, input_len="32:512", output_len="16:256")
    add_arrivals(p)
    p.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    p.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    set_command(p, run)


class ClientMissing(RuntimeError):
    pass


def client_stream(target: str, api_key: str | None) -> tuple[StreamFn, str]:
    """(stream callable, the server's checkpoint identity) from jaxserve.client."""
    try:
        client = importlib.import_module("jaxserve.client")
    except ImportError as e:
        raise ClientMissing(
            "`jaxserve bench serve` needs jaxserve.client (the gRPC client from the service issue), "
            f"which this installation does not have yet: {e}") from e
    factory = getattr(client, "bench_stream", None)
    if factory is None:
        raise ClientMissing("jaxserve.client has no bench_stream(target, api_key) -> (stream, checkpoint_identity)")
    return factory(target, api_key)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from jaxserve.bench.cmd_throughput import rate_workloads

    try:
        stream, identity = client_stream(args.target, args.api_key)
    except ClientMissing as e:
        raise SystemExit(str(e)) from e
    session = Session(args, "serve")
    rates = parse_rates(args.request_rate)
    workloads = rate_workloads(session, rates)
    base = workloads[0]
    runs = []
    for rate, wl in zip(rates, workloads):
        log(f"sending {len(wl.requests)} requests to {args.target} at rate {rate}")
        records, outputs, duration = asyncio.run(run_load(stream, wl.requests, args.max_concurrency,
                                                          not args.no_progress))
        rate_s = "inf" if math.isinf(rate) else rate
        runs.append(BackendRun("jaxserve-grpc", f"jaxserve-grpc@{rate_s}", records, duration, identity,
                               config={"target": args.target, "request_rate": rate_s, "burstiness": args.burstiness,
                                       "max_concurrency": args.max_concurrency},
                               output_token_ids=outputs, notes=["token times stamped by the client on arrival"]))
    chosen = [plots.throughput_bars, plots.latency_cdfs] + ([plots.ttft_vs_rate] if len(runs) > 1 else [])
    return session.finish(base, runs, plots=chosen)
