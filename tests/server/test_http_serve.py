"""`jaxserve serve --http-port` as a real process: the HTTP API beside gRPC on one engine (one
Prometheus registry counting both fronts' requests), and alone (`--no-grpc`); /health 503 while
warming up, 200 once serving; SIGTERM ends it with 0."""

import httpx2 as httpx
import openai
import pytest

from jaxserve.client import GenerationClient
from tests.server.server_process import ServerProcess, free_port, wait_until


def http_health(base: str) -> int | None:
    try:
        return httpx.get(base + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def e2e_count(metrics_text: str) -> float:
    line = next(x for x in metrics_text.splitlines() if x.startswith("jaxserve_e2e_request_latency_seconds_count"))
    return float(line.split()[-1])


@pytest.mark.parametrize("grpc_too", [True, False], ids=["beside-grpc", "http-only"])
def test_serve_http(tiny_llm, tiny_llama_dir, xla_cache_dir, tmp_path_factory, grpc_too):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    srv = ServerProcess(tiny_llama_dir, xla_cache_dir, tmp_path_factory.mktemp("http") / "server.log",
                        "--http-port", str(port), *([] if grpc_too else ["--no-grpc"]), gated=True)
    try:
        # warm-up held until released: the HTTP port already listens and says 503
        assert wait_until(lambda: http_health(base), "the HTTP port to listen", guard_s=240) == 503
        srv.release_warm_up()
        wait_until(lambda: http_health(base) == 200, "the server to serve", guard_s=240)
        with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id
            r = client.completions.create(model=model, prompt="The tide comes in", max_tokens=3, temperature=0)
            assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")
        if grpc_too:
            with GenerationClient(srv.target, timeout=120) as c:
                assert c.generate("The tide comes in", max_tokens=3).completion_tokens >= 1
            # one registry: the HTTP /metrics and the metrics port count both fronts' requests
            assert e2e_count(httpx.get(base + "/metrics").text) == 2
            assert e2e_count(httpx.get(f"http://127.0.0.1:{srv.metrics_port}/metrics").text) == 2
        else:
            assert srv.health() is None        # no gRPC port
            assert e2e_count(httpx.get(base + "/metrics").text) == 1
        assert srv.terminate() == 0, srv.log()
    finally:
        srv.kill()
