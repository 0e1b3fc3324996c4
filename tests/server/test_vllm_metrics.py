"""vLLM's metric names on /metrics (server/vllm_metrics.py): after requests on the tiny model their
values are the engine's (prompt and generation tokens summed over the answers' usage, prefix cache
queries and hits, a held request running and holding KV), labelled with the served model's name;
--metrics-names shows vLLM's, jaxserve's or both; with LoRA, the adapters of the running and
waiting requests."""

import types

import httpx2 as httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.engine.stats import EngineStats, RequestTotals
from tests.engine.idle_stats import idle_scheduler_stats
from tests.server.http_harness import serving, wait_until

server, client = serving()

PROMPT = "Paged attention keeps the KV cache in fixed-size blocks, so"


def scrape(server) -> dict[str, dict[tuple, float]]:
    """Every sample of /metrics: name -> {its labels (sorted pairs): value}."""
    r = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=60)
    assert r.status_code == 200
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def vllm(samples, name: str, model: str) -> float:
    values = samples[name]
    assert list(values) == [(("model_name", model),)], values     # vLLM's one label: the served model
    return values[(("model_name", model),)]


def test_the_vllm_names_report_the_engines_counts(server, client):
    before = scrape(server)
    answers = [client.completions.create(model=server.model, prompt=PROMPT, max_tokens=n, temperature=0,
                                         extra_body={"ignore_eos": True}) for n in (3, 5, 4)]
    server.wait_idle()
    after, stats = scrape(server), server.stats()
    m = server.model

    def grew(name: str) -> float:
        return vllm(after, name, m) - vllm(before, name, m)
    assert grew("vllm:prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    assert grew("vllm:generation_tokens_total") == sum(a.usage.completion_tokens for a in answers) == 12
    assert grew("vllm:prefix_cache_queries_total") == sum(a.usage.prompt_tokens for a in answers)
    # the second and third found the first's full blocks
    assert grew("vllm:prefix_cache_hits_total") == sum(a.usage.prompt_tokens_details.cached_tokens
                                                       for a in answers) > 0
    assert vllm(after, "vllm:prompt_tokens_total", m) == stats.requests.prompt_tokens_total
    assert vllm(after, "vllm:prefix_cache_hits_total", m) == stats.scheduler.prefix_cache_hits
    assert vllm(after, "vllm:num_preemptions_total", m) == stats.scheduler.num_preemptions
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):
        assert vllm(after, name, m) == 0, name
    # jaxserve's own names beside them (--metrics-names both, the default)
    assert after["jaxserve_prompt_tokens_total"][()] == stats.requests.prompt_tokens_total


def test_a_request_in_flight_is_running_and_holds_kv(server, client):
    server.gate.close()
    try:
        stream = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=32, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))     # its first token: held there by the gate
        samples, stats = scrape(server), server.stats().scheduler
        assert vllm(samples, "vllm:num_requests_running", server.model) == stats.num_running == 1
        usage = vllm(samples, "vllm:kv_cache_usage_perc", server.model)
        assert usage == vllm(samples, "vllm:gpu_cache_usage_perc", server.model) == stats.kv_usage
        assert 0 < usage < 1
    finally:
        server.gate.open()
    stream.close()
    wait_until(lambda: server.stats().scheduler.num_running == 0, "the request to end")


class _Request:
    def __init__(self, lora_name):
        self.lora_name = lora_name


def _fake_engine(*, lora: bool):
    stats = EngineStats(idle_scheduler_stats(num_kv_blocks_total=10, num_kv_blocks_free=6, num_kv_blocks_cached=1,
                                             num_kv_blocks_in_use=3, num_running=2, num_waiting=3),
                        requests=RequestTotals(prompt_tokens_total=41))
    scheduler = types.SimpleNamespace(running=[_Request("b"), _Request(None), _Request("a")],
                                      waiting=[_Request("c"), _Request("a")])
    engine = types.SimpleNamespace(model_name="m-1", scheduler=scheduler,
                                   lora=types.SimpleNamespace(device=types.SimpleNamespace(max_loras=4)) if lora else None)
    return types.SimpleNamespace(snapshot=types.SimpleNamespace(stats=stats, taken_at=0.0, finished_by_reason={}),
                                 engine=engine)


def _exposed(names: str, aengine) -> dict[str, dict[tuple, float]]:
    from jaxserve.server.metrics import ServerMetrics
    from jaxserve.server.vllm_metrics import serve_vllm_names

    metrics = ServerMetrics(lambda: aengine.snapshot)
    serve_vllm_names(metrics.registry, names, lambda: aengine)
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


@pytest.mark.parametrize("names", ["both", "vllm", "jaxserve"])
def test_metrics_names_picks_the_families_shown(names):
    shown = _exposed(names, _fake_engine(lora=False))
    has_vllm = any(n.startswith("vllm:") for n in shown)
    has_jaxserve = any(n.startswith("jaxserve_") for n in shown)
    assert (has_vllm, has_jaxserve) == {"both": (True, True), "vllm": (True, False), "jaxserve": (False, True)}[names]
    if has_vllm:
        assert shown["vllm:kv_cache_usage_perc"] == {(("model_name", "m-1"),): 0.3}   # (10 - 6 - 1) / 10
        assert shown["vllm:num_requests_waiting"] == {(("model_name", "m-1"),): 3}
        assert "vllm:lora_requests_info" not in shown     # no LoRA: no gauge, as vLLM


def test_the_lora_gauge_names_the_adapters_of_running_and_waiting_requests():
    [(labels, value)] = _exposed("vllm", _fake_engine(lora=True))["vllm:lora_requests_info"].items()
    assert dict(labels) == {"running_lora_adapters": "a,b", "waiting_lora_adapters": "a,c", "max_lora": "4"}
    assert value > 0      # when it was read: the endpoint picker takes the latest


def test_an_unknown_names_setting_is_refused():
    from jaxserve.server.server import ServerConfig

    with pytest.raises(ValueError, match="metrics_names"):
        ServerConfig(metrics_names="prometheus")
