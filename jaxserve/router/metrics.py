"""Prometheus metrics of the router (prometheus-client, one registry per router).

Per replica, read at scrape time from the Replica objects: health (1 serving), in-flight requests,
uncached prompt tokens pending, prefix-index size and requests routed. Counted as requests pass:
prompt tokens routed and how many of them the chosen replica's index matched (their ratio is the
router's expected prefix hit rate), retries by reason, and the router-side time to first token
and end-to-end latency (the client's view, replica and network included).
"""

from __future__ import annotations

from typing import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.router.replica import Replica

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _ReplicaCollector:
    def __init__(self, replicas: Callable[[], Sequence[Replica]]):
        self._replicas = replicas

    def collect(self):
        families = {
            "healthy": GaugeMetricFamily("jaxserve_router_replica_serving", "1 while the replica is SERVING",
                                         labels=["replica"]),
            "in_flight": GaugeMetricFamily("jaxserve_router_replica_in_flight", "the router's requests on it now",
                                           labels=["replica"]),
            "pending": GaugeMetricFamily("jaxserve_router_replica_pending_prefill_tokens",
                                         "uncached prompt tokens of its requests before their first token",
                                         labels=["replica"]),
            "indexed": GaugeMetricFamily("jaxserve_router_replica_indexed_tokens",
                                         "prompt tokens in the router's prefix index of it (policy kv_events: "
                                         "those its KV events say it caches)", labels=["replica"]),
        }
        batches = CounterMetricFamily("jaxserve_router_replica_kv_event_batches",
                                      "policy kv_events: its KV event batches applied", labels=["replica"])
        missed = CounterMetricFamily("jaxserve_router_replica_kv_event_batches_missed",
                                     "policy kv_events: its KV event batches neither received nor replayed",
                                     labels=["replica"])
        routed = CounterMetricFamily("jaxserve_router_replica_routed_requests", "requests sent to it",
                                     labels=["replica"])
        for r in self._replicas():
            families["healthy"].add_metric([r.target], 1.0 if r.serving else 0.0)
            families["in_flight"].add_metric([r.target], r.in_flight)
            families["pending"].add_metric([r.target], r.pending_prefill_tokens)
            families["indexed"].add_metric([r.target], r.index.num_tokens)
            routed.add_metric([r.target], r.routed_requests)
            sub = getattr(r.index, "subscriber", None)
            if sub is not None:
                batches.add_metric([r.target], sub.last_seq + 1)
                missed.add_metric([r.target], sub.num_missed)
        yield from families.values()
        yield from (routed, batches, missed)


class RouterMetrics:
    def __init__(self, replicas: Callable[[], Sequence[Replica]]):
        self.registry = r = CollectorRegistry()
        r.register(_ReplicaCollector(replicas))
        self.prompt_tokens = Counter("jaxserve_router_prompt_tokens", "prompt tokens routed (known ids only)",
                                     registry=r)
        self.matched_tokens = Counter("jaxserve_router_matched_tokens",
                                      "prompt tokens the chosen replica's prefix index matched", registry=r)
        self.retries = Counter("jaxserve_router_retries", "requests sent to another replica",
                               labelnames=["reason"], registry=r)
        self.prefill_hops = Counter("jaxserve_router_prefill_hops",
                                    "long prompts' prefill hops (--prefill), by outcome: kv_handed_over, or (the "
                                    "decode engine prefilled it, or by --prefill-failure-policy fail the client got "
                                    "UNAVAILABLE) prefill_unavailable (no serving prefill engine, or it refused), "
                                    "prefill_timeout (no answer within the hop's deadline)",
                                    labelnames=["outcome"], registry=r)
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "arrival at the router to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds", "arrival at the router to the end",
                             buckets=_E2E_BUCKETS, registry=r)
