"""Prometheus metrics of the server (prometheus-client, one registry per server).

Gauges and counters are derived at scrape time from the EngineStats snapshot that the step thread
publishes after every step (`AsyncEngine.snapshot`), so they are never computed twice and a scrape
never touches the engine. Histograms are per request, observed by the servicer when a request
finishes, from the engine's own RequestMetrics timestamps.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.outputs import RequestMetrics
from jaxserve.server.vllm_metrics import NamedRegistry

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _EngineCollector:
    """Reads the latest snapshot at scrape time; reports nothing before the engine exists."""

    def __init__(self, snapshot: Callable[[], object | None]):
        self._snapshot = snapshot

    def collect(self):
        snap = self._snapshot()
        if snap is None:
            return
        s = snap.stats
        sched, steps = s.scheduler, s.steps
        for name, doc, value in (
            ("jaxserve_num_requests_running", "requests holding KV blocks and running", sched.num_running),
            ("jaxserve_num_requests_waiting", "requests waiting to be scheduled", sched.num_waiting),
            ("jaxserve_kv_cache_usage", "fraction of KV blocks held by live requests", sched.kv_usage),
            ("jaxserve_kv_blocks_free", "free KV blocks", sched.num_kv_blocks_free),
            ("jaxserve_kv_blocks_cached", "evictable KV blocks holding cached prefixes", sched.num_kv_blocks_cached),
            ("jaxserve_kv_blocks_total", "KV blocks the scheduler may use", sched.num_kv_blocks_total),
            ("jaxserve_prefix_cache_hit_rate", "prefix-cache hits / queries since start", sched.prefix_hit_rate),
            ("jaxserve_host_blocks_cached", "KV blocks the prefix cache's host tier holds",
             sched.num_host_blocks_cached),
            ("jaxserve_host_blocks_in_use", "host KV blocks swapped-out requests hold", sched.num_host_blocks_in_use),
            ("jaxserve_host_blocks_total", "KV blocks of the host pool", sched.num_host_blocks_total),
            ("jaxserve_compilations_after_warmup", "XLA compilations since warmup (should stay 0)",
             steps.num_compilations_after_warmup),
            ("jaxserve_uptime_seconds", "seconds since the engine was built",
             s.lifecycle.uptime_s + time.monotonic() - snap.taken_at),
            ("jaxserve_device_idle_fraction", "share of the engine's busy time with no step in flight "
             "(a lower bound; high: the host sets the pace)", steps.device_idle_fraction),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("jaxserve_prompt_tokens", "prompt tokens accepted", s.requests.prompt_tokens_total),
            ("jaxserve_generation_tokens", "tokens generated", s.requests.generation_tokens_total),
            ("jaxserve_preemptions", "requests preempted", sched.num_preemptions),
            ("jaxserve_prefix_cache_device_hit_tokens", "prompt tokens found in the device prefix cache",
             sched.prefix_cache_device_hits),
            ("jaxserve_prefix_cache_host_hit_tokens", "prompt tokens loaded from the prefix cache's host tier",
             sched.prefix_cache_host_hits),
            ("jaxserve_kv_offload_saved_bytes", "KV bytes the host tier took from the device",
             s.kv.offload_bytes_saved),
            ("jaxserve_kv_offload_loaded_bytes", "KV bytes loaded back from the host tier", s.kv.offload_bytes_loaded),
            ("jaxserve_spec_draft_tokens", "speculative guesses verified", sched.spec_num_draft_tokens),
            ("jaxserve_spec_accepted_tokens", "speculative guesses accepted", sched.spec_num_accepted_tokens),
            # rate(host_seconds) / rate(steps): the host's milliseconds per step now, under this load
            ("jaxserve_engine_steps", "engine steps run", steps.num_steps),
            ("jaxserve_engine_host_seconds", "host time inside engine steps, outside waiting for the device",
             steps.host_ms_per_step * steps.num_steps / 1000.0),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        finished = CounterMetricFamily("jaxserve_request_success", "finished requests by finish reason",
                                       labels=["finished_reason"])
        for reason, count in sorted(snap.finished_by_reason.items()):
            finished.add_metric([reason], count)
        yield finished
        if s.experts.tokens_total:   # a mixture-of-experts model: one series per expert (layers summed)
            routed = CounterMetricFamily("jaxserve_expert_routed_tokens", "tokens routed to each expert, summed "
                                         "over the MoE layers", labels=["expert"])
            for e, count in enumerate(s.experts.tokens_total):
                routed.add_metric([str(e)], count)
            yield routed
            yield GaugeMetricFamily("jaxserve_expert_load_imbalance", "over the last steps, the worst MoE layer's "
                                    "busiest expert over its mean (1 = even)", value=s.experts.imbalance)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], object | None]):
        self.registry = NamedRegistry()   # jaxserve's names, vLLM's or both (--metrics-names: vllm_metrics.py)
        self.registry.register(_EngineCollector(snapshot))
        r = self.registry
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jaxserve_inter_token_latency_seconds", "between consecutive token steps",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds", "arrival to finish or abort",
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue = Histogram("jaxserve_request_queue_time_seconds", "arrival to first scheduled",
                               buckets=_LATENCY_BUCKETS, registry=r)

    def observe(self, m: RequestMetrics | None, *, arrival_time: float | None = None,
                ended_at: float | None = None) -> None:
        """One request's timings when it ends, however it ends: finished, aborted or cancelled.
        `m` is the engine's (None if it ended before its first output); a request that did not
        finish in the engine has no finished_time, so `ended_at` (time.perf_counter()) ends it."""
        if m is not None:
            if m.first_scheduled_time is not None:
                self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if m.first_token_time is not None:
                self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            times = m.token_times
            for a, b in zip(times, times[1:]):
                if b > a:      # tokens of one step share a stamp: that is not an inter-token gap
                    self.itl.observe(b - a)
        start = m.arrival_time if m is not None else arrival_time
        end = m.finished_time if m is not None and m.finished_time is not None else ended_at
        if start is not None and end is not None:
            self.e2e.observe(max(0.0, end - start))
