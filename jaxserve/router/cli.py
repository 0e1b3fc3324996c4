"""`jaxserve router`: registered into the main CLI by `add_router_parser(subparsers)`.

Either `--replica HOST:PORT` (repeatable) for replicas already running, or `--replicas N` to start
N local `jaxserve serve` children (with `--model`, `--engine-arg` passed to each, and
`--replica-cpus` pinning them), or both.
"""

from __future__ import annotations

import argparse
import os

from jaxserve.router.policy import POLICIES, CacheAwareConfig
from jaxserve.router.prefill_deadline import FAILURE_POLICIES, PrefillHopConfig

API_KEY_ENV = "JAXSERVE_API_KEY"


def add_router_parser(subparsers) -> None:
    from jaxserve.server.cli import _DefaultsHelpFormatter

    d = CacheAwareConfig()
    p = subparsers.add_parser("router", help="one gRPC front for many `jaxserve serve` replicas, cache-aware routing",
                              formatter_class=_DefaultsHelpFormatter)
    r = p.add_argument_group("replicas")
    r.add_argument("--replica", action="append", default=[], metavar="HOST:PORT",
                   help="a running `jaxserve serve` (repeatable)")
    r.add_argument("--replicas", type=int, default=0, metavar="N", help="start N local `jaxserve serve` replicas")
    r.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="an argument for each local replica, verbatim (repeatable; --engine-arg=--max-num-seqs=8)")
    r.add_argument("--replica-cpus", action="append", default=[], metavar="CPUS",
                   help="the CPU set of the local replicas (0, 0-1, 0,2): once for all, or once per replica")
    r.add_argument("--replica-devices", action="append", default=[], metavar="IDS",
                   help="the accelerators each local replica sees (CUDA_VISIBLE_DEVICES, e.g. 0 or 0,1): "
                        "once for all, or once per replica")
    r.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                   help="a running `jaxserve serve --role prefill` (repeatable): prompts go there first and their "
                        "KV moves to a --decode engine")
    r.add_argument("--decode", action="append", default=[], metavar="HOST:PORT",
                   help="a running `jaxserve serve --role decode` (repeatable; a replica that loads prompts' KV)")
    r.add_argument("--prefill-threshold-tokens", type=int, default=0, metavar="N",
                   help="with --prefill: prompts shorter than N tokens skip the prefill engines (decode-side prefill)")
    h = PrefillHopConfig()
    r.add_argument("--prefill-timeout-s", type=float, default=h.timeout_s, metavar="S",
                   help="with --prefill: a prefill hop's deadline; 0 derives it per engine from the prompt's "
                        f"length and the engine's measured prefill rate ({h.floor_s:g} s + {h.slack:g} x the "
                        "expected time); never past the client's deadline. Then the decode engine prefills it")
    r.add_argument("--prefill-suspect-s", type=float, default=h.suspect_s, metavar="S",
                   help="with --prefill: a prefill engine that missed a hop's deadline is skipped at least this "
                        "long, then until it answers a health check")
    r.add_argument("--prefill-failure-policy", choices=FAILURE_POLICIES, default=h.failure_policy,
                   help="with --prefill: a failed prefill hop (no engine, refused, deadline) is prefilled by the "
                        "decode engine (recompute) or ends the request UNAVAILABLE (fail)")
    r.add_argument("--replica-api-key", default=None, help="bearer token the replicas want (default: --api-key)")
    r.add_argument("--replica-tls-root-cert", default=None, help="PEM root certificate to trust for the replicas")
    r.add_argument("--model", default=None,
                   help="the replicas' model, for its tokenizer here (and passed to local replicas); "
                        "default: the embedded SmolLM2")
    g = p.add_argument_group("routing")
    g.add_argument("--policy", choices=POLICIES, default="cache_aware")
    g.add_argument("--balance-abs-tokens", type=int, default=d.balance_abs_tokens,
                   help="cache_aware: loads this many tokens apart (and --balance-rel times) are imbalanced")
    g.add_argument("--balance-rel", type=float, default=d.balance_rel)
    g.add_argument("--min-match-ratio", type=float, default=d.min_match_ratio,
                   help="cache_aware: a prefix match below this share of the prompt routes by load")
    g.add_argument("--request-cost-tokens", type=int, default=d.request_cost_tokens,
                   help="a running request's weight in a replica's load, in prompt tokens")
    g.add_argument("--replica-kv-events", action="append", default=[], metavar="ENDPOINT[,REPLAY]",
                   help="kv_events: where a --replica publishes its KV events (its --kv-events-config endpoint and "
                        "replay endpoint as this host reaches them, e.g. tcp://10.0.0.5:5557,tcp://10.0.0.5:5558), "
                        "once per --replica in their order; local --replicas get theirs on their own")
    g.add_argument("--kv-events-routed-s", type=float, default=2.0, metavar="S",
                   help="kv_events: a prefix routed to a replica counts as there this long (to twice as long) "
                        "before its events tell")
    g.add_argument("--index-chunk-tokens", type=int, default=16, help="granularity of the prefix index")
    g.add_argument("--index-max-tokens", type=int, default=1 << 20, help="prefix index bound per replica")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    s.add_argument("--api-key", default=None,
                   help=f"require 'authorization: Bearer KEY' on every call but health (default: ${API_KEY_ENV})")
    s.add_argument("--tls-cert", default=None)
    s.add_argument("--tls-key", default=None)
    s.add_argument("--max-concurrent-streams", type=int, default=1024)
    s.add_argument("--grace-period", type=float, default=30.0)
    p.set_defaults(func=cmd_router)


def config_from_args(args: argparse.Namespace, extra_replicas=(), extra_kv_events=()):
    """extra_replicas, extra_kv_events: the local children's addresses and KV event endpoints."""
    from jaxserve.router.event_index import KVEventsSource
    from jaxserve.router.replica import ReplicaAddress, ReplicaClientConfig
    from jaxserve.router.server import RouterConfig

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    root = None
    if args.replica_tls_root_cert:
        with open(args.replica_tls_root_cert, "rb") as f:
            root = f.read()
    return RouterConfig(
        replicas=tuple(ReplicaAddress.parse(t) for t in args.replica + args.decode) + tuple(extra_replicas),
        prefill=tuple(ReplicaAddress.parse(t) for t in args.prefill),
        prefill_threshold_tokens=args.prefill_threshold_tokens,
        prefill_hop=PrefillHopConfig(timeout_s=args.prefill_timeout_s, suspect_s=args.prefill_suspect_s,
                                     failure_policy=args.prefill_failure_policy),
        host=args.host, port=args.port, policy=args.policy,
        cache_aware=CacheAwareConfig(args.balance_abs_tokens, args.balance_rel, args.min_match_ratio,
                                     args.request_cost_tokens),
        index_chunk_tokens=args.index_chunk_tokens, index_max_tokens=args.index_max_tokens,
        replica_kv_events=tuple(KVEventsSource.parse(t) for t in args.replica_kv_events) + tuple(extra_kv_events),
        kv_events_routed_s=args.kv_events_routed_s,
        metrics_port=args.metrics_port, api_key=api_key, tls_cert=args.tls_cert, tls_key=args.tls_key,
        max_concurrent_streams=args.max_concurrent_streams, grace_period=args.grace_period,
        replica_client=ReplicaClientConfig(api_key=args.replica_api_key or api_key, tls_root_cert=root))


def cmd_router(args: argparse.Namespace) -> int:
    import asyncio

    from jaxserve.router.children import parse_cpus, per_replica, start_children, stop_children
    from jaxserve.router.replica import ReplicaAddress
    from jaxserve.router.server import run_router
    from jaxserve.router.tokenize import load_tokenizer

    if args.replicas < 0:
        raise ValueError(f"--replicas {args.replicas} must be >= 0")
    if args.prefill and not args.decode:
        raise ValueError("--prefill needs at least one --decode HOST:PORT (the engines that load the KV)")
    if not args.replica and not args.replicas and not args.decode:
        raise ValueError("no replicas: give --replica HOST:PORT (repeatable) or --replicas N")
    if (args.engine_arg or args.replica_cpus or args.replica_devices) and not args.replicas:
        raise ValueError("--engine-arg, --replica-cpus and --replica-devices are for local replicas: "
                         "give --replicas N")
    cpus = [parse_cpus(c) for c in args.replica_cpus]
    per_replica(cpus, max(1, args.replicas), "--replica-cpus")      # the counts, before anything loads
    per_replica(args.replica_devices, max(1, args.replicas), "--replica-devices")
    events = local_kv_events(args.replicas) if args.policy == "kv_events" else []
    # every bad flag is reported before anything starts (stand-in addresses for the children)
    config_from_args(args, [ReplicaAddress("127.0.0.1", 1 + i) for i in range(args.replicas)], events)
    from jaxserve.server.cli import ensure_info_handler

    ensure_info_handler("jaxserve.router")
    tokenizer = load_tokenizer(args.model)
    children = []
    if args.replicas:
        serve_args = (["--model", args.model] if args.model else []) + list(args.engine_arg)
        children = start_children(args.replicas, serve_args, cpus=cpus, devices=args.replica_devices,
                                  per_child_args=[kv_events_flag(s) for s in events] or None)
    try:
        config = config_from_args(args, [ReplicaAddress("127.0.0.1", c.port) for c in children], events)
        return asyncio.run(run_router(config, tokenizer))
    finally:
        stop_children(children, args.grace_period)


def local_kv_events(n: int) -> list:
    """KV event endpoints for n local replicas: sockets in a fresh directory (ipc://, bound by each
    replica, reachable only on this host)."""
    import tempfile

    from jaxserve.router.event_index import KVEventsSource

    d = tempfile.mkdtemp(prefix="jaxserve-router-kv-events-")
    return [KVEventsSource(f"ipc://{d}/replica-{i}.pub", f"ipc://{d}/replica-{i}.replay") for i in range(n)]


def kv_events_flag(source) -> list[str]:
    """The `jaxserve serve` flag that makes a replica publish where `source` says."""
    import json

    return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": source.endpoint,
                                              "replay_endpoint": source.replay_endpoint, "topic": source.topic})]
