"""`jaxserve bench serve`: traffic at request rates against running servers (jaxserve over gRPC,
or any OpenAI-compatible HTTP server), or against engine variants in this process; with `--slo`,
SLO attainment and goodput per rate.

Against a server (the default): the load generator (loadgen.py) needs a streaming callable;
`client_stream` takes it from `jaxserve.client.bench_stream(target, api_key) -> (stream,
checkpoint identity)`. Start the server with the same `--model` as this command: prompts are
tokenized here. Token times are stamped by the client when each chunk arrives. A target given
as a URL (`--target NAME=http://HOST:PORT`) is an OpenAI-compatible server driven over streamed
/v1/completions with the same token ids (http_target.py); gRPC and HTTP targets mix in one run.

In process (`--in-process`, or any `--engine-variant NAME:KEY=VALUE,...`): each variant is the
serving engine (the server's defaults, engine flags of this command, then the variant's fields;
engine_variants.py) driven by the engine's step loop with timed arrivals, as `bench throughput`
drives it: a request's arrival is its due time, so a step it waits for counts in its TTFT. The
variants take turns at each rate on the same requests (goodput_sweep.py), so one command compares
configurations side by side.

With `--slo ttft=S,tpot=MS` every run is judged (slo.py): attainment (share of requests meeting
both objectives), goodput (requests/s meeting both), p50/p99 TTFT and TPOT, and per target the
goodput headline: the highest rate with attainment >= `--attainment`. `--request-rate
search:LOW:HIGH` bisects for that rate (rate_search.py). `--workload chat|interference` picks the
mix (slo_workloads.py). The JSON's `extra.goodput` has every point; `NAME-attainment-vs-rate.png`
plots them.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import math
from dataclasses import replace
from typing import Any, Callable

from jaxserve.bench import plots
from jaxserve.bench.args import add_common, add_dataset, engine_kwargs, set_command
from jaxserve.bench.backend_base import Backend, BackendRun
from jaxserve.bench.engine_variants import EngineVariant, build_variants, check_unique, serving_defaults
from jaxserve.bench.goodput_sweep import SweepResult, Target, TargetRun, format_sweep, sweep
from jaxserve.bench.http_target import (PROMPT_MODES, HTTPTarget, TargetUnreachable, base_url, is_http_address,
                                        run_http_load, served_model)
from jaxserve.bench.loadgen import StreamFn, run_load
from jaxserve.bench.rate_search import RatePlan
from jaxserve.bench.session import Session, log
from jaxserve.bench.slo import SLO
from jaxserve.bench.slo_workloads import add_mix_args, check_mix_args, mix_workload
from jaxserve.bench.workloads import Workload, warmup_requests, with_arrivals


def _usage(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type whose ValueError message becomes the usage error (argparse would otherwise
    print only 'invalid value')."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__qualname__
    return convert


def _attainment(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {text!r}")
    return v


def _probes(text: str) -> int:
    v = int(text)
    if v < 2:
        raise ValueError(f"--search-probes must be >= 2 (the search probes LOW and HIGH first), got {text!r}")
    return v


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="traffic at request rates against `jaxserve serve` (gRPC), OpenAI-compatible "
                                     "HTTP servers, or engine variants in process; SLO attainment and goodput",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common(p, "jaxserve")
    add_dataset(p, num_prompts=64, input_len="32:512", output_len="16:256")
    add_mix_args(p)
    g = p.add_argument_group("arrivals")
    g.add_argument("--request-rate", type=_usage(RatePlan.parse), default="inf",
                   help="requests/s, comma-separated for a sweep (inf sends everything at once), or search:LOW:HIGH "
                        "to bisect for the goodput (needs --slo)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    s = p.add_argument_group("SLO and goodput")
    s.add_argument("--slo", type=_usage(SLO.parse), default=None, metavar="ttft=S,tpot=MS",
                   help="judge every request: TTFT at most S seconds and TPOT at most MS milliseconds")
    s.add_argument("--attainment", type=_usage(_attainment), default=0.9,
                   help="share of requests that must meet the SLO for a rate to count towards goodput")
    s.add_argument("--search-probes", type=_usage(_probes), default=6, help="most rates one search runs per target")
    t = p.add_argument_group("what is measured")
    t.add_argument("--target", action="append", default=None, metavar="[NAME=]HOST:PORT|URL",
                   help="a jaxserve gRPC server (default 127.0.0.1:50051), or an http(s):// URL: any "
                        "OpenAI-compatible server, driven over streamed /v1/completions; repeatable: the targets "
                        "take turns on the same requests, named NAME in the results")
    t.add_argument("--http-prompt", choices=PROMPT_MODES, default="ids",
                   help="what HTTP targets get as the prompt: the token ids every target gets, or their "
                        "detokenized text (for a server that takes only strings; it tokenizes them again)")
    t.add_argument("--http-read-timeout", type=float, default=600.0, metavar="S",
                   help="an HTTP request whose stream stays silent this long fails (queued or stalled)")
    t.add_argument("--salt-per-target", action="store_true",
                   help="each target's requests carry cache_salt=NAME, so targets in front of the same replicas "
                        "never serve each other's prompts from the prefix cache")
    t.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    t.add_argument("--in-process", action="store_true",
                   help="measure the serving engine in this process instead of a server")
    t.add_argument("--engine-variant", type=_usage(EngineVariant.parse), action="append", default=[],
                   metavar="NAME[:KEY=VALUE,...]",
                   help="an in-process engine: the serving defaults with these EngineConfig fields (repeatable; "
                        "implies --in-process; variants that change only scheduling knobs share one compiled runner)")
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


def _rate_config(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    return {"request_rate": "inf" if math.isinf(rate) else rate, "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency}


def _split_target(text: str) -> tuple[str, str]:
    """`NAME=ADDRESS` or `ADDRESS` -> (name or "", address); a URL's own `=` (a query) stays its own."""
    if is_http_address(text):
        return "", text
    name, sep, address = text.partition("=")
    return (name, address) if sep else ("", text)


def parse_targets(texts: list[str] | None) -> list[tuple[str, str]]:
    """`[NAME=]HOST:PORT` or `[NAME=]http(s)://HOST:PORT` flags -> (name, address); one unnamed
    target keeps the name jaxserve-grpc (openai-http for a URL)."""
    texts = texts or ["127.0.0.1:50051"]
    out = []
    for text in texts:
        name, address = _split_target(text)
        if is_http_address(address):
            try:
                address = base_url(address)
            except ValueError as e:
                raise SystemExit(f"jaxserve bench serve: --target {text!r}: {e}") from e
        elif not address or ":" not in address:
            raise SystemExit(f"jaxserve bench serve: --target {text!r} must be [NAME=]HOST:PORT or "
                             "[NAME=]http://HOST:PORT")
        if not name:
            name = ("openai-http" if is_http_address(address) else "jaxserve-grpc") if len(texts) == 1 else address
        out.append((name, address))
    if len({n for n, _ in out}) != len(out):
        raise SystemExit(f"jaxserve bench serve: two --target flags share a name: {texts}")
    return out


def prefix_counters(address: str, api_key: str | None) -> tuple[float, int] | None:
    """(prompt tokens the server's prefix cache served, prompt tokens) since it started, from
    GetServerInfo (a router sums its replicas); None when the server does not say."""
    try:
        from jaxserve.client import GenerationClient

        with GenerationClient(address, api_key=api_key, timeout=10) as c:
            info = c.server_info()
    except Exception:   # noqa: BLE001 - a measurement beside the run, never a reason to fail it
        return None
    return info.prefix_hit_rate * info.prompt_tokens_total, info.prompt_tokens_total


def prefix_hit_rate_between(before, after) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def salted(stream: StreamFn, salt: str) -> StreamFn:
    """The stream with cache_salt=salt on every request."""
    async def salted_stream(prompt_token_ids, params):
        async for item in stream(prompt_token_ids, {**params, "cache_salt": salt}):
            yield item

    return salted_stream


def grpc_target(args: argparse.Namespace, stream: StreamFn, identity: str, name: str = "jaxserve-grpc",
                address: str | None = None) -> Target:
    address = address or parse_targets(args.target)[0][1]

    def run(wl: Workload, rate: float) -> TargetRun:
        log(f"sending {len(wl.requests)} requests to {name} ({address}) at rate {rate}")
        failed: dict[str, str] = {}
        before = prefix_counters(address, args.api_key)
        records, outputs, duration = asyncio.run(run_load(stream, wl.requests, args.max_concurrency,
                                                          not args.no_progress, failures=failed))
        hit_rate = prefix_hit_rate_between(before, prefix_counters(address, args.api_key))
        if hit_rate is not None:
            log(f"{name}: the server's prefix-cache hit rate over the run {hit_rate:.1%}")
        if not records:
            return TargetRun(None, failed)
        return TargetRun(BackendRun(name, "jaxserve-grpc", records, duration, identity,
                                    config={"target": address, **_rate_config(args, rate),
                                            "server_prefix_hit_rate": hit_rate},
                                    output_token_ids=outputs, notes=["token times stamped by the client on arrival"]),
                         failed)

    return Target(name, run)


def openai_target(args: argparse.Namespace, target: HTTPTarget, model: str, name: str,
                  detokenize: Callable[[list[int]], str] | None) -> Target:
    """An OpenAI-compatible server (http_target.py): the same requests and arrivals as the gRPC
    targets; its model id from GET /v1/models is recorded in place of a checkpoint identity."""
    wrap = (lambda stream: salted(stream, name)) if args.salt_per_target else None

    def run(wl: Workload, rate: float) -> TargetRun:
        log(f"sending {len(wl.requests)} requests to {name} ({target.url}, model {model!r}) at rate {rate}")
        failed: dict[str, str] = {}
        records, outputs, duration = asyncio.run(run_http_load(
            target, model, wl.requests, args.max_concurrency, not args.no_progress, failed, detokenize, wrap))
        if not records:
            return TargetRun(None, failed)
        return TargetRun(BackendRun(name, "openai-http", records, duration, f"unverified: /v1/models id {model!r}",
                                    config={"target": target.url, "model": model, "http_prompt": target.prompt,
                                            **_rate_config(args, rate)},
                                    output_token_ids=outputs,
                                    notes=["token times stamped by the client as SSE chunks arrive; a chunk may hold "
                                           "several tokens: ITL is per chunk, token counts are the server's usage"]),
                         failed)

    return Target(name, run)


def engine_target(session: Session, variant: EngineVariant, backend: Backend) -> Target:
    args = session.args

    def run(wl: Workload, rate: float) -> TargetRun:
        log(f"running {variant.name} at request rate {rate}")
        options = session.options(timed_arrivals=True, max_concurrency=args.max_concurrency)
        r = session.run(backend, wl.requests, options, {"variant": str(variant), **_rate_config(args, rate)})
        return TargetRun(r)   # None: the run failed (recorded in skipped); its requests count as misses

    return Target(variant.name, run)


def _workloads(session: Session, plan: RatePlan) -> Callable[[float, int], Workload]:
    """Step k of the sweep: the mix seeded seed + k (each step its own prompts: a server's prefix
    cache must not answer one rate from another), arrivals at the step's rate. Every target of a
    step gets the same requests."""
    from jaxserve.bench.cmd_throughput import build_workload

    args = session.args
    mixes: dict[int, Workload] = {}
    many = plan.search is not None or len(plan.rates) > 1

    def at(rate: float, step: int) -> Workload:
        if step not in mixes:
            seed = args.seed + step
            mixes[step] = mix_workload(args, build_workload(session, seed), session.tokenizer, seed)
        wl = with_arrivals(mixes[step], rate, args.burstiness, args.seed + step)
        if many:  # distinct ids per step, so runs of different steps never share a request id
            wl = replace(wl, requests=tuple(replace(r, request_id=f"{r.request_id}@{step}") for r in wl.requests))
        return wl

    return at


def _goodput_extra(result: SweepResult) -> dict[str, Any]:
    out = result.as_dict()
    names = list(result.points)
    first = result.goodput(names[0]) if names else None
    if first and len(names) > 1 and math.isfinite(first):
        out["goodput_over_first"] = {n: (g / first if (g := result.goodput(n)) is not None else None)
                                     for n in names[1:]}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    check_mix_args(args)
    plan: RatePlan = args.request_rate
    if plan.search is not None and args.slo is None:
        raise SystemExit("jaxserve bench serve: --request-rate search:LOW:HIGH needs --slo ttft=S,tpot=MS")
    in_process = args.in_process or bool(args.engine_variant)
    if not in_process:
        streams = []   # (name, address, gRPC stream or None, identity or HTTPTarget, model id or None)
        for name, address in parse_targets(args.target):
            if is_http_address(address):
                http = HTTPTarget(address, args.api_key, args.http_prompt, read_timeout_s=args.http_read_timeout)
                try:
                    streams.append((name, address, None, http, served_model(http)))
                except TargetUnreachable as e:
                    raise SystemExit(f"jaxserve bench serve: --target {name}: {e}") from e
                continue
            try:
                stream, identity = client_stream(address, args.api_key)
            except ClientMissing as e:
                raise SystemExit(str(e)) from e
            streams.append((name, address, salted(stream, name) if args.salt_per_target else stream, identity, None))
    variants = args.engine_variant or [EngineVariant("default")]
    try:
        check_unique(variants)
    except ValueError as e:
        raise SystemExit(f"jaxserve bench serve: {e}") from e
    session = Session(args, "serve")
    workload_at = _workloads(session, plan)
    first = workload_at(plan.search[0] if plan.search else plan.rates[0], 0)
    owned: list[Backend] = []
    try:
        if in_process:
            base = {k: v for k, v in serving_defaults().items() if k not in engine_kwargs(args)}
            built, owned = build_variants(session, variants, base)
            warm = warmup_requests(first, args.num_warmup)
            owned_ok = [b for b in owned if session.warm(b, warm)]
            targets = [engine_target(session, v, b) for v, b in built
                       if b in owned_ok or getattr(b, "base", None) in owned_ok]
        else:
            detokenize = ((lambda ids: session.tokenizer.decode(ids, skip_special_tokens=False))
                          if args.http_prompt == "text" else None)
            targets = [openai_target(args, identity, model, name, detokenize) if stream is None
                       else grpc_target(args, stream, identity, name, address)
                       for name, address, stream, identity, model in streams]
        if not targets:
            raise SystemExit(f"no engine variant could be built: {session.skipped}")
        result = sweep(targets, plan, workload_at, args.slo, args.attainment, args.search_probes,
                       on_point=_log_point)
    finally:
        for b in owned:
            b.close()
    extra = {}
    if args.slo is not None:
        print(format_sweep(result))
        extra["goodput"] = _goodput_extra(result)
    per_target = max((len(p) for p in result.points.values()), default=0)
    chosen = [plots.throughput_bars, plots.latency_cdfs] + ([plots.ttft_vs_rate] if per_target > 1 else []) \
        + ([plots.attainment_vs_rate] if args.slo is not None else [])
    return session.finish(first, result.runs, extra=extra, plots=chosen)


def _log_point(name: str, point: Any) -> None:
    r = point.report
    if r is not None:
        log(f"{name} at rate {point.rate:g}: attainment {r.attainment:.0%}, goodput {r.goodput:.3g} req/s")
