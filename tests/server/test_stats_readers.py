"""The Prometheus metrics and gRPC ServerInfo read from one known EngineStats: every series and
every wire field keeps its name and value (dashboards and clients depend on them). Each counter
of the snapshot has a value of its own, so a metric read from the wrong part shows here."""

import types

from google.protobuf.json_format import MessageToDict
from prometheus_client import generate_latest

from jaxserve.engine.stats import (EngineStats, ExpertLoadStats, KVArenaStats, Lifecycle, RequestTotals, StepStats,
                                   WeightStats)
from jaxserve.parallel.mesh import MeshInfo
from jaxserve.server import metrics
from jaxserve.server.convert import server_info
from tests.engine.idle_stats import idle_scheduler_stats

# what the server reported for KNOWN before EngineStats was split by concern
EXPECTED_METRICS = {
    'jaxserve_num_requests_running': 3.0,
    'jaxserve_num_requests_waiting': 2.0,
    'jaxserve_kv_cache_usage': 0.25,
    'jaxserve_kv_blocks_free': 61.0,
    'jaxserve_kv_blocks_cached': 14.0,
    'jaxserve_kv_blocks_total': 100.0,
    'jaxserve_prefix_cache_hit_rate': 0.375,
    'jaxserve_host_blocks_cached': 9.0,
    'jaxserve_host_blocks_in_use': 6.0,
    'jaxserve_host_blocks_total': 64.0,
    'jaxserve_compilations_after_warmup': 1.0,
    'jaxserve_uptime_seconds': 14.5,
    'jaxserve_device_idle_fraction': 0.125,
    'jaxserve_prompt_tokens_total': 4321.0,
    'jaxserve_generation_tokens_total': 987.0,
    'jaxserve_preemptions_total': 7.0,
    'jaxserve_prefix_cache_device_hit_tokens_total': 252.0,
    'jaxserve_prefix_cache_host_hit_tokens_total': 48.0,
    'jaxserve_kv_offload_saved_bytes_total': 12288.0,
    'jaxserve_kv_offload_loaded_bytes_total': 20480.0,
    'jaxserve_spec_draft_tokens_total': 30.0,
    'jaxserve_spec_accepted_tokens_total': 17.0,
    'jaxserve_engine_steps_total': 400.0,
    'jaxserve_engine_host_seconds_total': 1.0,
    'jaxserve_request_success_total{finished_reason="length"}': 30.0,
    'jaxserve_request_success_total{finished_reason="stop"}': 11.0,
    'jaxserve_expert_routed_tokens_total{expert="0"}': 7.0,
    'jaxserve_expert_routed_tokens_total{expert="1"}': 2.0,
    'jaxserve_expert_load_imbalance': 1.5,
}

EXPECTED_SERVER_INFO = {
    "numKvBlocksTotal": 100, "numKvBlocksFree": 61, "numKvBlocksCached": 14, "numRequestsRunning": 3,
    "numRequestsWaiting": 2, "numPreemptions": "7", "numCompilationsAfterWarmup": "1", "uptimeS": 12.5,
    "promptTokensTotal": "4321", "generationTokensTotal": "987", "numRequestsFinished": "41", "kvUsage": 0.25,
    "prefixHitRate": 0.375, "activeStreams": 2, "state": "serving",
    "mesh": {"numDevices": 4, "numHosts": 2, "axisSizes": {"data": 1, "model": 4}},
    "weightsVersion": "v7", "numWeightUpdates": "2", "paused": True, "numRequestsHeld": 5,
}


def known() -> EngineStats:
    return EngineStats(
        idle_scheduler_stats(
            num_kv_blocks_total=100, num_kv_blocks_free=61, num_kv_blocks_cached=14, num_kv_blocks_in_use=25,
            num_running=3, num_waiting=2, prefix_cache_queries=800, prefix_cache_hits=300,
            num_preemptions_recompute=4, num_preemptions_swap=3, prefix_cache_host_hits=48,
            num_host_blocks_total=64, num_host_blocks_cached=9, num_host_blocks_in_use=6,
            kv_blocks_saved=3, kv_blocks_loaded=5,
            spec_num_draft_tokens=30, spec_num_accepted_tokens=17, spec_num_verifications=10),
        kv=KVArenaStats(dtype="float32", bytes_per_block=4096, offload_bytes_saved=3 * 4096,
                        offload_bytes_loaded=5 * 4096),
        steps=StepStats(num_steps=400, host_ms_per_step=2.5, device_idle_fraction=0.125,
                        num_compilations_after_warmup=1),
        requests=RequestTotals(prompt_tokens_total=4321, generation_tokens_total=987, num_finished=41, num_held=5),
        weights=WeightStats(version="v7", num_updates=2),
        lifecycle=Lifecycle(uptime_s=12.5, paused=True),
        experts=ExpertLoadStats(tokens_window=(3, 1), tokens_total=(7, 2), imbalance=1.5),
        mesh=MeshInfo(4, 2, (("data", 1), ("model", 4)), "cpu"))


def scraped(stats: EngineStats, monkeypatch) -> dict[str, float]:
    """The engine's series as a scrape 2 s after the snapshot sees them (histograms left out:
    they are per request, not read from the snapshot)."""
    monkeypatch.setattr(metrics.time, "monotonic", lambda: 1000.0)
    snap = types.SimpleNamespace(stats=stats, taken_at=998.0, finished_by_reason={"length": 30, "stop": 11})
    text = generate_latest(metrics.ServerMetrics(lambda: snap).registry).decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or "_created" in line:
            continue
        name, value = line.rsplit(" ", 1)
        if not any(h in name for h in ("_latency_seconds", "_queue_time_seconds", "_first_token_seconds")):
            out[name] = float(value)
    return out


def test_every_prometheus_series_reads_the_same_value(monkeypatch):
    assert scraped(known(), monkeypatch) == EXPECTED_METRICS


def test_every_server_info_field_reads_the_same_value():
    got = MessageToDict(server_info(known(), active_streams=2, state="serving"))
    assert got == EXPECTED_SERVER_INFO
