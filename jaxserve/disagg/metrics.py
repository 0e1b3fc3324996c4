"""Prometheus metrics of a prefill or decode engine's KV transfers, read at scrape time from the
connector's and the scheduler's counters (plain numbers, written on the step thread and the pull
workers; a scrape reads them without locks and never touches the engine's work)."""

from __future__ import annotations

from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from jaxserve.disagg.connector import TRANSFER_SECONDS_BUCKETS


class DisaggCollector:
    def __init__(self, engine: Callable[[], object | None]):
        self._engine = engine

    def collect(self):
        engine = self._engine()
        conn = getattr(engine, "kv_connector", None) if engine is not None else None
        if conn is None:
            return
        s = engine.scheduler.stats()
        m = conn.metrics
        yield CounterMetricFamily("jaxserve_kv_transfers", "KV loads received and written into blocks",
                                  value=m.transfers)
        yield CounterMetricFamily("jaxserve_kv_transfer_bytes", "KV bytes received", value=m.bytes)
        counts, total = m.seconds_histogram()
        cumulative, buckets = 0, []
        for bound, c in zip(list(TRANSFER_SECONDS_BUCKETS) + [float("inf")], counts):
            cumulative += c
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily("jaxserve_kv_transfer_seconds", "a KV pull, start to all bytes received",
                                    buckets=buckets, sum_value=total)
        fallbacks = CounterMetricFamily("jaxserve_kv_load_fallbacks",
                                        "KV loads that failed, by reason (then recomputed or failed by policy)",
                                        labels=["reason"])
        for reason, count in sorted(dict(s.kv_load_fallbacks).items()):
            fallbacks.add_metric([reason], count)
        yield fallbacks
        yield CounterMetricFamily("jaxserve_kv_stale_transfers_dropped",
                                  "KV arrivals dropped by the generation check (their load was cancelled)",
                                  value=(conn.receiver.num_stale if conn.receiver is not None else 0))
        leases = conn.sender.leases if conn.sender is not None else None
        yield CounterMetricFamily("jaxserve_kv_leases_expired", "sender leases that ran out before an acknowledgement",
                                  value=leases.num_expired if leases is not None else 0)
        yield CounterMetricFamily("jaxserve_kv_leases_released", "sender leases the receiver acknowledged",
                                  value=leases.num_released if leases is not None else 0)
        yield GaugeMetricFamily("jaxserve_kv_leases_live", "sender leases holding blocks now",
                                value=len(leases) if leases is not None else 0)
        yield GaugeMetricFamily("jaxserve_kv_loads_in_flight", "requests waiting for their KV to arrive",
                                value=s.num_kv_loading)
