"""The server process: gRPC (Generation, health, reflection), the OpenAI-compatible HTTP API
(`http_port`), metrics, warmup and graceful shutdown. Both fronts share one ServerState (phase,
engine, stream count: server/state.py) and one Prometheus registry; either may be off, not both.
The gRPC front lives in grpc_front.py and the HTTP front in http/; neither imports the other.

Order of life: listen first (health NOT_SERVING, Generate UNAVAILABLE), build and compile the
engine in a thread, then SERVING. With warm_up="background" (`jaxserve serve`'s default) SERVING
comes once the steps of a lone request are warm; the engine's step cap keeps every step within
warm buckets while the rest warm in a thread (engine/warm_start.py), so a request never meets a
cold step, and the log counts the buckets as they become ready.
SIGTERM or SIGINT: NOT_SERVING and UNAVAILABLE for new calls,
in-flight streams get `grace_period` seconds to finish, the rest are aborted (their streams end
with finish_reason "abort"), then the server stops and `serve()` returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from jaxserve.config import EngineConfig
from jaxserve.server.lora_adapters import LoRAModule, register_now
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.vllm_metrics import METRIC_NAMES, serve_vllm_names
from jaxserve.server.request_caps import RequestCaps
from jaxserve.server.state import Phase, ServerState

log = logging.getLogger("jaxserve.server")

# gRPC messages are bounded before the model is loaded, so by what any vocabulary's token could
# stand for: 256 bytes (SmolLM2's longest token has 81). The exact bound, from the model's own
# vocabulary, refuses a longer text before it is tokenized (AsyncEngine.max_prompt_chars).
MESSAGE_BYTES_PER_TOKEN = 256
MESSAGE_OVERHEAD_BYTES = 1 << 20     # the rest of a request: sampling parameters, stop strings, chat roles
# builder.MAX_DEFAULT_MODEL_LEN, the longest max_model_len an unset one becomes; not imported from
# there because that imports jax, and the server listens before it (a test keeps the two equal)
DEFAULT_MAX_MODEL_LEN_BOUND = 8192


def message_bytes_limit(max_model_len: int) -> int:
    """The largest request a max_model_len-token prompt can need: bigger ones are refused by gRPC
    (RESOURCE_EXHAUSTED) before they are read into Python."""
    return max_model_len * MESSAGE_BYTES_PER_TOKEN + MESSAGE_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    grpc: bool = True                    # False: HTTP only (then http_port is needed)
    http_port: int | None = None         # the OpenAI-compatible API; None: off
    metrics_port: int | None = None
    api_key: str | None = None
    tls_cert: str | None = None          # PEM files; both or neither
    tls_key: str | None = None
    max_concurrent_streams: int = 256
    grace_period: float = 30.0           # seconds in-flight streams get after SIGTERM
    max_message_bytes: int | None = None     # None: message_bytes_limit(max_model_len)
    limits: RequestCaps = RequestCaps()
    responses_store_size: int = 1024     # finished /v1/responses kept for GET and previous_response_id
    tool_call_parser: str | None = None  # the model's tool-call format (tool_parsers; None: the model's default)
    reasoning_parser: str | None = None  # split answers' reasoning out (reasoning_parsers; None: not split)
    http_header_timeout: float = 10.0    # seconds a request's headers may take (the connection closes after)
    http_body_timeout: float = 60.0      # seconds a request's body may take (408 after)
    lenient_api: bool = False            # HTTP: unknown request fields dropped with a warning, not a 400
    chat_content_special_tokens: bool = False   # special-token text in chat contents is control tokens
    lora_modules: tuple[LoRAModule, ...] = ()    # LoRA adapters registered before SERVING (--lora-modules)
    metrics_names: str = "both"          # the metric names /metrics shows: both, vllm or jaxserve (vllm_metrics.py)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port={self.http_port} must be in [0, 65535]")
        if not self.grpc and self.http_port is None:
            raise ValueError("nothing to serve: gRPC is off and no http_port is given")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port={self.metrics_port} must be in [0, 65535]")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.max_concurrent_streams < 1:
            raise ValueError(f"max_concurrent_streams={self.max_concurrent_streams} must be >= 1")
        if self.grace_period < 0:
            raise ValueError(f"grace_period={self.grace_period} must be >= 0")
        if self.max_message_bytes is not None and self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} must be >= 1024")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key is empty; leave it unset to disable auth")
        if not self.http_header_timeout > 0 or not self.http_body_timeout > 0:
            raise ValueError(f"http_header_timeout={self.http_header_timeout} and http_body_timeout="
                             f"{self.http_body_timeout} must be > 0")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size={self.responses_store_size} must be >= 0")
        if self.metrics_names not in METRIC_NAMES:
            raise ValueError(f"metrics_names={self.metrics_names!r} must be one of {', '.join(METRIC_NAMES)}")
        if self.tool_call_parser is not None:
            from jaxserve.tool_parsers.registry import tool_parser
            tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            from jaxserve.reasoning_parsers.registry import reasoning_parser
            reasoning_parser(self.reasoning_parser)


def _build_in_thread(build: Callable[[], object]) -> asyncio.Future:
    """Run the (slow, blocking) engine build in a daemon thread: a signal during warmup can then
    end the process without waiting for compilation to finish."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def target():
        try:
            result = build()
        except BaseException as e:   # noqa: BLE001 - reported through the future
            # bound now: `e` itself is unbound when the except block ends, before the loop runs this
            loop.call_soon_threadsafe(lambda err=e: fut.done() or fut.set_exception(err))
        else:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

    threading.Thread(target=target, name="jaxserve-warmup", daemon=True).start()
    return fut


async def run_server(config: ServerConfig, engine_config: EngineConfig, *, progress: bool = False,
                     build_engine: Callable | None = None, hard_exit_during_warmup: bool = False) -> int:
    """hard_exit_during_warmup (the CLI's): a stop while a compile runs (the start-up warm-up, or
    a bucket warming in the background) ends the process without waiting for it, once nothing is
    in flight: an XLA compile cannot be cut short, and a bucket's took ~8 s of an idle server's exit."""
    state = ServerState()
    metrics = ServerMetrics(lambda: state.aengine.snapshot if state.aengine is not None else None)
    serve_vllm_names(metrics.registry, config.metrics_names, lambda: state.aengine)
    if engine_config.disagg.role != "both":
        from jaxserve.disagg.metrics import DisaggCollector

        metrics.registry.register(DisaggCollector(lambda: state.aengine.engine if state.aengine is not None else None))
    max_message_bytes = config.max_message_bytes
    if max_message_bytes is None:
        max_message_bytes = message_bytes_limit(engine_config.model.max_model_len or DEFAULT_MAX_MODEL_LEN_BOUND)
    grpc_front = None
    if config.grpc:   # imported only when served: `--no-grpc` loads no grpc at all
        from jaxserve.server.grpc_front import start_grpc

        grpc_front = await start_grpc(config, max_message_bytes, state, metrics,
                                      kv_transfer=engine_config.disagg.role != "both")
    http = None
    if config.http_port is not None:
        from jaxserve.server.http.app import create_app
        from jaxserve.server.http.listener import HTTPListener
        from jaxserve.server.http.openai_front import OpenAIFront
        from jaxserve.server.http.responses_store import ResponseStore

        front = OpenAIFront(state, limits=config.limits, metrics=metrics,
                            max_concurrent_streams=config.max_concurrent_streams,
                            tool_call_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser)
        front.content_special_tokens = config.chat_content_special_tokens
        http = HTTPListener(create_app(front, api_key=config.api_key, max_body_bytes=max_message_bytes,
                                       responses_store=ResponseStore(config.responses_store_size),
                                       body_timeout_s=config.http_body_timeout, lenient_api=config.lenient_api),
                            config.host, config.http_port, header_timeout_s=config.http_header_timeout)
        await http.start()
    if config.metrics_port is not None:
        from prometheus_client import start_http_server
        start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
        log.info("metrics on http://%s:%d/metrics", config.host, config.metrics_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def on_dead(err: BaseException) -> None:
        state.phase = Phase.FAILED
        log.error("engine failed: %s; health is NOT_SERVING", err)
        if grpc_front is not None:
            asyncio.ensure_future(grpc_front.set_serving(False))

    if build_engine is None:
        from jaxserve.engine.builder import build_engine as default_build
        build_engine = default_build
    t0 = time.perf_counter()
    # a prefill or decode engine comes with its KV connector (the builder reads the role settings)
    built = _build_in_thread(lambda: _with_adapters(build_engine(engine_config, progress=progress), config.lora_modules))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({built, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not built.done():      # a signal during warmup: nothing is in flight
        log.info("stopping during warmup")
        if grpc_front is not None:
            await grpc_front.health.enter_graceful_shutdown()
            await grpc_front.server.stop(0)
        if http is not None:
            await http.stop()
        if hard_exit_during_warmup:
            # the compiler's worker pool is joined at interpreter exit, which would wait for the
            # whole warmup; nothing is in flight and nothing needs saving
            logging.shutdown()
            os._exit(0)
        return 0
    try:
        engine = built.result()
    except Exception:
        log.exception("building the engine failed")
        if grpc_front is not None:
            await grpc_front.server.stop(0)
        if http is not None:
            await http.stop()
        return 1

    from jaxserve.engine.async_engine import AsyncEngine
    state.aengine = AsyncEngine(engine, on_dead=on_dead)
    state.aengine.start()
    hosts = getattr(getattr(engine, "runner", None), "step_mirror", None)
    if hosts is not None:
        # multi-host (jaxserve/parallel/distributed.py): a host that goes silent ends this process;
        # health turns NOT_SERVING first
        hosts.on_failure = lambda message: loop.call_soon_threadsafe(on_dead, RuntimeError(message))
    reaper = _lease_reaper(state.aengine, engine_config)
    state.phase = Phase.SERVING
    if grpc_front is not None:
        await grpc_front.set_serving(True)
    timings = getattr(engine, "startup_timings", None)     # a test's stand-in engine may have none
    where = ", ".join(([f"{config.host}:{grpc_front.port}"] if grpc_front is not None else [])
                      + ([f"http://{config.host}:{http.port}/v1"] if http is not None else []))
    warming = getattr(engine, "background_warm_up", None)   # warm_up="background": engine/warm_start.py
    log.info("jaxserve ready on %s: model %s (%s), warmup %.1f s%s%s", where, engine.model_name,
             engine.checkpoint_identity[:12], time.perf_counter() - t0, f"; {timings.describe()}" if timings else "",
             f"; {warming.readiness.describe()}, the rest warming in the background"
             if warming is not None and warming.running else "")

    await stopper
    # health and admission flip at once: a bucket still warming (below) takes up to one compile
    # to stop, and meanwhile /health said 200 and new requests were admitted (2.7 s)
    await _stop_admitting(state, grpc_front)
    if warming is not None:
        # no new bucket starts; the one in progress ends before the process does (a compile cannot
        # be cut short), so the wait is bounded by one bucket, unless the process may end under it
        await asyncio.to_thread(warming.stop, 0 if hard_exit_during_warmup else None)
    if reaper is not None:
        reaper.cancel()
    await _drain(state, grpc_front, http, config.grace_period)
    if hard_exit_during_warmup and warming is not None and warming.running:
        # drained: nothing is in flight; the bucket compiling in the background is not waited for
        # (the executable cache writes whole files: an unfinished one is simply compiled next start)
        log.info("exiting without waiting for the bucket warming in the background")
        logging.shutdown()
        os._exit(0)
    return 0


def _lease_reaper(aengine, engine_config: EngineConfig):
    """A prefill engine frees expired leases even while idle."""
    if engine_config.disagg.role != "prefill":
        return None
    from jaxserve.disagg.service import reap_leases

    return asyncio.ensure_future(reap_leases(aengine, min(1.0, engine_config.disagg.kv_lease_s / 4)))


def _with_adapters(engine, modules: tuple[LoRAModule, ...]):
    """The built engine with its --lora-modules registered (read and checked now: a bad adapter
    fails the start, as a bad model does)."""
    for m in modules:
        register_now(engine, m.name, m.path)
    return engine


async def _stop_admitting(state: ServerState, grpc_front) -> None:
    """DRAINING: both fronts refuse new calls (503 / UNAVAILABLE) and health fails (idempotent)."""
    if state.phase is not Phase.FAILED:
        state.phase = Phase.DRAINING
    if grpc_front is not None:
        await grpc_front.health.enter_graceful_shutdown()


async def _drain(state: ServerState, grpc_front, http, grace_period: float) -> None:
    log.info("draining: %d streams in flight, grace period %.1f s", state.active_streams, grace_period)
    await _stop_admitting(state, grpc_front)
    deadline = time.monotonic() + grace_period
    while state.active_streams > 0 and time.monotonic() < deadline:
        state.streams_changed.clear()
        try:
            await asyncio.wait_for(state.streams_changed.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            break
    if state.active_streams:
        log.warning("grace period over: aborting %d streams", state.active_streams)
    await state.aengine.shutdown()          # aborts what is left; their streams end with "abort"
    if grpc_front is not None:
        await grpc_front.server.stop(5.0)   # lets the aborted streams send their last message
    if http is not None:
        await http.stop()                   # likewise: the aborted SSE streams end with [DONE]
    log.info("stopped")
