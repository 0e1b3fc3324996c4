"""vLLM's metric names beside (or instead of) jaxserve's: what llm-d's scheduler and the Gateway API
inference extension's endpoint picker read from a model server's /metrics.

    vllm:num_requests_running      gauge    requests in the running batch
    vllm:num_requests_waiting      gauge    requests waiting to be scheduled (preempted ones too)
    vllm:kv_cache_usage_perc       gauge    fraction (0-1) of KV blocks live requests hold; a cached
                                            prefix no request holds counts as free, as in vLLM
    vllm:gpu_cache_usage_perc      gauge    the same, under vLLM's older name (the endpoint picker's)
    vllm:prefix_cache_queries      counter  prompt tokens looked up in the prefix cache
    vllm:prefix_cache_hits         counter  of those, tokens found there (either tier)
    vllm:num_preemptions           counter  requests preempted
    vllm:prompt_tokens             counter  prompt tokens of the requests accepted
    vllm:generation_tokens         counter  tokens generated
    vllm:lora_requests_info        gauge    with --enable-lora: the time it was read, labelled with
                                            running_lora_adapters and waiting_lora_adapters (the
                                            adapters of the running and the waiting requests, comma
                                            separated) and max_lora (--max-loras)

Each carries vLLM's `model_name` label, the served model's name; counters are exposed with `_total`,
as prometheus_client writes every counter. The values are read at scrape time from the EngineStats
snapshot the step thread publishes, through `vllm_values` (the one place that knows the stats'
shape), and, for the LoRA gauge, from the scheduler's queues (copied: a scrape never waits on a step).

`--metrics-names` picks what /metrics shows: `both` (the default: routers ask for vLLM's names and
jaxserve's own dashboards for jaxserve's; a scrape costs a few more series), `vllm` or `jaxserve`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

METRIC_NAMES = ("both", "vllm", "jaxserve")


@dataclass(frozen=True, slots=True)
class VLLMValues:
    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    prompt_tokens: int
    generation_tokens: int


def vllm_values(stats) -> VLLMValues:
    """The numbers vLLM's names report, read off an EngineStats (the only reader of its shape here:
    the scheduler's part and the request totals)."""
    sched, totals = stats.scheduler, stats.requests
    return VLLMValues(running=sched.num_running, waiting=sched.num_waiting, kv_usage=sched.kv_usage,
                      prefix_queries=sched.prefix_cache_queries, prefix_hits=sched.prefix_cache_hits,
                      preemptions=sched.num_preemptions, prompt_tokens=totals.prompt_tokens_total,
                      generation_tokens=totals.generation_tokens_total)


@dataclass(frozen=True, slots=True)
class LoRAInfo:
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_lora: int


def lora_info(engine) -> LoRAInfo | None:
    """The adapters of the running and the waiting requests (None without --enable-lora). The
    queues are copied whole (one list copy each, atomic under the GIL) from the scrape's thread."""
    lora = getattr(engine, "lora", None)
    if lora is None:
        return None
    sched = engine.scheduler

    def names(requests) -> tuple[str, ...]:
        return tuple(sorted({r.lora_name for r in requests if r.lora_name}))
    return LoRAInfo(names(list(sched.running)), names(list(sched.waiting)), lora.device.max_loras)


@dataclass(frozen=True)
class VLLMCollector:
    """vLLM's names (above) at scrape time; nothing before the engine exists."""
    engine: Callable[[], object | None]    # the AsyncEngine, or None

    def collect(self):
        aengine = self.engine()
        if aengine is None:
            return
        v = vllm_values(aengine.snapshot.stats)
        model = [aengine.engine.model_name]

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for kind, name, doc, value in (
            (gauge, "vllm:num_requests_running", "requests in the running batch", v.running),
            (gauge, "vllm:num_requests_waiting", "requests waiting to be scheduled", v.waiting),
            (gauge, "vllm:kv_cache_usage_perc", "fraction of KV blocks live requests hold (1 = all)", v.kv_usage),
            (gauge, "vllm:gpu_cache_usage_perc", "fraction of KV blocks live requests hold (1 = all); "
             "vllm:kv_cache_usage_perc's older name", v.kv_usage),
            (counter, "vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache", v.prefix_queries),
            (counter, "vllm:prefix_cache_hits", "prompt tokens found in the prefix cache", v.prefix_hits),
            (counter, "vllm:num_preemptions", "requests preempted", v.preemptions),
            (counter, "vllm:prompt_tokens", "prompt tokens of the requests accepted", v.prompt_tokens),
            (counter, "vllm:generation_tokens", "tokens generated", v.generation_tokens),
        ):
            f = kind(name, doc, labels=["model_name"])
            f.add_metric(model, value)
            yield f
        lora = lora_info(aengine.engine)
        if lora is not None:
            f = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of the running and waiting requests "
                                  "(the value: when this was read)",
                                  labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            f.add_metric([",".join(lora.running), ",".join(lora.waiting), str(lora.max_lora)], time.time())
            yield f


class NamedRegistry(CollectorRegistry):
    """The server's registry, showing the families `names` picks: jaxserve's (`jaxserve_...`),
    vLLM's (`vllm:...`), or both (the default)."""

    names = "both"

    def collect(self):
        for family in super().collect():
            if self.names == "both" or family.name.startswith("vllm:") == (self.names == "vllm"):
                yield family


def serve_vllm_names(registry: NamedRegistry, names: str, engine: Callable[[], object | None]) -> None:
    """Show `names` ("both", "vllm" or "jaxserve") on this registry, vLLM's read from `engine()`
    (the AsyncEngine, or None before it exists)."""
    if names not in METRIC_NAMES:
        raise ValueError(f"metrics names {names!r}: one of {', '.join(METRIC_NAMES)}")
    registry.names = names
    if names != "jaxserve":
        registry.register(VLLMCollector(engine))
